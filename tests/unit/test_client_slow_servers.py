"""A server that answers pings but answers every step late (overloaded, throttled, or a slow-loris holding its
sessions just under `request_timeout_s`) against in-process fake servers (no network): the session moves to another
server of the span once the span's late budget is spent, replays its history there (outputs exact, no token lost or
duplicated), and the slow server is avoided, not banned; an honest server with one slow step keeps its session; the
only server of a span is kept (decision 0144). The budgets are scaled down (deadline floor 0.2 s, budget 1-2 s)
against a `request_timeout_s` of 20 s, so that the old client (which waited out each slow step) fails in about a
minute, not hours."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import select
import socket
import threading
import time
import types
import weakref
from collections.abc import Callable

import pytest
import torch
from hivemind.proto import runtime_pb2

from corolla.client.routing.announced_pace import announced_step_s, announced_token_s
from corolla.client.session import inference_session, replacement_race, span_session, stalls, unheard_pairs
from corolla.client.session.inference_session import InferenceSession
from corolla.client.session.replacement_race import (
    TRIAL_TOKENS,
    RaceEvent,
    TrialDisagrees,
    check_trial,
    race_candidates,
)
from corolla.client.session.stalls import LATE_LEAK, StepClock
from corolla.client.transport import framed_socket
from corolla.client.transport.local_transport import LocalInferenceStream
from corolla.client.verification import witnesses as witness_rules
from corolla.protocol import local_stream as ls
from corolla.protocol.codecs import deserialize_tensor, serialize_tensor
from corolla.protocol.records import RemoteSpanInfo
from corolla.swarm.route_planning import proven_where_they_cover
from helpers.fake_chain import (
    HIDDEN,
    AnswersAfter,
    FakeManager,
    FakeServer,
    FakeStream,
    Judgements,
    Referee,
    RefereeAnswersAfter,
    record_of,
    reference,
    vouch,
)

pytestmark = pytest.mark.usefixtures("frozen_heap")  # steps timed in real time: no pause of the heap's GC

REQUEST_TIMEOUT_S = 20.0
LORIS_DELAY_S = REQUEST_TIMEOUT_S - 2.0  # every step answered just under the timeout


@pytest.fixture
def small_budgets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stalls, "STALL_MIN_S", 0.2)
    monkeypatch.setattr(stalls, "LATE_BUDGET_S", 1.0)


def _manager(servers: dict[str, FakeServer]) -> FakeManager:
    return FakeManager(servers, 4, request_timeout_s=REQUEST_TIMEOUT_S, liveness_check_period_s=1.0)


def _sixteen_steps(
    manager: FakeManager,
    turn: Callable[[], object],
    turn_at: int = 12,
    race_events: list[RaceEvent] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[str], list[stalls.StallEvent]]:
    """A fresh session of 16 one-token steps over random inputs, `turn()` run before token `turn_at` (when the lorises
    of these tests start holding): its inputs [1, 16, H], its outputs [1, 16, H], its route's peer ids at its end and
    its stall events; its race events recorded in `race_events` where given."""
    tokens = torch.randn(1, 16, HIDDEN)
    outputs = []
    with InferenceSession(manager, max_length=16) as session:
        if race_events is not None:
            session.race_events = race_events
        for t in range(16):
            if t == turn_at:
                turn()
            outputs.append(session.step(tokens[:, t : t + 1]))
        route = [span.peer_id for span, _ in session.route]
        events = list(session.stall_events)
    return tokens, torch.cat(outputs, dim=1), route, events


def _hold(servers: dict[str, FakeServer], kind: type) -> Callable[[], object]:
    """Every server of `kind` starts holding (a loris of these tests' kinds)."""

    def hold() -> None:
        for server in servers.values():
            if isinstance(server, kind):
                server.holding = True  # type: ignore[attr-defined]

    return hold


def _turn_lorises(servers: dict[str, FakeServer]) -> None:
    """Every server but H holds its steps `LORIS_DELAY_S`."""
    for name, server in servers.items():
        server.delay_s = LORIS_DELAY_S if name != "H" else 0.0


def _served_tokens(server: FakeServer) -> int:
    return sum(tokens for _, tokens in server.requests)


@pytest.mark.parametrize("slow_from", [0, 3], ids=["slow_from_its_first_step", "slow_after_three_steps"])
def test_a_slow_loris_loses_its_session_to_another_server(small_budgets, slow_from: int):
    """A (announcing the best figures, so routed first) answers pings and every step after `slow_from` just under
    `request_timeout_s`; B holds the same blocks. The session moves to B at the first slow step (deadline + budget),
    replays its history there once, and the outputs are the reference's; A is avoided, not banned. Steps are one token
    each (a decode step: timed from the first, by the step time A announces)."""
    torch.manual_seed(0)
    servers = {"A": FakeServer(0, 4, inference_rps=1000.0), "B": FakeServer(0, 4)}
    manager = _manager(servers)
    tokens = torch.randn(1, 8, HIDDEN)
    outputs = []
    with InferenceSession(manager, max_length=8) as session:
        for t in range(8):
            if t == slow_from:
                servers["A"].delay_s = LORIS_DELAY_S
            outputs.append(session.step(tokens[:, t : t + 1]))
        assert [span.peer_id for span, _ in session.route] == ["B"]
        events = list(session.stall_events)
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    moved = [e for e in events if e.action == "moved"]
    assert len(moved) == 1 and moved[0].peer_id == "A" and moved[0].blocks == (0, 4), events
    assert moved[0].detected_after_s < LORIS_DELAY_S  # it did not wait for the slow answer
    replay_metadata, replay_tokens = servers["B"].requests[0]
    assert replay_metadata["start_from_position"] == 0 and replay_tokens == slow_from + 1  # history + the new token
    assert _served_tokens(servers["B"]) == 8 and servers["B"].final_lengths == [8]  # each position once
    assert "A" in manager.avoided_peers() and not manager.bans.is_banned("A")


class UnreadStream(FakeStream):
    """A's stream once its server `stops_reading`: a request is taken only `LORIS_DELAY_S` after it was written (a
    server that answers pings and leaves a long request unread in its socket: the client's write blocks)."""

    async def send(self, request) -> None:
        if getattr(self.server, "stops_reading", False):
            await asyncio.sleep(LORIS_DELAY_S)
        await super().send(request)


def test_a_server_that_stops_reading_its_requests_loses_its_session_from_the_client_loop(
    small_budgets, monkeypatch: pytest.MonkeyPatch
):
    """hrev18 (decision 0245): A (the best figures, routed first) answers pings but, from token 3, leaves each request
    unread for `LORIS_DELAY_S` (a long step's request does not fit the socket's buffers: the client's write waits on
    the server's reads); B holds the same blocks. The step's wait covers the write as it covers the reply: A is a
    loris, moved off at its deadline plus the late budget, the session replayed on B. On main the write was awaited
    before the step's wait began, with no timeout at all (the client loop's path; the caller's thread had
    `request_timeout_s`, 180 s by default): the step was held as long as A kept the request unread, no stall seen."""
    monkeypatch.setattr(
        FakeManager,
        "open_inference_stream",
        lambda self, peer_id, rpc="rpc_inference": UnreadStream(self.servers[peer_id], rpc).open(),
    )
    torch.manual_seed(0)
    servers = {"A": FakeServer(0, 4, inference_rps=1000.0), "B": FakeServer(0, 4)}
    manager = _manager(servers)
    tokens, outputs = torch.randn(1, 6, HIDDEN), []
    with InferenceSession(manager, max_length=6) as session:
        for t in range(6):
            servers["A"].stops_reading = t == 3  # type: ignore[attr-defined]
            started = time.monotonic()
            outputs.append(session.step(tokens[:, t : t + 1]))
            assert time.monotonic() - started < LORIS_DELAY_S / 2, t
        route, events = [span.peer_id for span, _ in session.route], list(session.stall_events)
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    assert route == ["B"] and [(e.peer_id, e.action) for e in events][-1] == ("A", "moved"), events
    assert "A" in manager.avoided_peers() and not manager.bans.is_banned("A")


def test_an_honest_server_with_one_slow_step_keeps_its_session(small_budgets, monkeypatch: pytest.MonkeyPatch):
    """One step 0.6 s late (a GC pause, another client's prefill) spends part of the budget (2 s here): the session
    stays, nothing is replayed, the server is neither avoided nor banned."""
    monkeypatch.setattr(stalls, "LATE_BUDGET_S", 2.0)
    torch.manual_seed(1)
    servers = {"A": FakeServer(0, 4, inference_rps=1000.0), "B": FakeServer(0, 4)}
    manager = _manager(servers)
    tokens = torch.randn(1, 8, HIDDEN)
    outputs = []
    with InferenceSession(manager, max_length=8) as session:
        for t in range(8):
            servers["A"].delay_s = 0.8 if t == 4 else 0.0
            outputs.append(session.step(tokens[:, t : t + 1]))
        assert [span.peer_id for span, _ in session.route] == ["A"]
        events = list(session.stall_events)
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    assert events and {e.action for e in events} == {"slow"}, events
    assert servers["B"].requests == [] and _served_tokens(servers["A"]) == 8
    assert "A" not in manager.avoided_peers() and not manager.bans.is_banned("A")


def test_the_only_server_of_a_span_is_kept_however_slow(small_budgets):
    """A is the only server of its blocks: each slow step is waited for (past the budget), nothing moves."""
    torch.manual_seed(2)
    servers = {"A": FakeServer(0, 4, inference_rps=1000.0)}
    manager = _manager(servers)
    tokens = torch.randn(1, 5, HIDDEN)
    outputs = []
    with InferenceSession(manager, max_length=5) as session:
        outputs.append(session.step(tokens[:, :2]))
        servers["A"].delay_s = 1.5  # past the deadline (0.2 s) and the budget (1 s)
        for t in range(2, 5):
            outputs.append(session.step(tokens[:, t : t + 1]))
        events = list(session.stall_events)
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    assert events and {e.action for e in events} == {"slow"}, events
    assert _served_tokens(servers["A"]) == 5 and servers["A"].final_lengths == [5]
    assert "A" not in manager.avoided_peers() and not manager.bans.is_banned("A")


class SocketServed:
    """A fake server behind one end of a socket pair, served by its own loop in a thread; the client's end is a
    `LocalInferenceStream`, so the session's steps run in the caller's thread (`SpanSession.step_here`)."""

    def __init__(self, server: FakeServer, peer_id: str):
        client, self._sock = socket.socketpair()
        client.setblocking(False)
        self.stream = LocalInferenceStream(client, peer_id)
        self._server, self._loop = server, asyncio.new_event_loop()
        self._task: asyncio.Task | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._run(),), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        self._task = asyncio.current_task()
        reader, writer = await asyncio.open_connection(sock=self._sock)

        async def requests():
            while True:
                kind, payload = await ls.read_frame(reader, 1 << 24)
                if kind != ls.MESSAGE:
                    return
                yield runtime_pb2.ExpertRequest.FromString(payload)

        with contextlib.suppress(Exception, asyncio.CancelledError):  # the client closed its end
            async for response in await self._server.rpc_inference(requests()):
                writer.writelines(ls.frame(ls.MESSAGE, response.SerializeToString()))
                await writer.drain()
        writer.close()

    def stop(self) -> None:
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(5)
        self._loop.close()


def socket_served(monkeypatch: pytest.MonkeyPatch, manager, server: FakeServer) -> SocketServed:
    """`server` as peer "A" behind a socket the session's steps run over in the caller's thread (its streams opened
    there, its input compression known); `stop` it when done."""
    served = SocketServed(server, "A")

    async def open_socket_stream(manager, peer_id, rpc):
        return served.stream if peer_id == "A" else None

    monkeypatch.setattr(span_session, "open_socket_stream", open_socket_stream)
    monkeypatch.setattr(manager, "cached_input_compression", lambda peer_id: runtime_pb2.CompressionType.NONE)
    return served


def test_a_slow_server_on_a_socket_stream_is_left_from_the_callers_thread(small_budgets, monkeypatch):
    """The same over the server's socket, where steps run in the caller's thread: the wait ends at the deadline plus
    the budget, the span is replaced without a ban, and the outputs are exact."""
    torch.manual_seed(3)
    servers = {"A": FakeServer(0, 4, inference_rps=1000.0), "B": FakeServer(0, 4)}
    manager = _manager(servers)
    served = socket_served(monkeypatch, manager, servers["A"])
    tokens = torch.randn(1, 8, HIDDEN)
    outputs = []
    try:
        with InferenceSession(manager, max_length=8) as session:
            for t in range(8):
                if t == 4:
                    servers["A"].delay_s = LORIS_DELAY_S
                outputs.append(session.step(tokens[:, t : t + 1]))
            assert [span.peer_id for span, _ in session.route] == ["B"]
            steps_here, events = session.num_steps_here, list(session.stall_events)
    finally:
        served.stop()
    assert steps_here >= 3  # steps 1-3 ran in this thread (the first opens the session through the loop)
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    assert [e.action for e in events if e.action == "moved"] == ["moved"], events
    replay_metadata, replay_tokens = servers["B"].requests[0]
    assert replay_metadata["start_from_position"] == 0 and replay_tokens == 5
    assert _served_tokens(servers["B"]) == 8 and servers["B"].final_lengths == [8]
    assert "A" in manager.avoided_peers() and not manager.bans.is_banned("A")


def test_step_clock_deadline_and_late_budget():
    """The clock's rules (no waiting): the first decode step's deadline comes from the announced step time, measured
    steps may not raise it past 4x that; late seconds are charged, leak at LATE_LEAK of wall time, and run out."""
    assert announced_step_s(4, 100.0) == pytest.approx(0.04) and announced_step_s(4, None) is None
    assert StepClock().deadline_s(1) == stalls.STEP_MAX_S  # nothing announced, nothing measured: still a bound
    clock = StepClock(announced_step_s(20, 4.0))  # 5 s a step announced
    assert clock.deadline_s(1) == pytest.approx(20.0)
    clock.record(1, 0.1)
    assert clock.deadline_s(1) == pytest.approx(stalls.STALL_MIN_S)
    for elapsed_s in (0.4, 1.6, 6.4, 19.0):  # each within 4x the last: a ramp
        clock.record(1, elapsed_s)
    assert clock.deadline_s(1) == pytest.approx(20.0)  # capped at 4x the announced 5 s, not 76 s
    budget = stalls.LATE_BUDGET_S
    assert clock.late_left_s(100.0) == budget
    clock.charge_late(budget / 2, 100.0)
    assert clock.late_left_s(100.0) == pytest.approx(budget / 2)
    assert clock.late_left_s(110.0) == pytest.approx(budget / 2 + 10 * LATE_LEAK)  # leaks back
    clock.charge_late(budget, 110.0)
    assert clock.late_left_s(110.0) < 0  # spent: the next late step moves the session
    assert clock.late_left_s(110.0 + 2 * budget / LATE_LEAK) == budget  # never more than the whole budget


@pytest.fixture
def small_long_step_floor(small_budgets, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stalls, "LONG_STEP_MIN_S", 0.5)


PROMPT_TOKENS = 24  # a long step (more than DECODE_MAX_TOKENS): timed by its tokens


def test_a_loris_holding_a_prompt_loses_it_to_another_server(small_long_step_floor):
    """A (announcing the best figures, routed first) answers pings and holds every step just under
    `request_timeout_s`, the session's first step (a 24-token prompt) too: the prompt moves to B within its deadline
    (the floor: A's announced rate makes it ~0.4 s) plus the budget, and the outputs are the reference's."""
    torch.manual_seed(4)
    servers = {"A": FakeServer(0, 4, inference_rps=1000.0), "B": FakeServer(0, 4)}
    servers["A"].delay_s = LORIS_DELAY_S
    manager = _manager(servers)
    tokens = torch.randn(1, PROMPT_TOKENS + 4, HIDDEN)
    with InferenceSession(manager, max_length=tokens.shape[1]) as session:
        outputs = [session.step(tokens[:, :PROMPT_TOKENS])]
        outputs += [session.step(tokens[:, t : t + 1]) for t in range(PROMPT_TOKENS, tokens.shape[1])]
        assert [span.peer_id for span, _ in session.route] == ["B"]
        events = list(session.stall_events)
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    # B's first step is the prompt (the old client waited out A's, then moved at the first decode step: 25 tokens)
    assert servers["B"].requests[0][1] == PROMPT_TOKENS and _served_tokens(servers["B"]) == tokens.shape[1]
    moved = [e for e in events if e.action == "moved"]
    assert len(moved) == 1 and moved[0].peer_id == "A" and moved[0].num_tokens == PROMPT_TOKENS, events
    assert moved[0].step_deadline_s == pytest.approx(0.5, abs=0.01)  # the floor (+ 1.5 kB at a slow link)
    assert moved[0].detected_after_s < LORIS_DELAY_S
    assert "A" in manager.avoided_peers() and not manager.bans.is_banned("A")


def test_a_loris_racing_for_the_replay_loses_it(small_long_step_floor):
    """A turns slow at token 12 and the session moves (a decode step's rule); the replacement is raced between B, a
    loris too, and C (decision 0163): each is sent the span's first 8 positions, C answers first and is sent the rest
    (positions 8-12), B is closed without being waited for. Before 0163 the usual routing chose B (it announces more
    speed), which held the 13-position replay until its deadline plus the budget before C got it. Every position is
    computed once on C, the outputs are the reference's."""
    torch.manual_seed(5)
    servers = {
        "A": FakeServer(0, 4, inference_rps=1000.0),
        "B": FakeServer(0, 4, inference_rps=500.0),
        "C": FakeServer(0, 4),
    }
    servers["B"].delay_s = LORIS_DELAY_S
    manager = _manager(servers)
    tokens, outputs, route, events = _sixteen_steps(manager, lambda: setattr(servers["A"], "delay_s", LORIS_DELAY_S))
    assert route == ["C"]
    torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)
    assert [tokens for _, tokens in servers["C"].requests[:2]] == [TRIAL_TOKENS, 13 - TRIAL_TOKENS]
    assert _served_tokens(servers["C"]) == 16 and servers["C"].final_lengths == [16]
    assert [(e.peer_id, e.num_tokens) for e in events if e.action == "moved"] == [("A", 1)], events
    # closed when C won (a loaded machine may pass B's 0.2 s deadline first: a `slow` event, within the budget)
    assert not [e for e in events if e.peer_id == "B" and e.action != "slow"], events
    assert not manager.bans.is_banned("B") and "B" not in manager.avoided_peers()


@pytest.mark.parametrize("lorises", [1, 3, 7, 12])
def test_many_lorises_cost_one_move(small_long_step_floor, lorises: int):
    """K servers announcing the best figures (identities cost nothing: K is the attacker's choice) answer pings and
    hold every step from token 12, beside one honest server H that announces less. The session pays the first
    loris's deadline plus the late budget, then races the span among the others and H (decision 0163), 8 at once and
    8 more each round (0.2 s here) while none answered: one move whatever K. The old client re-planned by the announced figures after each move and walked the lorises in turn,
    each holding the replay its deadline plus the budget: K moves. Outputs are the reference's, every position is
    computed once on H, only the loris moved off is avoided, none is banned."""
    torch.manual_seed(7)
    servers = {f"L{i}": FakeServer(0, 4, inference_rps=1000.0) for i in range(lorises)}
    servers["H"] = FakeServer(0, 4)
    manager = _manager(servers)
    tokens, outputs, route, events = _sixteen_steps(manager, lambda: _turn_lorises(servers))
    assert route == ["H"]
    torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)
    moved = [e for e in events if e.action == "moved"]
    assert len(moved) == 1 and moved[0].peer_id.startswith("L") and moved[0].num_tokens == 1, events
    # a lone candidate gets the whole replay (no race); raced, H is sent the first 8 positions, then the rest
    first = [13] if lorises == 1 else [TRIAL_TOKENS, 13 - TRIAL_TOKENS]
    assert [tokens for _, tokens in servers["H"].requests[: len(first)]] == first
    assert _served_tokens(servers["H"]) == 16 and servers["H"].final_lengths == [16]
    assert manager.avoided_peers() == {moved[0].peer_id} and not manager.bans.banned_peers()


class TrialLoris(FakeServer):
    """Honest until `holding`; then a fresh session's first step (a race's trial) is answered at once with outputs it
    never computed (noise of the right shape; with `coordinated`, the same noise as every other such loris), and every
    later step held just under `request_timeout_s`."""

    holding = False
    coordinated = False

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            metadata, _ = self.requests[-1]
            if self.holding and metadata["start_from_position"] == 0:
                like = deserialize_tensor(response.tensors[0])
                seeded = torch.Generator().manual_seed(11) if self.coordinated else None
                noise = torch.randn(like.shape, generator=seeded, dtype=like.dtype)
                response = runtime_pb2.ExpertResponse(tensors=[serialize_tensor(noise)])
            elif self.holding:
                await asyncio.sleep(LORIS_DELAY_S)
            yield response


class Bfloat16Replies(FakeServer):
    """Computes as `FakeServer` and sends its outputs in bfloat16 (a GPU server's wire dtype; a float32 client casts
    them to its own)."""

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            outputs = deserialize_tensor(response.tensors[0]).to(torch.bfloat16)
            yield runtime_pb2.ExpertResponse(tensors=[serialize_tensor(outputs)])


@pytest.mark.parametrize(
    ("last", "wire", "coordinated"),
    [
        (False, torch.float32, False),
        (True, torch.float32, False),
        (False, torch.bfloat16, False),
        (False, torch.float32, True),
    ],
    ids=["a_middle_span", "the_last_span", "bfloat16_servers", "the_same_noise"],
)
def test_lorises_answering_the_trial_at_once_do_not_win_the_race(
    small_long_step_floor, last: bool, wire: torch.dtype, coordinated: bool
):
    """K = 3 lorises of blocks 0:2 (the best figures) hold every step from token 12 but answer a race's trial at once,
    uncomputed, beside H (50 ms a step) and C (2:4); or of the whole chain 0:4 beside H: a trial's outputs must agree
    with what the span gave before (C's inputs there; the chain's first outputs, kept by the session), so H wins the
    first race: one move, outputs the reference's, the lorises neither banned nor avoided nor counted as seen on time
    for their trials. Before,
    the first answer won: each loris in turn won a race and held the rest (3 moves; 7 lorises: 63 s, 7 moves, in
    process). Lorises answering the same noise agree with each other: such a pair wins only where no racer agreeing
    with the span's earlier outputs answers within a round after it formed (decision 0183), and H does; the pair
    that lost its round to H is judged all the same (decision 0238): no referee answers (none holds the span outside
    the lorises), so H's trial is the only word against it: unheard (decision 0248), nobody avoided, the pair watched
    (refuted and avoided before 0248, on the winner's word alone)."""
    torch.manual_seed(8)
    end = 4 if last else 2
    servers: dict[str, FakeServer] = {f"L{i}": TrialLoris(0, end, inference_rps=1000.0) for i in range(3)}
    for loris in servers.values():
        loris.coordinated = coordinated  # type: ignore[attr-defined]
    servers["H"] = FakeServer(0, end) if wire is torch.float32 else Bfloat16Replies(0, end)
    servers["H"].delay_s = 0.05
    if not last:
        servers["C"] = FakeServer(2, 4)
    manager = _manager(servers)
    tokens, outputs, route, events = _sixteen_steps(manager, _hold(servers, TrialLoris))
    assert route == (["H"] if last else ["H", "C"])
    moved = [e for e in events if e.action == "moved"]
    assert len(moved) == 1 and moved[0].peer_id.startswith("L"), events
    racing = {name for name in servers if name.startswith("L")} - {moved[0].peer_id}
    assert manager.avoided_peers() == {moved[0].peer_id}
    assert manager.disputes.watched() == (racing if coordinated else set())
    assert not manager.bans.banned_peers()
    # the lorises' trials came on time but proved nothing: the next sessions are not planned over them (0163's rule)
    assert manager.answered_on_time() == ({"H"} if last else {"H", "C"})
    if wire is torch.float32:
        torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)
    else:  # H's last positions rounded to bfloat16 on their way to C
        torch.testing.assert_close(outputs, reference(tokens, 4), atol=0.1, rtol=0.05)


def test_the_session_keeps_the_chains_first_outputs_through_rollbacks():
    """The chain's outputs at its first `TRIAL_TOKENS` positions, which a race for the last span checks its trials
    against, follow the steps as they are returned: a rollback's later positions are replaced by the new ones."""
    torch.manual_seed(9)
    manager = _manager({"A": FakeServer(0, 2), "B": FakeServer(2, 4)})
    tokens, other = torch.randn(1, 12, HIDDEN), torch.randn(1, 1, HIDDEN)
    with InferenceSession(manager, max_length=12) as session:
        session.step(tokens[:, :3])
        session.step(tokens[:, 3:5])
        session.position = 4  # the 5th position is taken back and another sent
        session.step(other)
        for t in range(5, 12):
            session.step(tokens[:, t : t + 1])
        kept = session._first_outputs
    sent = torch.cat([tokens[:, :4], other, tokens[:, 5:]], dim=1)
    assert kept is not None
    torch.testing.assert_close(kept, reference(sent, 4)[:, :TRIAL_TOKENS], atol=1e-5, rtol=0)


def test_check_trial() -> None:
    expected = torch.randn(1, 8, HIDDEN)
    check_trial("peer", expected + 1e-4 * torch.randn(1, 8, HIDDEN), expected, 1e-3)
    check_trial("peer", torch.randn(1, 8, HIDDEN), None, 1e-3)  # nothing known: nothing checked
    check_trial("peer", torch.randn(1, 13, HIDDEN), expected[:, :0], 1e-3)
    check_trial("peer", torch.cat([expected[:, :5], torch.randn(1, 3, HIDDEN)], dim=1), expected[:, :5], 1e-3)
    for wrong in (torch.randn(1, 8, HIDDEN), torch.zeros(1, 8, HIDDEN), expected[:, :4]):
        with pytest.raises(TrialDisagrees):
            check_trial("peer", wrong, expected, 0.25)


class FirstPositionsLoris(FakeServer):
    """Lies at the span's first `TRIAL_TOKENS` positions whenever it answers them (each output there moved by 3% of
    its norm, the same way on every such loris: coordinated), honest elsewhere; from `holding` on, every step held
    just under `request_timeout_s`. A loris that poisons the race's reference (the span's earlier outputs) so that
    every honest racer disagrees with it."""

    holding = False

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            metadata, _ = self.requests[-1]
            start = metadata["start_from_position"]
            if start < TRIAL_TOKENS:
                response = _first_positions_lie(response, start)
            if self.holding:
                await asyncio.sleep(LORIS_DELAY_S)
            yield response


def _first_positions_lie(response: runtime_pb2.ExpertResponse, start: int) -> runtime_pb2.ExpertResponse:
    """`response`'s outputs [B, T, H] from position `start`, those before `TRIAL_TOKENS` moved by 3% of their norm
    (the same way on every identity of the liar's)."""
    outputs = deserialize_tensor(response.tensors[0]).clone()
    lied = outputs[:, : TRIAL_TOKENS - start]
    lied += 0.03 * lied.norm(dim=-1, keepdim=True) * torch.ones_like(lied) / HIDDEN**0.5
    return runtime_pb2.ExpertResponse(tensors=[serialize_tensor(outputs)])


@pytest.mark.parametrize("standing", [True, False], ids=["witnesses_with_standing", "fresh_witnesses"])
@pytest.mark.parametrize("last", [False, True], ids=["a_middle_span", "the_last_span"])
@pytest.mark.parametrize("lorises", [1, 3])
def test_lorises_that_lied_at_the_first_positions_are_outvoted(
    small_long_step_floor, lorises: int, last: bool, standing: bool
):
    """K lorises of blocks 0:2 (the best figures; or of the whole chain 0:4) lied at the span's first 8 positions (3%
    off, beyond float32's tolerance) from the start, and hold every step from token 12, beside two honest replicas
    H1, H2 (50 ms a step) and C (2:4). The race's reference is the left loris's word: both honest trials disagree with
    it, and agree with each other, so the pair outvotes it (decision 0183): H1 or H2 wins, one move, C's cache rebuilt
    from the pair's outputs (the outputs from token 12 on are the reference's), and the loris in use is banned as a
    liar where H1 and H2 have a witness's standing with this client; fresh, they could be one attacker's identities
    (decision 0190): the loris is then only avoided, H1 and H2 watched.
    On main every racer disagreed, the race was lost once the racing lorises had been moved off too (K moves), and
    the usual replacement replayed the span; C kept what the lie built (the later outputs off the reference)."""
    torch.manual_seed(10)
    end = 4 if last else 2
    servers: dict[str, FakeServer] = {
        f"L{i}": FirstPositionsLoris(0, end, inference_rps=1000.0) for i in range(lorises)
    }
    servers["H1"], servers["H2"] = Referee(0, end), Referee(0, end)  # (referees of each other where watched)
    servers["H1"].delay_s = servers["H2"].delay_s = HONEST_STEP_S
    if not last:
        servers["C"] = FakeServer(2, 4)
    manager = _manager(servers)
    if standing:
        vouch(manager, "H1", "H2")
    tokens, outputs, route, events = _sixteen_steps(manager, _hold(servers, FirstPositionsLoris))
    assert route[0] in ("H1", "H2") and route[1:] == ([] if last else ["C"]), route
    moved = [e for e in events if e.action == "moved"]
    assert len(moved) == 1 and moved[0].peer_id.startswith("L"), events
    if standing:
        assert manager.bans.is_liar(moved[0].peer_id)
        assert manager.bans.banned_peers() == {moved[0].peer_id}
    else:  # (lorises asked to referee the watched winner's steps fail them: banned a while, as failed referees)
        assert not any(manager.bans.is_liar(name) for name in servers)
        assert moved[0].peer_id in manager.avoided_peers() and manager.disputes.watched() == {"H1", "H2"}
        assert not manager.bans.banned_peers() & {"H1", "H2", "C"}
    torch.testing.assert_close(outputs[:, 12:], reference(tokens, 4)[:, 12:], atol=1e-5, rtol=0)
    if not last:  # C was sent positions 0-15 again after the outvote: its cache holds the honest ones
        assert servers["C"].final_lengths[-1] == 16


class SybilRacer(Referee):
    """One of an attacker's free identities: honest (and an honest referee) but for a race's trial once `holding`:
    a fresh session's first step answered at once with made-up outputs, the same on every such identity (a pair that
    agrees with each other and not with the left server), later steps computed."""

    holding = False

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            metadata, _ = self.requests[-1]
            if self.holding and metadata["start_from_position"] == 0:
                response = _made_up(response)
            yield response


def _made_up(response: runtime_pb2.ExpertResponse) -> runtime_pb2.ExpertResponse:
    """The attacker's outputs in place of `response`'s: seeded noise of its shape (the same on every identity)."""
    like = deserialize_tensor(response.tensors[0])
    made_up = torch.randn(like.shape, generator=torch.Generator().manual_seed(11), dtype=like.dtype)
    return runtime_pb2.ExpertResponse(tensors=[serialize_tensor(made_up)])


class RaceWatch(list[RaceEvent]):
    """A session's `race_events` (put in its list's place by `_sixteen_steps`) with an event per action, set at its
    first record (on the client's loop, where the racers' fakes wait on them): a racer that must answer within a
    pair's round, or after the pair was judged, answers then (`AnswersAfter`), whatever the loop's pauses."""

    def __init__(self) -> None:
        super().__init__()
        self.seated, self.judged, self.won = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.rejudged = asyncio.Event()

    def append(self, event: RaceEvent) -> None:
        super().append(event)
        getattr(self, event.action).set()


def _greedy(outputs: torch.Tensor) -> list[int]:
    """The greedy tokens of `outputs` [1, T, H] under a fixed toy LM head (HIDDEN x 64, seeded)."""
    head = torch.randn(HIDDEN, 64, generator=torch.Generator().manual_seed(13))
    return (outputs[0] @ head).argmax(dim=-1).tolist()


@pytest.mark.parametrize("last", [False, True], ids=["a_middle_span", "the_last_span"])
@pytest.mark.parametrize("referee", [True, False], ids=["an_outside_referee", "no_outside_referee"])
@pytest.mark.parametrize("turn_at", [12, 4], ids=["history_only", "and_the_new_position"])
@pytest.mark.parametrize("lent", [False, True], ids=["fresh", "standing_lent"])
@pytest.mark.parametrize("h2_answers", ["judged", "seated"], ids=["after_the_pair_was_judged", "in_the_pairs_round"])
def test_two_fresh_identities_racing_first_neither_ban_nor_rebuild(
    small_long_step_floor, last: bool, referee: bool, turn_at: int, lent: bool, h2_answers: str
):
    """Decisions 0190 and its "Attacked" section. H (honest, the best figures) serves blocks 0:2 (or the whole chain)
    and turns slow at token 12 (an overloaded server: it holds every step); the race for its span has S1 and S2, one
    attacker's two fresh identities answering the same made-up trial at once (positions 0-7; or, turned slow at token
    4, positions 0-3 of the history and the new one), and H2, honest, answering its trial once the pair was judged
    (slower than the pair's round and its referees) or once it was seated (within the pair's round: H2 wins it).
    The pair outvotes H's earlier outputs; short of a witness's standing, it wins only where a
    server outside the pair (H2's `rpc_forward`) confirms its trial. H2 sides with H's outputs: the pair loses, both
    avoided (never banned), H2 wins, nothing is rebuilt, and the session's greedy tokens are the honest chain's. On
    main the pair won and C's cache was rebuilt from its made-up outputs (then every later token of the session off
    the reference: greedy tokens 12 and 13 wrong, hidden states off by up to 2.1; turned at token 4, tokens 4, 7, 10
    and 11 of 4-15); for the last span nothing was rebuilt but the chain's kept first outputs (a later race's
    reference); H was not banned (0190). With no outside referee (H2 without
    `rpc_forward`, the accused out of the view) and H2 answering after the pair's round, the pair's word stands as on
    main (the evidence is symmetric: the fresh-witnesses case of
    `test_lorises_that_lied_at_the_first_positions_are_outvoted` is this one with the roles swapped): it wins, H
    avoided and not banned, the pair watched.

    `standing_lent` (decision 0208): S1 earned a witness's standing before (verified agreeing with other servers) and
    lends it to S2. Main did not check a pair with standing: H banned for good and C rebuilt from the made-up trial,
    as above. Now such a pair is checked as a fresh one (the same outcomes, and S1's standing lost); with no outside
    referee its word banned H, once, the standing spent by the ban, until decision 0232: H2, asked, does not answer
    (the framers may have kept an honest outsider busy), so a ban on S1's standing alone is none: H avoided, the pair
    watched.

    H2 answering within the pair's round (decision 0238): the pair loses the round, and is judged all the same (its
    referees asked as it was seated; H2's trial, agreeing with H's outputs, is one more server outside it that
    disagreed): refuted, both avoided and S1's standing lost, as where H2 answers after. Before, a pair that lost the
    round was never refereed: S1 kept the standing it lent (`agreed_in_a_row` 8), and the pair was not avoided, an
    outcome a pause of the client's loop decided (H2's answer held past the pair's round). With no outside referee
    (H2 asked, silent), the winner's trial alone is against the pair: unheard (decision 0248; refuted before, on that
    word alone), neither avoided, the pair watched, S1's lent standing spent all the same."""
    torch.manual_seed(12)
    end = 4 if last else 2
    servers: dict[str, FakeServer] = {"H": Referee(0, end, inference_rps=1000.0)}
    servers["S1"], servers["S2"] = SybilRacer(0, end), SybilRacer(0, end)
    servers["H2"] = (RefereeAnswersAfter if referee else AnswersAfter)(0, end)
    if not last:
        servers["C"] = FakeServer(2, 4)
    manager = _manager(servers)
    if lent:
        vouch(manager, "S1")
    watch = RaceWatch()

    def turn() -> None:
        servers["H"].delay_s = LORIS_DELAY_S
        servers["H2"].after = getattr(watch, h2_answers)  # type: ignore[attr-defined]
        _hold(servers, SybilRacer)()

    tokens, outputs, route, events = _sixteen_steps(manager, turn, turn_at, watch)
    moved = [e for e in events if e.action == "moved"]
    assert [e.peer_id for e in moved] == ["H"], events
    seated = [e for e in watch if e.action == "seated"]
    assert [set(e.peers) for e in seated] == [{"S1", "S2"}], watch
    pair_wins = not referee and h2_answers == "judged"
    if lent and pair_wins:  # H2 asked, and no answer: the ban would rest on S1's standing alone (decision 0232)
        assert not manager.bans.is_liar("H") and "H" in manager.avoided_peers() and route[0] in ("S1", "S2"), route
        assert manager.disputes.watched() == {"S1", "S2"} and not any(manager.bans.is_liar(name) for name in servers)
        return
    assert not manager.bans.is_liar("H") and not manager.bans.is_banned("H")
    assert not any(manager.bans.is_liar(name) for name in servers)
    assert manager.bans.agreed_in_a_row("S1") == 0  # lost (refuted), or never earned (fresh)
    if pair_wins:
        assert route[0] in ("S1", "S2"), route
        assert "H" in manager.avoided_peers() and manager.disputes.watched() == {"S1", "S2"}
    else:
        assert route[0] == "H2", route
        if referee:
            assert [e.verdict for e in watch if e.action == "judged"] == ["refuted"], watch
            assert {"S1", "S2"} <= manager.avoided_peers() and not manager.disputes.watched()
        else:  # nobody outside heard (decision 0248): nobody avoided, the pair watched, a lent standing spent
            assert [e.verdict for e in watch if e.action == "judged"] == ["unheard"], watch
            assert not {"S1", "S2", "H2"} & manager.avoided_peers(), manager.avoided_peers()  # (H: slow)
            assert manager.disputes.watched() == {"S1", "S2"}
            # its referees asked again later only where it held a standing (decision 0253): S1's, spent
            assert unheard_pairs.retries_of(manager).running == int(lent)
        assert _greedy(outputs) == _greedy(reference(tokens, 4))
        torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)


class SilentReferee(Referee):
    """An attacker's identity of the span that, once `holding`, holds its steps (it never wins a race) and, asked as
    a race pair's outside referee, holds its `rpc_forward` `HOLD_S` (within the request timeout) before it answers
    honestly."""

    HOLD_S = 3.0
    holding = False

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            if self.holding:
                await asyncio.sleep(LORIS_DELAY_S)
            yield response

    async def rpc_forward(self, request, timeout=None):
        if self.holding:
            await asyncio.sleep(self.HOLD_S)
        return await super().rpc_forward(request, timeout)


def test_a_referee_held_past_the_sessions_close_does_not_save_a_lost_pairs_standing(
    small_long_step_floor, monkeypatch: pytest.MonkeyPatch
):
    """hrev18 (decision 0245) attacking 0238: the race of `test_two_fresh_identities_racing_first_neither_ban_nor_rebuild`
    (H honest on 0:2, slow from token 12; S1 with a witness's standing and S2, one attacker's identities answering
    the same made-up trial at once; H2 honest, a referee, answering its trial within the pair's round: it wins), and
    the attacker's third identity W of 0:2, asked as the lost pair's referee beside H2, holds its `rpc_forward` past
    the session's close (the close waits `FINISH_TIMEOUT_S` for the judgements, 0.3 s here, 30 s by default, against a
    request timeout of 180 s by default). On main the close cancelled the unfinished judgement: the pair was never
    judged, S1 kept the standing it lent (`agreed_in_a_row` 8) and neither was avoided, the gap 0238 closed reopened
    by one silent identity. Now the judgement goes on after the session: W answers, H2 and the winner refute the
    pair, both avoided and S1's standing lost."""
    monkeypatch.setattr(inference_session, "FINISH_TIMEOUT_S", 0.3)
    torch.manual_seed(12)
    servers: dict[str, FakeServer] = {"H": Referee(0, 2, inference_rps=1000.0)}
    servers["S1"], servers["S2"] = SybilRacer(0, 2), SybilRacer(0, 2)
    servers["H2"], servers["W"] = RefereeAnswersAfter(0, 2), SilentReferee(0, 2)
    servers["C"] = FakeServer(2, 4)
    manager = _manager(servers)
    vouch(manager, "S1")
    watch = RaceWatch()

    def turn() -> None:
        servers["H"].delay_s = LORIS_DELAY_S
        servers["H2"].after = watch.seated  # type: ignore[attr-defined]
        _hold(servers, SybilRacer)()
        _hold(servers, SilentReferee)()

    _, _, route, _ = _sixteen_steps(manager, turn, 12, watch)
    assert route[0] == "H2" and [set(e.peers) for e in watch if e.action == "seated"] == [{"S1", "S2"}], watch
    assert not [e for e in watch if e.action == "judged"]  # (W still held at the close)
    waited = time.monotonic()
    while not [e for e in watch if e.action == "judged"] and time.monotonic() - waited < SilentReferee.HOLD_S + 5:
        time.sleep(0.05)
    assert [e.verdict for e in watch if e.action == "judged"] == ["refuted"], watch
    assert manager.bans.agreed_in_a_row("S1") == 0 and {"S1", "S2"} <= manager.avoided_peers()
    assert not any(manager.bans.is_liar(name) for name in servers) and not manager.bans.is_banned("H")


class HeldReferee(Referee):
    """An attacker's identity kept for refereeing: once `holding`, it holds its steps (it never answers a race's trial
    first: an honest answer there would agree with the earlier outputs and win, a made-up one lose)."""

    holding = False

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            if self.holding:
                await asyncio.sleep(LORIS_DELAY_S)
            yield response


class SybilWitness(HeldReferee):
    """A third free identity of the racers' attacker: its `rpc_forward` (asked as the pair's outside referee) answers
    the racers' made-up outputs for a trial's positions once `holding`, honest ones for longer stretches (the watch's
    recomputes of its pair's steps)."""

    async def rpc_forward(self, request, timeout=None):
        response = await super().rpc_forward(request, timeout)
        trial = deserialize_tensor(response.tensors[0]).shape[1] <= TRIAL_TOKENS  # (the watch's are longer)
        return _made_up(response) if self.holding and trial else response


class Ordered(random.Random):
    """Shuffles spans into the order of `names` (a race's racers, a pair's referees): the draw a test needs."""

    def __init__(self, names: list[str]):
        super().__init__(0)
        self.names = names

    def shuffle(self, x: list) -> None:  # type: ignore[override]
        x.sort(key=lambda span: self.names.index(span.peer_id) if span.peer_id in self.names else len(self.names))


@pytest.mark.parametrize(
    "witnesses",
    [["H2", "W1"], ["W1", "W2", "H2"]],
    ids=["the_honest_referee_asked_first", "two_fresh_witnesses_drawn_before_one_with_standing"],
)
def test_a_third_identity_refereeing_its_pair_does_not_rebuild_the_session(
    small_long_step_floor, monkeypatch: pytest.MonkeyPatch, witnesses: list[str]
):
    """Decision 0190 "Attacked" attacked (hrev14): the race of `test_two_fresh_identities_racing_first_neither_ban_nor_rebuild`
    (H honest on 0:2 with the best figures, slow from token 12; S1, S2 one attacker's fresh identities answering the
    same made-up trial at once; H2 honest, answering its trial once the pair was judged; C on 2:4), and the attacker runs W1 (and
    W2) too, identities of 0:2 that hold their steps and, asked as the pair's outside referee, answer the same made-up
    outputs. Identities
    cost nothing and referees are drawn at random from the span's servers (the draw fixed here: H2 first; or W1 and
    W2 first, H2 with a witness's standing). On main one referee's agreement confirmed the pair, whatever another
    said: the pair won, C was rebuilt from the made-up outputs, greedy tokens 12 and 13 wrong, H avoided as outvoted,
    S1 and S2 watched. Now the pair wins only where every outside referee that answered agrees (those with standing
    asked first): H2 disputes it, the pair loses (the referees split: nobody avoided or banned), H2 wins, nothing is
    rebuilt, the tokens are the reference's."""
    torch.manual_seed(12)
    servers: dict[str, FakeServer] = {"H": Referee(0, 2, inference_rps=1000.0)}
    servers["S1"], servers["S2"] = SybilRacer(0, 2), SybilRacer(0, 2)
    servers["H2"] = RefereeAnswersAfter(0, 2)
    for name in witnesses:
        if name != "H2":
            servers[name] = SybilWitness(0, 2)
    servers["C"] = FakeServer(2, 4)
    manager = _manager(servers)
    manager.rng = Ordered(witnesses)
    if "W2" in witnesses:  # two seats, both drawn by the attacker's identities, but H2 has standing
        monkeypatch.setattr(witness_rules, "OUTSIDERS_MAX", 2)
        vouch(manager, "H2")
    watch = RaceWatch()

    def turn() -> None:
        servers["H"].delay_s = LORIS_DELAY_S
        servers["H2"].after = watch.judged  # type: ignore[attr-defined]
        _hold(servers, SybilRacer)()
        _hold(servers, SybilWitness)()

    tokens, outputs, route, events = _sixteen_steps(manager, turn, race_events=watch)
    assert [e.peer_id for e in events if e.action == "moved"] == ["H"], events
    wrong = [t for t, (a, b) in enumerate(zip(_greedy(outputs), _greedy(reference(tokens, 4)), strict=True)) if a != b]
    assert route == ["H2", "C"] and wrong == [], (route, wrong, float((outputs - reference(tokens, 4)).abs().max()))
    torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)
    assert not any(manager.bans.is_liar(name) or manager.bans.is_banned(name) for name in servers)
    assert not {"S1", "S2", "H2"} & manager.avoided_peers() and not manager.disputes.watched()
    assert servers["H2"].forward_calls and servers["W1"].forward_calls  # both sides were asked


class LiarsReferee(HeldReferee):
    """The lying loris's other identity: once `holding`, it recomputes a stateless forward as the loris lied
    (`_first_positions_lie`): asked as a race pair's outside referee, it sides with the loris against the honest
    pair."""

    async def rpc_forward(self, request, timeout=None):
        response = await super().rpc_forward(request, timeout)
        return _first_positions_lie(response, 0) if self.holding else response


def test_one_referee_siding_with_a_lying_loris_gets_no_honest_racer_avoided(small_long_step_floor):
    """Decision 0220's price, bounded. L (the best figures) lied at the span's first 8 positions and holds every step
    from token 12; H1, H2, H3 honest (50 ms a step), C on 2:4; W, the attacker's other identity, holds its steps and
    recomputes a trial as L lied. Each pair of honest racers outvotes L's outputs, and its outside referees split:
    the third honest server agrees with it, W does not. One disagreement refuting the pair (as first landed) got
    every honest racer avoided 300 s on W's word, pair after pair. A split verdict lets no pair win (nothing is
    rebuilt from outputs an outside server disputes) and avoids nobody: the race is lost, the span replaced the usual
    way on an honest server, none of them avoided or watched, nobody banned."""
    torch.manual_seed(10)
    servers: dict[str, FakeServer] = {"L": FirstPositionsLoris(0, 2, inference_rps=1000.0)}
    for name in ("H1", "H2", "H3"):
        servers[name] = Referee(0, 2)
        servers[name].delay_s = HONEST_STEP_S
    servers["W"] = LiarsReferee(0, 2)
    servers["C"] = FakeServer(2, 4)
    manager = _manager(servers)

    def turn() -> None:
        _hold(servers, FirstPositionsLoris)()
        _hold(servers, LiarsReferee)()

    tokens, outputs, route, events = _sixteen_steps(manager, turn)
    assert route[0] in ("H1", "H2", "H3"), route
    assert servers["W"].forward_calls  # W was asked, and disagreed with the honest pair
    assert not {"H1", "H2", "H3"} & manager.avoided_peers() and not manager.disputes.watched()
    assert not manager.bans.banned_peers() & {"H1", "H2", "H3", "C"}


class LieEchoingRacer(AnswersAfter, Referee):
    """The lying loris's other identity, racing: once `after` is given (at a test's turn), it answers a race's trial
    once `after` is set, as the loris lied at the span's first positions (`_first_positions_lie`: it agrees with the
    race's reference, and wins the tie, decision 0183), its later positions honest; asked as a pair's outside referee,
    it recomputes as the loris lied."""

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            start = self.requests[-1][0]["start_from_position"]
            yield _first_positions_lie(response, start) if self.after is not None and start < TRIAL_TOKENS else response

    async def rpc_forward(self, request, timeout=None):
        response = await super().rpc_forward(request, timeout)
        return _first_positions_lie(response, 0) if self.after is not None else response


@pytest.mark.parametrize("w_answers", ["seated", "judged"], ids=["in_the_pairs_round", "after_the_pair_was_judged"])
def test_honest_racers_that_lose_a_round_keep_their_standing(small_long_step_floor, w_answers: str):
    """Decision 0238's judgement of a pair that lost its round, against honest racers. L (the best figures) lied at
    the span's first 8 positions and holds every step from token 12; H1 and H2 honest with a witness's standing (50 ms
    a step), H3 honest (its trial answered after the race); W, L's other identity, answers its trial as L lied once H1
    and H2's pair was seated (within the pair's round) or judged, and recomputes as L lied when asked as a referee; C
    on 2:4. The pair's referees split (H3 confirms it, W does not), and W's trial, which wins, is one more server
    outside the pair disputing it: a split, lost round or not, costs nobody anything: H1, H2 and H3 keep their
    standing, none avoided, watched or banned. (Losing a round alone must not cost a pair its standing: L and W would
    drain honest servers' standing, race after race.)"""
    torch.manual_seed(10)
    servers: dict[str, FakeServer] = {"L": FirstPositionsLoris(0, 2, inference_rps=1000.0)}
    servers["H1"], servers["H2"], servers["H3"] = Referee(0, 2), Referee(0, 2), RefereeAnswersAfter(0, 2)
    servers["H1"].delay_s = servers["H2"].delay_s = HONEST_STEP_S
    servers["W"] = LieEchoingRacer(0, 2)
    servers["C"] = FakeServer(2, 4)
    manager = _manager(servers)
    vouch(manager, "H1", "H2")
    watch = RaceWatch()

    def turn() -> None:
        _hold(servers, FirstPositionsLoris)()
        servers["W"].after = getattr(watch, w_answers)  # type: ignore[attr-defined]
        servers["H3"].after = watch.won  # type: ignore[attr-defined]

    _, _, route, events = _sixteen_steps(manager, turn, race_events=watch)
    assert [e.peer_id for e in events if e.action == "moved"] == ["L"], events
    assert route[0] == "W", route
    assert [(set(e.peers), e.verdict) for e in watch if e.action != "won"] == [
        ({"H1", "H2"}, None),
        ({"H1", "H2"}, "split"),
    ], watch
    assert servers["W"].forward_calls and servers["H3"].forward_calls  # both referees asked
    honest = {"H1", "H2", "H3"}
    assert all(witness_rules.trusted(manager, name) for name in ("H1", "H2"))
    assert not honest & manager.avoided_peers() and not honest & manager.disputes.watched()
    assert not any(manager.bans.is_banned(name) or manager.bans.is_liar(name) for name in honest | {"C"})


class BusyOutsider(RefereeAnswersAfter):
    """An honest server of the span kept busy when it is asked as a race pair's outside referee (its stream total
    filled by the attacker's free identities, decision 0232): its `rpc_forward` is refused; its trial, once `after`
    is set, honest."""

    async def rpc_forward(self, request, timeout=None):
        self.forward_calls += 1
        raise ConnectionError("the server is full, retry later")


class SilentLieEchoingRacer(LieEchoingRacer):
    """`LieEchoingRacer` that, asked as a pair's outside referee, does not answer (a refusal): the pair's referees
    all silent, the verdict rests on its winning trial alone."""

    async def rpc_forward(self, request, timeout=None):
        self.forward_calls += 1
        raise ConnectionError("the server is full, retry later")


def _honest_pair_loses_to_the_liars_identity(
    vouched: tuple[str, ...], h3: FakeServer
) -> tuple[FakeManager, dict[str, FakeServer], RaceWatch]:
    """0248's race (`test_honest_racers_losing_to_the_liars_identity_with_silent_referees_are_not_refuted`): L (the
    best figures) lied at the span's first 8 positions and holds every step from token 12; H1 and H2 honest (50 ms a
    step, `vouched` with a witness's standing) are seated as a pair; W, L's second identity, answers its trial as L
    lied within the pair's round (it wins the tie) and never answers as a referee; H3 (`h3`), the pair's honest outside
    referee, answers its trial once W won; C on 2:4. Returns the manager, the servers and the race's events, the
    session closed."""
    torch.manual_seed(10)
    servers: dict[str, FakeServer] = {"L": FirstPositionsLoris(0, 2, inference_rps=1000.0)}
    servers["H1"], servers["H2"], servers["H3"] = Referee(0, 2), Referee(0, 2), h3
    servers["H1"].delay_s = servers["H2"].delay_s = HONEST_STEP_S
    servers["W"] = SilentLieEchoingRacer(0, 2)
    servers["C"] = FakeServer(2, 4)
    manager = _manager(servers)
    vouch(manager, *vouched)
    watch = RaceWatch()

    def turn() -> None:
        _hold(servers, FirstPositionsLoris)()
        servers["W"].after = watch.seated  # type: ignore[attr-defined]
        servers["H3"].after = watch.won  # type: ignore[attr-defined]
        if isinstance(h3, BusyForARound):
            h3.free = watch.judged

    _, _, route, events = _sixteen_steps(manager, turn, race_events=watch)
    assert [e.peer_id for e in events if e.action == "moved"] == ["L"] and route[0] == "W", (events, route)
    return manager, servers, watch


@pytest.mark.parametrize("vouched", [("H1", "H2"), ("H1",)], ids=["two_standings", "one_standing_lent"])
def test_honest_racers_losing_to_the_liars_identity_with_silent_referees_are_not_refuted(
    small_long_step_floor, vouched: tuple[str, ...]
):
    """hsilent (decision 0248), 0238's recorded gap. L (the best figures) lied at the span's first 8 positions and
    holds every step from token 12; H1 and H2, honest (50 ms a step), agree with each other and outvote L's earlier
    outputs: a pair, seated; W, L's second identity, answers its trial as L lied within the pair's round and wins the
    tie (decision 0183); the pair's outside referees, W and H3 (honest, kept busy by the attacker: 0232's trick),
    refuse the recheck. On main the pair was refuted on W's word alone: H1 and H2 lost their standing and were avoided
    300 s (race after race, L and W could drain every honest server of the span). Now no referee heard is "unheard":
    nobody avoided or banned; a pair's own two standings kept; where H1 lent its standing to a fresh H2, it is spent
    (as a ban on one standing spends it: a liar pair may not keep it by losing) and the pair watched."""
    manager, servers, watch = _honest_pair_loses_to_the_liars_identity(vouched, BusyOutsider(0, 2))
    waited = time.monotonic()  # (the lost pair is judged in the background)
    while not [e for e in watch if e.action == "judged"] and time.monotonic() - waited < 5:
        time.sleep(0.05)
    assert [(set(e.peers), e.verdict) for e in watch if e.action != "won"] == [
        ({"H1", "H2"}, None),
        ({"H1", "H2"}, "unheard"),
    ], watch
    assert servers["W"].forward_calls and servers["H3"].forward_calls  # both referees asked, neither answered
    honest = {"H1", "H2", "H3"}
    assert not honest & manager.avoided_peers(), manager.avoided_peers()
    assert not any(manager.bans.is_banned(name) or manager.bans.is_liar(name) for name in honest | {"C"})
    if len(vouched) == 2:
        assert all(witness_rules.trusted(manager, name) for name in ("H1", "H2"))
        assert not honest & manager.disputes.watched()
    else:  # the lent standing spent, the pair watched
        assert manager.bans.agreed_in_a_row("H1") == 0 and manager.disputes.watched() == {"H1", "H2"}


QUICK_RETRY_WAITS_S = (0.05, 0.1, 0.2)  # an unheard pair's referees asked again after these (decision 0253)


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(unheard_pairs, "RETRY_WAITS_S", QUICK_RETRY_WAITS_S)
    monkeypatch.setattr(unheard_pairs, "RETRY_BOUND_S", 5.0)


class BusyForARound(RefereeAnswersAfter):
    """An honest server of the span kept busy by the attacker while a race pair is judged (decision 0232's trick,
    which free identities afford for a round, not for minutes): its `rpc_forward` is refused until `free` is set (the
    test sets it to the race's `judged` event), then answered honestly; with `hangs_after`, never answered then (a
    referee held past the client's life); its trial, once `after` is set, honest."""

    free: asyncio.Event | None = None
    hangs_after = False

    async def rpc_forward(self, request, timeout=None):
        if self.free is None or not self.free.is_set():
            self.forward_calls += 1
            raise ConnectionError("the server is full, retry later")
        if self.hangs_after:
            self.forward_calls += 1
            await asyncio.Event().wait()
        return await super().rpc_forward(request, timeout)


def _wait_for(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether `event` (set on the client's loop) was set within `timeout_s` (polled from the test's thread)."""
    waited = time.monotonic()
    while not event.is_set() and time.monotonic() - waited < timeout_s:
        time.sleep(0.02)
    return event.is_set()


def _rejudged_and_ended(manager: FakeManager, watch: RaceWatch, timeout_s: float = 10.0) -> bool:
    """Whether the unheard pair was judged again and its retry job ended within `timeout_s`: the job's end is
    recorded by its done-callback, a turn of the client's loop after the `rejudged` event, so a test thread that
    checks `running` the moment the event is set can see the job still counted."""
    waited = time.monotonic()
    if not _wait_for(watch.rejudged, timeout_s):
        return False
    retries = unheard_pairs.retries_of(manager)
    while retries.running and time.monotonic() - waited < timeout_s:
        time.sleep(0.02)
    return retries.running == 0


@pytest.mark.parametrize("vouched", [("H1",), ("H1", "H2")], ids=["one_standing_lent", "two_standings"])
def test_an_honest_pair_unheard_for_a_round_gets_its_standing_back_from_a_referee_heard_later(
    small_long_step_floor, quick_retries, vouched: tuple[str, ...]
):
    """Decision 0249 (a), the drain (decision 0253). 0248's race: the honest pair H1, H2 loses its round to W, L's
    second identity, while the pair's outside referees are silent (W refusing, H3 kept busy by the attacker); judged
    "unheard", H1's standing lent to a fresh H2 is spent and the pair watched. The attacker keeps H3 busy for the
    round only: asked again after the race, H3 answers and confirms the pair: "split" (as 0238 judges a lost pair a
    referee confirms), H1's standing given back (`agreed_in_a_row` 8 again) and the watch ended; nobody avoided or
    banned. On main the pair's referees were asked once: H1's record stayed 0 and the pair watched 300 s, race after
    race (L, W and a busy outsider drained an honest server's standing per race)."""
    h3 = BusyForARound(0, 2)
    manager, servers, watch = _honest_pair_loses_to_the_liars_identity(vouched, h3)
    assert _rejudged_and_ended(manager, watch), (watch, unheard_pairs.retries_of(manager).running)
    assert [(set(e.peers), e.verdict) for e in watch if e.action != "won"] == [
        ({"H1", "H2"}, None),
        ({"H1", "H2"}, "unheard"),
        ({"H1", "H2"}, "split"),
    ], watch
    assert manager.bans.agreed_in_a_row("H1") == manager.config.witness_standing_steps
    assert all(witness_rules.trusted(manager, name) for name in vouched)
    honest = {"H1", "H2", "H3"}
    assert not honest & manager.avoided_peers() and not honest & manager.disputes.watched()
    assert not any(manager.bans.is_banned(name) or manager.bans.is_liar(name) for name in honest | {"C"})
    assert h3.forward_calls == 2  # refused at the seating, answered at the first ask again


def test_a_liar_pair_of_two_standings_unheard_for_a_round_is_refuted_by_a_referee_heard_later(
    small_long_step_floor, quick_retries
):
    """Decision 0249 (b), the free retry (decision 0253). H (honest, the best figures) serves 0:2 and turns slow at
    token 12; S1 and S2, one attacker's identities that both earned a witness's standing, answer the same made-up
    trial at once: a pair, seated; H2, honest, answers its trial within the pair's round, agreeing with H's earlier
    outputs: it wins. The pair's only outside referee, H2, is kept busy by the attacker for the round (its
    `rpc_forward` refused): "unheard", and two standings of their own keep both (0248). Asked again after the race,
    H2 answers and disagrees with the pair: refuted, as 0238 judges a lost pair whose referees answered: S1 and S2
    lose their standing and are avoided. On main they kept both, unwatched: silence for one round was a free retry of
    the frame."""
    torch.manual_seed(12)
    servers: dict[str, FakeServer] = {"H": Referee(0, 2, inference_rps=1000.0)}
    servers["S1"], servers["S2"] = SybilRacer(0, 2), SybilRacer(0, 2)
    servers["H2"] = h2 = BusyForARound(0, 2)
    servers["C"] = FakeServer(2, 4)
    manager = _manager(servers)
    vouch(manager, "S1", "S2")
    watch = RaceWatch()

    def turn() -> None:
        servers["H"].delay_s = LORIS_DELAY_S
        h2.after, h2.free = watch.seated, watch.judged
        _hold(servers, SybilRacer)()

    tokens, outputs, route, events = _sixteen_steps(manager, turn, 12, watch)
    assert [e.peer_id for e in events if e.action == "moved"] == ["H"] and route[0] == "H2", (events, route)
    torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)
    assert _wait_for(watch.rejudged, 10.0), watch
    assert [(set(e.peers), e.verdict) for e in watch if e.action != "won"] == [
        ({"S1", "S2"}, None),
        ({"S1", "S2"}, "unheard"),
        ({"S1", "S2"}, "refuted"),
    ], watch
    assert manager.bans.agreed_in_a_row("S1") == manager.bans.agreed_in_a_row("S2") == 0
    assert {"S1", "S2"} <= manager.avoided_peers() and "H2" not in manager.avoided_peers()
    assert not any(manager.bans.is_liar(name) for name in servers) and not manager.bans.is_banned("H2")


def test_an_unheard_pairs_referees_silent_for_good_are_asked_a_bounded_number_of_times(
    small_long_step_floor, quick_retries
):
    """Decision 0253's bound. 0248's race with both outside referees silent for good (W refusing, H3 busy for good):
    the pair's recheck is asked again `len(RETRY_WAITS_S)` times, no more, within the waits (drawn at most 1.5 times
    their figures) and the asks; still unheard, 0248's verdict stands (H1's lent standing spent, the pair watched)
    and no job is left."""
    h3 = BusyOutsider(0, 2)
    started = time.monotonic()
    manager, servers, watch = _honest_pair_loses_to_the_liars_identity(("H1",), h3)
    assert _rejudged_and_ended(manager, watch), (watch, unheard_pairs.retries_of(manager).running)
    assert [e.verdict for e in watch if e.action in ("judged", "rejudged")] == ["unheard", "unheard"], watch
    assert h3.forward_calls == servers["W"].forward_calls == 1 + len(QUICK_RETRY_WAITS_S)
    assert time.monotonic() - started < 10.0
    assert manager.bans.agreed_in_a_row("H1") == 0 and manager.disputes.watched() == {"H1", "H2"}
    assert not {"H1", "H2", "H3"} & manager.avoided_peers()


def test_an_unheard_pairs_retries_end_when_the_client_shuts_down(small_long_step_floor, quick_retries):
    """Decision 0253: the asks outlive the session (its close is not held by them: 0245's rule for judgements) and
    end with the client. 0248's race with H3 busy for the round, then holding the pair's recheck for good (a referee
    held past the client's life): the job asking again is running after the session's close; the manager's shutdown
    cancels it: no job left, no re-judgement (0248's verdict stands)."""
    h3 = BusyForARound(0, 2)
    h3.hangs_after = True
    manager, _, watch = _honest_pair_loses_to_the_liars_identity(("H1",), h3)
    retries = unheard_pairs.retries_of(manager)
    waited = time.monotonic()
    while h3.forward_calls < 2 and time.monotonic() - waited < 10.0:  # the first ask again, held by H3
        time.sleep(0.02)
    assert h3.forward_calls == 2 and retries.running == 1, (h3.forward_calls, retries.running)
    manager.shutdown()
    assert retries.running == 0 and not watch.rejudged.is_set(), watch
    assert manager.bans.agreed_in_a_row("H1") == 0 and manager.disputes.watched() == {"H1", "H2"}


def test_after_a_loris_new_sessions_start_on_servers_seen_on_time(small_long_step_floor):
    """Three lorises (the best figures) and H; a first session is held from token 4, moves, and the race gives it to
    H. The client's next session, started right after while the lorises still hold steps, is planned over the servers
    it saw answer on time where they cover the blocks (for `SLOW_AVOID_S`, decision 0163): it starts on H, no loris
    gets a request, nothing moves. Before, its route followed the announced figures to a loris that was not avoided
    (one more deadline plus budget, and a race)."""
    torch.manual_seed(9)
    servers = {f"L{i}": FakeServer(0, 4, inference_rps=1000.0) for i in range(3)}
    servers["H"] = FakeServer(0, 4)
    manager = _manager(servers)
    tokens = torch.randn(1, 8, HIDDEN)
    with InferenceSession(manager, max_length=8) as session:
        for t in range(8):
            if t == 4:
                for name in servers:
                    servers[name].delay_s = LORIS_DELAY_S if name != "H" else 0.0
            session.step(tokens[:, t : t + 1])
        assert [span.peer_id for span, _ in session.route] == ["H"]
    asked = {name: len(server.requests) for name, server in servers.items()}
    outputs = []
    with InferenceSession(manager, max_length=8) as session:
        outputs = [session.step(tokens[:, :3])] + [session.step(tokens[:, t : t + 1]) for t in range(3, 8)]
        assert [span.peer_id for span, _ in session.route] == ["H"]
        # (H's decode deadline is the 0.2 s floor here, which a loaded machine may pass: a `slow` event, kept)
        assert [e for e in session.stall_events if e.action != "slow"] == []
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    assert all(len(server.requests) == asked[name] for name, server in servers.items() if name != "H")


def test_proven_where_they_cover():
    """The planning set while a loris is suspected: servers seen on time, and the others only where those do not
    cover their blocks."""

    def span(peer: str, start: int, end: int) -> RemoteSpanInfo:
        return RemoteSpanInfo(peer, start, end, record_of(start, end, 100.0))

    spans = [span("A", 0, 4), span("B", 0, 2), span("C", 2, 6), span("D", 4, 8), span("E", 6, 8)]
    kept = proven_where_they_cover(spans, {"A", "E"})
    assert [s.peer_id for s in kept] == [
        "A",
        "C",
        "D",
        "E",
    ]  # B's 0:2 is A's; no server seen on time holds 4:6 (C's, D's)
    assert [s.peer_id for s in proven_where_they_cover(spans, set())] == ["A", "B", "C", "D", "E"]


class HonestLast(random.Random):
    """Shuffles H behind every loris: the worst order a race can draw."""

    def shuffle(self, x: list) -> None:  # type: ignore[override]
        x.sort(key=lambda span: span.peer_id == "H")


def test_lorises_beyond_the_race_width_join_by_rounds(small_long_step_floor, monkeypatch: pytest.MonkeyPatch):
    """More lorises than a round's width (2 here, 7 lorises): while no racer answered, 2 more join every round
    (0.2 s here), those already racing kept, so H, drawn last, races after 3 rounds, before any loris's deadline plus
    budget (1.2 s): one move. Races of a fixed width, each lost only once its lorises were moved off, would cost a
    move per loris raced."""
    monkeypatch.setattr(replacement_race, "RACE_WIDTH", 2)
    torch.manual_seed(8)
    servers = {f"L{i}": FakeServer(0, 4, inference_rps=1000.0) for i in range(7)}
    servers["H"] = FakeServer(0, 4)
    manager = _manager(servers)
    manager.rng = HonestLast(0)
    tokens, outputs, route, events = _sixteen_steps(manager, lambda: _turn_lorises(servers))
    assert route == ["H"]
    torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)
    assert len([e for e in events if e.action == "moved"]) == 1, events
    raced = [name for name, server in servers.items() if name != "H" and len(server.requests) == 1]
    assert len(raced) == 6  # every loris but the one moved off was sent its trial (and closed unanswered)
    assert _served_tokens(servers["H"]) == 16 and servers["H"].final_lengths == [16]


def test_race_candidates_measured_first_announced_figures_ignored(monkeypatch: pytest.MonkeyPatch):
    """Who races for a span: servers covering it alone, not banned, avoided or the one left; those this client saw
    answer a step within its deadline first (not since avoided), at most RACE_MAX, as spans of exactly the blocks
    (no waiting)."""
    monkeypatch.setattr(replacement_race, "RACE_MAX", 8)
    servers = {f"L{i}": FakeServer(0, 4, inference_rps=1e6) for i in range(12)}
    servers.update(H=FakeServer(0, 4, inference_rps=1.0), P=FakeServer(1, 3), W=FakeServer(0, 4), X=FakeServer(0, 4))
    manager = _manager(servers)
    manager.note_on_time("H")
    manager.note_on_time("W")
    manager.avoid("W", 60.0, slow=True)  # avoided since for its pace: neither a candidate nor seen on time
    manager.on_request_failure("X")  # banned
    rng = random.Random(0)
    for _ in range(20):
        candidates = race_candidates(manager, "L0", (1, 3), rng)
        assert candidates[0].peer_id == "H" and len(candidates) == 8
        assert {"L0", "W", "X"}.isdisjoint(s.peer_id for s in candidates)
        assert all((s.start, s.end) == (1, 3) for s in candidates)
    assert "W" not in manager.answered_on_time()
    seen = {s.peer_id for _ in range(50) for s in race_candidates(manager, "L0", (1, 3), rng)}
    assert "P" in seen and len(seen) > 8  # the rest in random order, not by figures


@pytest.mark.parametrize("late", [False, True], ids=["within_its_deadline", "late_within_the_budget"])
def test_an_honest_slow_prompt_keeps_its_server(small_long_step_floor, monkeypatch: pytest.MonkeyPatch, late: bool):
    """A announces a slow rate (10 tokens/s a block: 24 tokens through 4 blocks, 9.6 s, a 38 s deadline) and its
    prompt takes 1.5 s, over the floor but within its deadline: no stall of the prompt. Or A announces a fast rate and
    its prompt comes 1.0 s past the floor's deadline, within the late budget (4 s): a `slow` event, and the session
    stays. Nothing is replayed on B. (Only the prompt's events are asserted: a decode step's deadline is 0.2 s here,
    which a loaded machine may pass; the budget leaves 3 s for that.)"""
    monkeypatch.setattr(stalls, "LATE_BUDGET_S", 4.0)
    torch.manual_seed(6)
    servers = {"A": FakeServer(0, 4, inference_rps=1000.0 if late else 10.0), "B": FakeServer(0, 4, 1.0)}
    manager = _manager(servers)
    tokens = torch.randn(1, PROMPT_TOKENS + 4, HIDDEN)
    with InferenceSession(manager, max_length=tokens.shape[1]) as session:
        servers["A"].delay_s = 1.5
        outputs = [session.step(tokens[:, :PROMPT_TOKENS])]
        servers["A"].delay_s = 0.0
        outputs += [session.step(tokens[:, t : t + 1]) for t in range(PROMPT_TOKENS, tokens.shape[1])]
        assert [span.peer_id for span, _ in session.route] == ["A"]
        events = list(session.stall_events)
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    prompt_events = {(e.action, e.num_tokens) for e in events if e.num_tokens == PROMPT_TOKENS}
    assert prompt_events == ({("slow", PROMPT_TOKENS)} if late else set()), events
    assert not [e for e in events if e.action == "moved"], events
    assert servers["B"].requests == [] and _served_tokens(servers["A"]) == tokens.shape[1]
    assert "A" not in manager.avoided_peers() and not manager.bans.is_banned("A")


def test_long_step_deadline_rules():
    """A long step's deadline (no waiting): 4x its tokens at the announced prefill rate (else the decode rate), never
    under the floor plus its bytes at a slow link, nor under 4x the slowest decode step measured (an absurd
    announced rate), never over STEP_MAX_S (a tiny one, or none)."""
    floor_s, max_s = stalls.LONG_STEP_MIN_S, stalls.STEP_MAX_S
    assert announced_token_s(4, 200.0, 1.0) == pytest.approx(0.02) and announced_token_s(4, None, 8.0) == 0.5
    assert announced_token_s(4, None, None) is None and announced_token_s(4, 0.0, None) is None
    clock = StepClock(announced_step_s(4, 100.0), announced_token_s(4, 200.0, 100.0))  # 20 ms a prompt token
    assert clock.deadline_s(100) == pytest.approx(8.0)  # 4 x 100 x 20 ms
    assert clock.deadline_s(10) == pytest.approx(floor_s)  # 0.8 s: under the floor
    assert clock.deadline_s(10, nbytes=4_000_000) == pytest.approx(floor_s + 8e6 / stalls.SLOW_LINK_BYTES_PER_S)
    assert clock.deadline_s(10_000) == max_s  # 800 s implied: capped
    absurd = StepClock(announced_step_s(4, 1e9), announced_token_s(4, 1e9, 1e9))
    assert absurd.deadline_s(2048) == pytest.approx(floor_s)
    absurd.record(1, 3.0)  # it showed a 3 s decode step (a late one is charged, not recorded: a slow honest one)
    assert absurd.deadline_s(2048) == pytest.approx(12.0)
    tiny = StepClock(announced_step_s(4, 1e-6), announced_token_s(4, 1e-6, 1e-6))
    assert tiny.deadline_s(9) == max_s and tiny.deadline_s(1) == max_s
    assert StepClock().deadline_s(9) == max_s and StepClock().deadline_s(0) == max_s
    unannounced = StepClock()
    for elapsed_s in (1.0, 4.0, 16.0, 40.0):  # a ramp of decode steps without a figure to cap it
        unannounced.record(1, elapsed_s)
    assert unannounced.deadline_s(1) == max_s and unannounced.deadline_s(64) == max_s


HONEST_STEP_S = 0.05  # H answers a step this late (within its 0.2 s deadline): a trial's first answer is a loris's


@pytest.mark.parametrize("lorises", [3, 7])
def test_lorises_that_answer_short_steps_cost_two_moves(small_long_step_floor, lorises: int):
    """K servers announcing the best figures answer steps of at most 8 tokens at once and hold longer ones just
    under `request_timeout_s` (a race's trial is a short step), beside one honest server H. The session's 24-token
    prompt is held by the first loris (moved: its deadline plus the budget); the race on the first 8 positions goes to
    another loris, which answers at once and holds the rest (moved too); the next race sends every racer the whole
    step (decision 0176), which only H answers: two moves whatever K. With trials only (0163), each race went to a
    loris and the session paid each one's deadline plus budget in turn: K moves. Outputs are the reference's; H
    computed its lost trial (8 positions) and the whole prompt once (its trial, then the rest: decision 0184)."""
    torch.manual_seed(8)
    servers = {f"L{i}": FakeServer(0, 4, inference_rps=1000.0) for i in range(lorises)}
    for server in servers.values():
        server.long_delay_s = LORIS_DELAY_S
    servers["H"] = FakeServer(0, 4)
    servers["H"].delay_s = HONEST_STEP_S
    manager = _manager(servers)
    tokens = torch.randn(1, PROMPT_TOKENS + 4, HIDDEN)
    with InferenceSession(manager, max_length=tokens.shape[1]) as session:
        outputs = [session.step(tokens[:, :PROMPT_TOKENS])]
        outputs += [session.step(tokens[:, t : t + 1]) for t in range(PROMPT_TOKENS, tokens.shape[1])]
        assert [span.peer_id for span, _ in session.route] == ["H"]
        events = list(session.stall_events)
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    moved = [e for e in events if e.action == "moved"]
    # the first loris on the prompt, then (unless H won the trial) the trial's winner on the prompt's step after the
    # trial (at position 0 it sends the prompt from 0 again)
    assert 1 <= len(moved) <= 2 and all(e.peer_id.startswith("L") for e in moved), events
    assert all(e.num_tokens == PROMPT_TOKENS for e in moved), events
    if len(moved) == 2:  # H lost the trial (8 positions at most), then won the whole step: its trial, then the rest
        assert [n for _, n in servers["H"].requests[-6:]] == [TRIAL_TOKENS, PROMPT_TOKENS - TRIAL_TOKENS, 1, 1, 1, 1]
        assert _served_tokens(servers["H"]) <= TRIAL_TOKENS + tokens.shape[1]
    assert manager.avoided_peers() == {e.peer_id for e in moved} and not manager.bans.banned_peers()


class WholeStepLiar(Referee):
    """Honest until `holding`; then it holds every step of a session it had before (just under `request_timeout_s`);
    a fresh session's (a racer's) short first step (a race's trial) is answered honestly, once `trial_after` is set
    where one is given, and its later steps (the rest after a trial, or after a race's trial on the whole step:
    decision 0184) are held, or, with `answers_rest`, answered at once with the positions up to `honest_positions`
    computed (negative: all but the step's new ones, as many) and noise of the same scale after. A fresh session's
    long first step is answered at once the same way. As a referee (`rpc_forward`) it is honest."""

    holding = False
    honest_positions = TRIAL_TOKENS
    trial_after: asyncio.Event | None = None
    answers_rest = False

    async def _serve(self, requests):
        fresh: bool | None = None  # a session opened while holding (a racer's)
        async for response in super()._serve(requests):
            metadata, tokens = self.requests[-1]
            start = metadata["start_from_position"]
            fresh = self.holding if fresh is None else fresh
            if self.holding and (not fresh or (start != 0 and not self.answers_rest)):
                await asyncio.sleep(LORIS_DELAY_S)
            elif self.holding and (start != 0 or tokens > TRIAL_TOKENS):
                outputs = deserialize_tensor(response.tensors[0]).clone()  # positions [start, start + tokens)
                honest = self.honest_positions - start if self.honest_positions >= 0 else self.honest_positions
                made_up = outputs[:, max(0, honest) if honest >= 0 else honest :]
                made_up.copy_(torch.randn_like(made_up) * outputs.std())
                response = runtime_pb2.ExpertResponse(tensors=[serialize_tensor(outputs)])
            elif self.holding and self.trial_after is not None:
                await self.trial_after.wait()
            yield response


def _whole_step_liars(honest_positions: int) -> dict[str, FakeServer]:
    """L0 and L1 (the best figures: one of them serves the session) hold a trial's rest; L2 (announcing less, never
    routed first) answers its trial (after L0's or L1's: `_whole_step_turn`) and the rest at once, with noise after
    `honest_positions`."""
    servers: dict[str, FakeServer] = {}
    for i in range(3):
        liar = servers[f"L{i}"] = WholeStepLiar(0, 2, inference_rps=1000.0 if i < 2 else 200.0)
        liar.honest_positions = honest_positions
    liar.answers_rest = True
    return servers


def _whole_step_turn(manager: FakeManager, servers: dict[str, FakeServer]) -> Callable[[], None]:
    """The liars of `_whole_step_liars` turn, and the races after are ordered by events (`Judgements`), not delays:
    L2 answers a trial once L0's or L1's answer was judged (the first race's winner, which holds the rest: L2 loses
    that race), H and H2 (`AnswersAfter`) a session's first step once L2's answer was judged (they lose the race on
    the whole step to L2, or win it after L2's answer disagreed)."""

    def turn() -> None:
        judgements = Judgements(manager)
        servers["L2"].trial_after = judgements.of("L0", "L1")  # type: ignore[attr-defined]
        for name in ("H", "H2"):
            servers[name].after = judgements.of("L2")  # type: ignore[attr-defined]
        _hold(servers, WholeStepLiar)()

    return turn


def test_a_whole_step_race_winner_is_verified_as_any_step(small_long_step_floor):
    """Every step is verified (`verify_fraction` 1.0). Three liars of blocks 0:2 (the best figures) turn at token 12:
    the one serving the session holds its step (moved); another answers the race's trial at once and honestly, then
    holds the rest (moved: decision 0176); the third wins the race on the whole step (its trial, after the first race's
    winner's, then the rest at once: decision 0184; the honest racers answer after it), with the history's positions
    computed and noise at the step's new one (which no earlier output can check). That step is
    verified as any other: the liar is outvoted by the honest referees and banned, the span replaced, the outputs the
    reference's. Before, a whole-step race's winner went unverified: its noise reached the next span and the output at
    token 12 was wrong, the liar unbanned."""
    torch.manual_seed(10)
    servers = _whole_step_liars(-1)
    servers.update(H=RefereeAnswersAfter(0, 2), H2=RefereeAnswersAfter(0, 2), C=Referee(2, 4), C2=Referee(2, 4))
    for name in ("H", "H2"):
        servers[name].delay_s = HONEST_STEP_S
    manager = FakeManager(
        servers, 4, request_timeout_s=REQUEST_TIMEOUT_S, liveness_check_period_s=1.0, verify_fraction=1.0
    )
    vouch(manager, "H", "H2")  # referees with a witness's standing (decision 0190)
    tokens, outputs, route, events = _sixteen_steps(manager, _whole_step_turn(manager, servers))
    assert route[0] in ("H", "H2")
    torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)
    moved = [e.peer_id for e in events if e.action == "moved"]
    assert len(moved) == 2 and all(peer.startswith("L") for peer in moved), events
    # the whole step's winner: the liar neither moved off nor left alone
    assert manager.bans.banned_peers() == {f"L{i}" for i in range(3)} - set(moved)


def test_a_whole_step_race_checks_every_position_the_span_gave_before(small_long_step_floor):
    """As above, without verification: the third liar answers a race on the whole step with its first 8 positions
    computed and noise after, the history's positions 8-11 included. The client holds the span's outputs there (the
    next span's inputs), so they are compared as the trial's are: the liar's answer disagrees (not blamed), an honest
    server wins the race, the outputs are the reference's, nobody is banned. Before, only the first 8 positions were
    compared: the first answer won, made up, and the output at token 12 was wrong."""
    torch.manual_seed(10)
    servers = _whole_step_liars(TRIAL_TOKENS)
    servers.update(H=AnswersAfter(0, 2), H2=AnswersAfter(0, 2), C=FakeServer(2, 4))
    for name in ("H", "H2"):
        servers[name].delay_s = HONEST_STEP_S
    manager = _manager(servers)
    tokens, outputs, route, events = _sixteen_steps(manager, _whole_step_turn(manager, servers))
    assert route[0] in ("H", "H2")
    torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)
    moved = [e.peer_id for e in events if e.action == "moved"]
    assert len(moved) == 2 and all(peer.startswith("L") for peer in moved), events
    assert not manager.bans.banned_peers()


class CountsRacerHistories(FakeServer):
    """Honest; at each step it serves, counts the span sessions of the client outside `session`'s chain that hold
    inputs of at least `positions` positions (the copies of the span's history the client keeps for racers), among
    `made`: every span session made since the test began. (Not `gc.get_objects()`: late in a worker that has run a
    thousand tests it walks millions of objects for a second or more, and the racers' deadlines ran out while H was
    counting.)"""

    session: InferenceSession | None = None
    positions = 0
    made: weakref.WeakSet[span_session.SpanSession]

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            if self.session is not None:
                chain = {id(s) for s in self.session._spans}
                held = [  # (not the closed racers of an earlier race, which may wait for the collector)
                    o for o in list(self.made) if id(o) not in chain and not o._closed and o.history is not None
                ]
                self.counted.append(sum(o.history.shape[1] >= self.positions for o in held))
            yield response

    counted: list[int]


def _registering_span_sessions(monkeypatch: pytest.MonkeyPatch) -> weakref.WeakSet[span_session.SpanSession]:
    """Every `SpanSession` made from now to the test's end, held weakly."""
    made: weakref.WeakSet[span_session.SpanSession] = weakref.WeakSet()
    init = span_session.SpanSession.__init__

    def registering_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.add(self)

    monkeypatch.setattr(span_session.SpanSession, "__init__", registering_init)
    return made


@pytest.mark.parametrize("whole", [False, True], ids=["trial", "whole_step"])
def test_racers_that_never_answer_hold_no_copy_of_the_history(
    small_long_step_floor, monkeypatch: pytest.MonkeyPatch, whole: bool
):
    """20 lorises of the span hold every step from token `hit` (then, for the whole-step race, the others hold only
    steps of more than 8 tokens: the trial's winner holds the rest), H is drawn last: a race starts 8 racers, then 8
    more each round while none answered, H in the third round. When H serves its trial (or the whole step), no racer
    of the client holds a copy of the span's history: a racer is given the history once it won a trial, and the
    whole step's inputs are one tensor shared by all racers. Before, each racer was given its own copy as it started:
    19 lorises holding their trials made the client keep 20 copies at once (up to `RACE_MAX` = 64 with more; a 70B
    model's 8,192-position history in float32 is 256 MiB a copy)."""
    torch.manual_seed(11)
    servers: dict[str, FakeServer] = {f"L{i:02d}": FakeServer(0, 4, inference_rps=1000.0) for i in range(20)}
    probe = servers["H"] = CountsRacerHistories(0, 4)
    hit = 20 if whole else 12
    probe.counted, probe.positions, probe.made = [], hit, _registering_span_sessions(monkeypatch)
    manager = _manager(servers)
    manager.rng = HonestLast(0)
    tokens = torch.randn(1, hit + 4, HIDDEN)
    with InferenceSession(manager, max_length=tokens.shape[1]) as session:
        for t in range(tokens.shape[1]):
            if t == hit:
                in_use = session.route[0][0].peer_id
                for name, server in servers.items():
                    if name != "H":
                        server.delay_s = LORIS_DELAY_S if name == in_use or not whole else 0.0
                        server.long_delay_s = LORIS_DELAY_S
                probe.session = session
            session.step(tokens[:, t : t + 1])
        assert session.route[0][0].peer_id == "H"
        events = list(session.stall_events)
    assert len([e for e in events if e.action == "moved"]) == (2 if whole else 1), events
    assert probe.counted and probe.counted[0] == 0, probe.counted


@pytest.mark.parametrize("prompt_length", [3, 10], ids=["shorter_than_a_trial", "longer_than_a_trial"])
def test_a_race_carries_the_deep_prompts(small_long_step_floor, prompt_length: int):
    """A session with deep prompts (given with its 12-token first step): three lorises of the whole chain (the best
    figures) hold every step from token 14 beside H. The race sends each racer the span's first positions with the
    prompts (a trial holding all of the prompts' positions: 8, or 10), H wins: one move, outputs the reference's
    with the prompts. Before (decision 0185), a session with deep prompts was not raced: the usual replacement
    walked the lorises (3 moves)."""
    torch.manual_seed(12)
    servers = {f"L{i}": FakeServer(0, 4, inference_rps=1000.0) for i in range(3)}
    servers["H"] = FakeServer(0, 4)
    manager = _manager(servers)
    tokens, prompts = torch.randn(1, 18, HIDDEN), 0.5 * torch.randn(4, 1, prompt_length, HIDDEN)
    with InferenceSession(manager, max_length=18) as session:
        outputs = [session.step(tokens[:, :12], prompts)]
        for t in range(12, 18):
            if t == 14:
                for name in servers:
                    servers[name].delay_s = LORIS_DELAY_S if name != "H" else 0.0
            outputs.append(session.step(tokens[:, t : t + 1]))
        assert [span.peer_id for span, _ in session.route] == ["H"]
        events = list(session.stall_events)
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4, prompts), atol=1e-5, rtol=0)
    assert len([e for e in events if e.action == "moved"]) == 1, events
    trial = max(TRIAL_TOKENS, prompt_length)
    assert [n for _, n in servers["H"].requests] == [trial, 15 - trial, 1, 1, 1]


def _beam_steps(manager: FakeManager, tokens: torch.Tensor, hypo_ids: list[torch.Tensor], slow_from: int, lorises):
    """One step a position, rows reordered by `hypo_ids[t]` from the second on; from `slow_from` the `lorises` hold
    every step. Returns the outputs and the session's stall events."""
    outputs = []
    with InferenceSession(manager, max_length=tokens.shape[1]) as session:
        for t in range(tokens.shape[1]):
            if t == slow_from:
                for loris in lorises:
                    loris.delay_s = LORIS_DELAY_S
            outputs.append(session.step(tokens[:, t : t + 1], hypo_ids=hypo_ids[t] if t else None))
        events = list(session.stall_events)
    return torch.cat(outputs, dim=1), events


@pytest.mark.parametrize("last", [False, True], ids=["a_middle_span", "the_last_span"])
def test_a_race_in_a_beam_search(small_long_step_floor, last: bool):
    """Beam search (3 rows reordered at every step) over three lorises (the best figures) and H of blocks 0:2 beside
    C (2:4), or of the whole chain: the lorises hold every step from token 12. The race sends the history as this
    step reordered it (no hypo ids: a fresh cache), checks the trials against the span's earlier outputs in the same
    row order (the next span's history, or the chain's kept first outputs, reordered with it), and the winner's
    next step sends the rest without hypo ids: one move, outputs those of an honest chain under the same reorderings.
    Before (decision 0185), a beam search was not raced: the usual replacement walked the lorises (3 moves)."""
    torch.manual_seed(13)
    end = 4 if last else 2
    tokens = torch.randn(3, 16, HIDDEN)
    reorder = torch.Generator().manual_seed(3)
    hypo_ids = [torch.randint(0, 3, (3,), generator=reorder) for _ in range(16)]
    honest = {"H": FakeServer(0, end)} | ({} if last else {"C": FakeServer(2, 4)})
    expected, _ = _beam_steps(_manager(honest), tokens, hypo_ids, 99, [])
    servers: dict[str, FakeServer] = {f"L{i}": FakeServer(0, end, inference_rps=1000.0) for i in range(3)}
    servers |= {"H": FakeServer(0, end)} | ({} if last else {"C": FakeServer(2, 4)})
    lorises = [server for name, server in servers.items() if name.startswith("L")]
    outputs, events = _beam_steps(_manager(servers), tokens, hypo_ids, 12, lorises)
    torch.testing.assert_close(outputs, expected, atol=1e-5, rtol=0)
    assert len([e for e in events if e.action == "moved"]) == 1, events
    assert [n for _, n in servers["H"].requests] == [TRIAL_TOKENS, 13 - TRIAL_TOKENS, 1, 1, 1]


@pytest.mark.parametrize("lorises", [4, 8])
def test_alternating_lorises_cost_two_moves(small_long_step_floor, lorises: int):
    """K servers announcing the best figures; from token 18 the one in use holds every step and the others alternate
    two kinds: half answer steps of at most 8 tokens at once and hold longer ones, half answer long steps at once and
    hold short ones (a decode step, a race's trial), beside H (each step 0.05 s late). The first race's trial goes to
    a loris of the first kind, which holds the rest of the history (11 positions); the next race sends every racer
    the trial's positions, then the rest (decision 0184), which a loris of either kind holds one of: H wins, two
    moves whatever K. With the whole step in one request (0176), a loris of the second kind won that race and held
    the next decode step, and the kinds alternated (a move each, ~21 s a pair at the default budgets)."""
    torch.manual_seed(14)
    servers = {f"L{i}": FakeServer(0, 4, inference_rps=1000.0) for i in range(lorises)}
    servers["H"] = FakeServer(0, 4)
    servers["H"].delay_s = HONEST_STEP_S
    manager = _manager(servers)
    tokens = torch.randn(1, 24, HIDDEN)
    outputs = []
    with InferenceSession(manager, max_length=24) as session:
        for t in range(24):
            if t == 18:
                in_use = session.route[0][0].peer_id
                servers[in_use].delay_s = LORIS_DELAY_S
                others = sorted(name for name in servers if name not in (in_use, "H"))
                for i, name in enumerate(others):
                    if i % 2:
                        servers[name].short_delay_s = LORIS_DELAY_S
                    else:
                        servers[name].long_delay_s = LORIS_DELAY_S
            outputs.append(session.step(tokens[:, t : t + 1]))
        assert [span.peer_id for span, _ in session.route] == ["H"]
        events = list(session.stall_events)
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    moved = [e for e in events if e.action == "moved"]
    assert 1 <= len(moved) <= 2 and all(e.peer_id.startswith("L") for e in moved), events
    assert manager.avoided_peers() == {e.peer_id for e in moved} and not manager.bans.banned_peers()


class ClientPauses:
    """The clock of the client's step waiters (`time.monotonic` as `span_session` and `framed_socket` read it; not
    the process's: the background loop outlives the test): `jump(s)` is a pause of `s` of the client's loop and
    threads (a GC collection, a CPU-starved host), without the wait."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.offset_s = 0.0
        clock = types.SimpleNamespace(monotonic=lambda: time.monotonic() + self.offset_s)
        monkeypatch.setattr(span_session, "time", clock)
        monkeypatch.setattr(framed_socket, "time", clock)

    def now(self) -> float:
        return time.monotonic() + self.offset_s

    def jump(self, seconds: float) -> None:
        self.offset_s += seconds


class PausedWhileComputing(FakeServer):
    """Answers its steps at once, but the client pauses `pause_s` while it computes each (`ClientPauses`): the reply
    is there when the client's waiter runs again, past the step's deadline by the clock."""

    def __init__(self, start: int, end: int, pauses: ClientPauses, inference_rps: float = 100.0):
        super().__init__(start, end, inference_rps)
        self.pauses: ClientPauses | PausedOnWaking = pauses
        self.pause_s = 0.0

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            self.pauses.jump(self.pause_s)
            yield response


class PausedOnWaking:
    """`jump`s named (by a server's thread) fall as the client thread's `poller()` wakes to a readable socket."""

    def __init__(self, pauses: ClientPauses) -> None:
        self.pauses, self.named_s = pauses, 0.0

    def jump(self, seconds: float) -> None:
        self.named_s += seconds

    def poller(self, sock: socket.socket):
        readable, woken = select.poll(), self
        readable.register(sock, select.POLLIN)

        class Poller:
            def poll(self, timeout_ms: float):
                events = readable.poll(timeout_ms)
                if events and woken.named_s:
                    woken.pauses.jump(woken.named_s)
                    woken.named_s = 0.0
                return events

        return Poller()


@pytest.fixture
def pauses(monkeypatch: pytest.MonkeyPatch) -> ClientPauses:
    monkeypatch.setattr(stalls, "STALL_MIN_S", 0.2)
    monkeypatch.setattr(stalls, "LATE_BUDGET_S", 3.0)
    return ClientPauses(monkeypatch)


def _paused_then_late(
    servers: dict[str, FakeServer], manager: FakeManager, session: InferenceSession, paused: PausedWhileComputing
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eight steps: the client pauses 1.5 s during each of steps 2-5 (6 s in all, past the 3 s late budget), and A
    answers step 6 0.5 s late (past its 0.2 s deadline, within the budget) at once after."""
    tokens, outputs = torch.randn(1, 8, HIDDEN), []
    for t in range(8):
        paused.pause_s = 1.5 if 2 <= t < 6 else 0.0
        servers["A"].delay_s = 0.5 if t == 6 else 0.0
        outputs.append(session.step(tokens[:, t : t + 1]))
    return tokens, torch.cat(outputs, dim=1)


def test_the_clients_own_pauses_are_not_charged_to_an_honest_server(pauses):
    """Decision 0233: A answers at once, while the client's loop pauses 1.5 s on four steps (the reply waits for it):
    none of that is A's lateness. Its late budget is whole after them, and its one late step after (0.5 s) is waited
    for (a `slow` event), not a move. On main each pause was charged (1.3 s past the 0.2 s deadline), the budget ran
    out, and the late step moved the session to B."""
    torch.manual_seed(5)
    servers: dict[str, FakeServer] = {"A": PausedWhileComputing(0, 4, pauses, inference_rps=1000.0)}
    servers["B"] = FakeServer(0, 4)
    manager = _manager(servers)
    with InferenceSession(manager, max_length=8) as session:
        budgets: list[float] = []
        session_step = session.step

        def step(inputs):  # (the budget left after each step)
            out = session_step(inputs)
            budgets.append(session._spans[0].clock.late_left_s(pauses.now()))
            return out

        session.step = step
        tokens, outputs = _paused_then_late(servers, manager, session, servers["A"])
        route, events = [span.peer_id for span, _ in session.route], list(session.stall_events)
    torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)
    assert budgets[5] == stalls.LATE_BUDGET_S, budgets  # after the four paused steps
    assert route == ["A"] and [e.action for e in events] == ["slow"], events
    assert not servers["B"].requests and "A" not in manager.avoided_peers()


def test_the_clients_own_pauses_are_not_charged_from_the_callers_thread(pauses, monkeypatch):
    """The same where the steps run in the caller's thread over the server's socket (`SpanSession.step_here`: the
    same `StepWait`, without pings): on main the paused steps spent the budget and the late one moved to B."""
    torch.manual_seed(6)
    servers: dict[str, FakeServer] = {"A": PausedWhileComputing(0, 4, pauses, inference_rps=1000.0)}
    servers["B"] = FakeServer(0, 4)
    manager = _manager(servers)
    served = socket_served(monkeypatch, manager, servers["A"])
    # the pause is the stepping thread's: it falls as the thread's poll(2) sees the reply (the server's thread only
    # names it), so that the thread was asleep when it began
    servers["A"].pauses = woken = PausedOnWaking(pauses)
    served.stream._readable = woken.poller(served.stream.sock)
    try:
        with InferenceSession(manager, max_length=8) as session:
            tokens, outputs = _paused_then_late(servers, manager, session, servers["A"])
            route, events = [span.peer_id for span, _ in session.route], list(session.stall_events)
            steps_here, late_left_s = session.num_steps_here, session._spans[0].clock.late_left_s(pauses.now())
    finally:
        served.stop()
    torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)
    assert steps_here == 7  # (the first opened the session through the loop)
    assert route == ["A"] and not events and not servers["B"].requests
    assert late_left_s >= stalls.LATE_BUDGET_S - 0.5  # the late step's 0.3 s only


class PausedOnAnEmptyWake:
    """The stepping thread's poll(2): while `pause_s` is set, its next wake that finds no reply falls in a pause of
    the client of `pause_s` (`ClientPauses`), the reply still on its way."""

    def __init__(self, pauses: ClientPauses, sock: socket.socket) -> None:
        self.pauses, self.pause_s = pauses, 0.0
        self.readable = select.poll()
        self.readable.register(sock, select.POLLIN)

    def poll(self, timeout_ms: float):
        events = self.readable.poll(timeout_ms)
        if not events and self.pause_s:
            self.pauses.jump(self.pause_s)
            self.pause_s = 0.0
        return events


class AnswersAfterThePause(FakeServer):
    """Holds each answer while `waker`'s pause has yet to fall (the client's thread woke without the reply first,
    whatever the load on the machine)."""

    waker: PausedOnAnEmptyWake | None = None

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            while self.waker is not None and self.waker.pause_s:
                await asyncio.sleep(0.01)
            yield response


def test_a_pause_of_the_client_past_the_request_timeout_is_not_a_timeout_from_the_callers_thread(pauses, monkeypatch):
    """A step in the caller's thread whose thread pauses past `request_timeout_s` (25 s against 20) while A computes
    (A answers once the pause fell, a fraction of a second after the request): the pause is the client's, credited by
    the step's wait, and A's reply is taken. On main `exchange` kept a wall-clock deadline of its own beside the
    wait's, raised TimeoutError at the first wake past it, and the session left A for B (replaying its history there)."""
    torch.manual_seed(8)
    a = AnswersAfterThePause(0, 4, inference_rps=1000.0)
    servers = {"A": a, "B": FakeServer(0, 4)}
    manager = _manager(servers)
    served = socket_served(monkeypatch, manager, a)
    served.stream._readable = a.waker = poller = PausedOnAnEmptyWake(pauses, served.stream.sock)
    tokens, outputs = torch.randn(1, 4, HIDDEN), []
    try:
        with InferenceSession(manager, max_length=4) as session:
            for t in range(4):
                if t == 2:
                    poller.pause_s = REQUEST_TIMEOUT_S + 5.0
                outputs.append(session.step(tokens[:, t : t + 1]))
            route, steps_here = [span.peer_id for span, _ in session.route], session.num_steps_here
    finally:
        served.stop()
    assert poller.pause_s == 0.0  # (the pause fell)
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    assert route == ["A"] and steps_here == 3 and not servers["B"].requests


class PingPausedManager(FakeManager):
    """A ping asked while `pause_ping` is set fails only after the client paused past its timeout (`ClientPauses`):
    the answer came during the pause, the ping's timer fired first."""

    pauses: ClientPauses
    pause_ping = False

    async def ping_s(self, peer_id):
        if self.pause_ping:
            self.pause_ping = False
            self.pauses.jump(self.config.ping_timeout_s + 1.5)
            return math.inf
        return await super().ping_s(peer_id)


def test_a_ping_failed_by_the_clients_own_pause_does_not_fail_the_server_over(pauses):
    """A answers a step 0.5 s late (past its 0.2 s deadline): the client pings it, and its loop pauses past the ping's
    timeout, so the ping fails late. That proves nothing of A: the ping is asked again, A answers it and is waited
    for (`slow`), its step's time past the ping's timeout not charged. On main A was failed over (`HopStalled`) and
    banned."""
    torch.manual_seed(7)
    servers = {"A": FakeServer(0, 4, inference_rps=1000.0), "B": FakeServer(0, 4)}
    manager = PingPausedManager(servers, 4, request_timeout_s=REQUEST_TIMEOUT_S, liveness_check_period_s=1.0)
    manager.pauses = pauses
    tokens, outputs = torch.randn(1, 4, HIDDEN), []
    with InferenceSession(manager, max_length=4) as session:
        for t in range(4):
            servers["A"].delay_s = 0.5 if t == 2 else 0.0
            manager.pause_ping = t == 2
            outputs.append(session.step(tokens[:, t : t + 1]))
        route, events = [span.peer_id for span, _ in session.route], list(session.stall_events)
        late_left_s = session._spans[0].clock.late_left_s(pauses.now())
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    assert route == ["A"] and [e.action for e in events] == ["slow"], events
    assert not manager.bans.is_banned("A") and not servers["B"].requests
    # charged what the ping's timeout took (2 s, the server's time) and no more: not the 1.5 s pause past it
    assert late_left_s >= stalls.LATE_BUDGET_S - manager.config.ping_timeout_s - 0.5


class AnswersWhenPinged(FakeServer):
    """Holds each answer while `holding`, until the client pings it (`pinged`, set by the manager): a server late
    past the step's deadline that answers pings, ordered by the ping, not by time."""

    def __init__(self, start: int, end: int, inference_rps: float = 100.0):
        super().__init__(start, end, inference_rps)
        self.holding, self.pinged = False, threading.Event()

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            if self.holding:
                await asyncio.to_thread(self.pinged.wait, 30.0)
            yield response


def test_a_late_server_on_a_socket_stream_is_pinged_from_the_callers_thread_as_from_the_loop(
    small_budgets, monkeypatch
):
    """Decision 0233: a step run in the caller's thread over a socket stream that reaches the server through the
    network (direct TCP, p2pd; not the same-host socket, whose server is not pinged) waits under the loop's policy:
    pinged at its deadline, a server that answers is `slow` and waited for within the late budget. On main that path
    pinged only every `liveness_check_period_s` (1 s here), never at the deadline: no event (and a silent server was
    noticed a period late, failed with a ConnectionError whether another server held its blocks or not)."""
    torch.manual_seed(8)
    servers: dict[str, FakeServer] = {"A": AnswersWhenPinged(0, 4, inference_rps=1000.0), "B": FakeServer(0, 4)}
    manager = _manager(servers)
    served = socket_served(monkeypatch, manager, servers["A"])

    async def ping_s(peer_id):
        servers["A"].pinged.set()
        return 0.001

    monkeypatch.setattr(span_session.SpanSession, "local", property(lambda self: None))  # (as over the network)
    monkeypatch.setattr(manager, "ping_s", ping_s)
    tokens, outputs = torch.randn(1, 4, HIDDEN), []
    try:
        with InferenceSession(manager, max_length=4) as session:
            for t in range(4):
                servers["A"].holding = t == 2
                outputs.append(session.step(tokens[:, t : t + 1]))
            route, events, steps_here = (
                [s.peer_id for s, _ in session.route],
                session.stall_events,
                session.num_steps_here,
            )
    finally:
        served.stop()
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    assert steps_here == 3 and route == ["A"] and not servers["B"].requests
    assert [(e.action, e.step_deadline_s) for e in events] == [("slow", pytest.approx(0.2))], events
