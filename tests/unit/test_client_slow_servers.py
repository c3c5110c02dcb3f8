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
import random
import socket
import threading

import pytest
import torch
from hivemind.proto import runtime_pb2

from corolla.client.session import replacement_race, span_session, stalls
from corolla.client.session.inference_session import InferenceSession
from corolla.client.session.replacement_race import TRIAL_TOKENS, TrialDisagrees, check_trial, race_candidates
from corolla.client.session.stalls import LATE_LEAK, StepClock, announced_step_s, announced_token_s
from corolla.client.transport.local_transport import LocalInferenceStream
from corolla.protocol import local_stream as ls
from corolla.protocol.codecs import deserialize_tensor, serialize_tensor
from corolla.protocol.records import RemoteSpanInfo
from corolla.swarm.route_planning import proven_where_they_cover
from helpers.fake_chain import HIDDEN, FakeManager, FakeServer, record_of, reference

REQUEST_TIMEOUT_S = 20.0
LORIS_DELAY_S = REQUEST_TIMEOUT_S - 2.0  # every step answered just under the timeout


@pytest.fixture
def small_budgets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stalls, "STALL_MIN_S", 0.2)
    monkeypatch.setattr(stalls, "LATE_BUDGET_S", 1.0)


def _manager(servers: dict[str, FakeServer]) -> FakeManager:
    return FakeManager(servers, 4, request_timeout_s=REQUEST_TIMEOUT_S, liveness_check_period_s=1.0)


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


def test_a_slow_server_on_a_socket_stream_is_left_from_the_callers_thread(small_budgets, monkeypatch):
    """The same over the server's socket, where steps run in the caller's thread: the wait ends at the deadline plus
    the budget, the span is replaced without a ban, and the outputs are exact."""
    torch.manual_seed(3)
    servers = {"A": FakeServer(0, 4, inference_rps=1000.0), "B": FakeServer(0, 4)}
    manager = _manager(servers)
    served = SocketServed(servers["A"], "A")

    async def open_socket_stream(manager, peer_id, rpc):
        return served.stream if peer_id == "A" else None

    monkeypatch.setattr(span_session, "open_socket_stream", open_socket_stream)
    monkeypatch.setattr(manager, "cached_input_compression", lambda peer_id: runtime_pb2.CompressionType.NONE)
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
    tokens = torch.randn(1, 16, HIDDEN)
    outputs = []
    with InferenceSession(manager, max_length=16) as session:
        for t in range(16):
            if t == 12:
                servers["A"].delay_s = LORIS_DELAY_S
            outputs.append(session.step(tokens[:, t : t + 1]))
        assert [span.peer_id for span, _ in session.route] == ["C"]
        events = list(session.stall_events)
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
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
    tokens = torch.randn(1, 16, HIDDEN)
    outputs = []
    with InferenceSession(manager, max_length=16) as session:
        for t in range(16):
            if t == 12:
                for name in servers:
                    servers[name].delay_s = LORIS_DELAY_S if name != "H" else 0.0
            outputs.append(session.step(tokens[:, t : t + 1]))
        assert [span.peer_id for span, _ in session.route] == ["H"]
        events = list(session.stall_events)
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    moved = [e for e in events if e.action == "moved"]
    assert len(moved) == 1 and moved[0].peer_id.startswith("L") and moved[0].num_tokens == 1, events
    # a lone candidate gets the whole replay (no race); raced, H is sent the first 8 positions, then the rest
    first = [13] if lorises == 1 else [TRIAL_TOKENS, 13 - TRIAL_TOKENS]
    assert [tokens for _, tokens in servers["H"].requests[: len(first)]] == first
    assert _served_tokens(servers["H"]) == 16 and servers["H"].final_lengths == [16]
    assert manager.avoided_peers() == {moved[0].peer_id} and not manager.bans.banned_peers()


class TrialLoris(FakeServer):
    """Honest until `holding`; then a fresh session's first step (a race's trial) is answered at once with outputs it
    never computed (noise of the right shape), and every later step held just under `request_timeout_s`."""

    holding = False

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            metadata, _ = self.requests[-1]
            if self.holding and metadata["start_from_position"] == 0:
                noise = torch.randn_like(deserialize_tensor(response.tensors[0]))
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
    ("last", "wire"),
    [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)],
    ids=["a_middle_span", "the_last_span", "bfloat16_servers"],
)
def test_lorises_answering_the_trial_at_once_do_not_win_the_race(small_long_step_floor, last: bool, wire: torch.dtype):
    """K = 3 lorises of blocks 0:2 (the best figures) hold every step from token 12 but answer a race's trial at once,
    uncomputed, beside H (50 ms a step) and C (2:4); or of the whole chain 0:4 beside H: a trial's outputs must agree
    with what the span gave before (C's inputs there; the chain's first outputs, kept by the session), so H wins the
    first race: one move, outputs the reference's, the lorises neither banned nor avoided nor counted as seen on time
    for their trials. Before,
    the first answer won: each loris in turn won a race and held the rest (3 moves; 7 lorises: 63 s, 7 moves, in
    process)."""
    torch.manual_seed(8)
    end = 4 if last else 2
    servers: dict[str, FakeServer] = {f"L{i}": TrialLoris(0, end, inference_rps=1000.0) for i in range(3)}
    servers["H"] = FakeServer(0, end) if wire is torch.float32 else Bfloat16Replies(0, end)
    servers["H"].delay_s = 0.05
    if not last:
        servers["C"] = FakeServer(2, 4)
    manager = _manager(servers)
    tokens = torch.randn(1, 16, HIDDEN)
    outputs = []
    with InferenceSession(manager, max_length=16) as session:
        for t in range(16):
            if t == 12:
                for server in servers.values():
                    if isinstance(server, TrialLoris):
                        server.holding = True
            outputs.append(session.step(tokens[:, t : t + 1]))
        assert [span.peer_id for span, _ in session.route] == (["H"] if last else ["H", "C"])
        events = list(session.stall_events)
    moved = [e for e in events if e.action == "moved"]
    assert len(moved) == 1 and moved[0].peer_id.startswith("L"), events
    assert manager.avoided_peers() == {moved[0].peer_id} and not manager.bans.banned_peers()
    # the lorises' trials came on time but proved nothing: the next sessions are not planned over them (0163's rule)
    assert manager.answered_on_time() == ({"H"} if last else {"H", "C"})
    if wire is torch.float32:
        torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    else:  # H's last positions rounded to bfloat16 on their way to C
        torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=0.1, rtol=0.05)


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


def test_after_a_loris_new_sessions_start_on_servers_seen_on_time(small_long_step_floor):
    """Three lorises (the best figures) and H; a first session is held from token 4, moves, and the race gives it to
    H. The client's next session, started right after while the lorises still hold steps, is planned over the servers
    it saw answer on time where they cover the blocks (for `SLOW_AVOID_S`, decision 0163): it starts on H, no loris
    gets a request, nothing stalls. Before, its route followed the announced figures to a loris that was not avoided
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
        assert session.stall_events == []
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
    tokens = torch.randn(1, 16, HIDDEN)
    outputs = []
    with InferenceSession(manager, max_length=16) as session:
        for t in range(16):
            if t == 12:
                for name in servers:
                    servers[name].delay_s = LORIS_DELAY_S if name != "H" else 0.0
            outputs.append(session.step(tokens[:, t : t + 1]))
        assert [span.peer_id for span, _ in session.route] == ["H"]
        events = list(session.stall_events)
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
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
    manager.avoid("W", 60.0)  # avoided since: neither a candidate nor measured any more
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
    computed its lost trial (8 positions) and the whole prompt in one step."""
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
    if len(moved) == 2:  # H lost the trial (8 positions at most), then won the whole step: the prompt in one step
        assert [n for _, n in servers["H"].requests[-5:]] == [PROMPT_TOKENS, 1, 1, 1, 1]
        assert _served_tokens(servers["H"]) <= TRIAL_TOKENS + tokens.shape[1]
    assert manager.avoided_peers() == {e.peer_id for e in moved} and not manager.bans.banned_peers()
