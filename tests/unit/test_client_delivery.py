"""A span judged by what it delivers (decision 0189), against in-process fake servers: a server announcing the best
figures that answers every decode step under the deadline floor (never late, so 0144's rules never move it) loses the
session to a faster server of its blocks once the saving over the session's rest pays the move; outputs stay the
reference's, the faster server replays the history once, the slow one is avoided (not banned) and priced by what it
delivered for the client's next routes; honest servers within the margin keep their sessions, and a session moves at
most once a period."""

from __future__ import annotations

import math
import time

import pytest
import torch

from corolla.client.routing import observed_steps
from corolla.client.routing.observed_steps import ANNOUNCED_DISCOUNT, ObservedSteps
from corolla.client.session import delivery
from corolla.client.session.delivery import MovePacer, Outpaced, Workload, judge, pace_of
from corolla.client.session.inference_session import InferenceSession
from corolla.client.session.stalls import StepClock
from corolla.protocol.records import RemoteSpanInfo
from helpers.fake_chain import HIDDEN, AnswersAfter, FakeManager, FakeServer, Judgements, record_of, reference

pytestmark = pytest.mark.usefixtures("frozen_heap")  # steps timed in real time: no pause of the heap's GC

FLOOR_LORIS_S = 0.5  # under the 1 s deadline floor (`stalls.STALL_MIN_S`): never late
PROMPT_LORIS_S = 3.375  # a long step's delay under its 4 s floor (`stalls.LONG_STEP_MIN_S`): never late
# (half-way between the waiter's wakes, `step_wait.WAKE_EVERY_S` apart: a reply due at a wake, read after a pause of the
# client's loop that spanned both, came when is not known and is not measured; hflake3, decision 0233)
TOKENS = 20
PREFILL_RPS = 1e4  # an honest server's prefill figure (`forward_rps`, tokens a second a block)


def _prefilling(server: FakeServer) -> FakeServer:
    """`server` announcing a prefill rate (`forward_rps`: `PREFILL_RPS`) beside its decode figure."""
    record = server.server_info()
    record.forward_rps = PREFILL_RPS
    server.server_info = lambda: record  # type: ignore[method-assign]
    return server


def _manager(servers: dict[str, FakeServer]) -> FakeManager:
    return FakeManager(servers, 4, request_timeout_s=20.0, liveness_check_period_s=1.0)


def _outpaced(session: InferenceSession) -> list[str]:
    return [e.peer_id for e in session.stall_events if e.action == "outpaced"]


def _generate(manager: FakeManager, x: torch.Tensor) -> tuple[InferenceSession, torch.Tensor, list[str]]:
    """One token a step over `x` [1, T, H]: the session, its outputs [1, T, H], its route at the end."""
    with InferenceSession(manager, max_length=x.shape[1]) as session:
        outputs = torch.cat([session.step(x[:, t : t + 1]) for t in range(x.shape[1])], dim=1)
        route = [s.peer_id for s, _ in session.route]
    return session, outputs, route


def _timed_generation(manager: FakeManager) -> tuple[InferenceSession, list[str], float]:
    """`_generate` over `TOKENS` random inputs, its outputs checked against the reference: the session, its route at
    the end and the seconds it took."""
    x = torch.randn(1, TOKENS, HIDDEN)
    started = time.monotonic()
    session, outputs, route = _generate(manager, x)
    took_s = time.monotonic() - started
    torch.testing.assert_close(outputs, reference(x, 4))
    return session, route, took_s


@pytest.mark.parametrize("lorises", [1, 3])
def test_a_floor_loris_loses_the_session_to_a_faster_server(lorises: int):
    """K servers announcing 1e6 blocks/s answer every step 0.5 s late (under the 1 s floor: no stall event on main,
    the session stays on the first for all 20 steps, >= 10 s); H (honest, 100 blocks/s announced) answers at once.
    Now the session moves once, after `JUDGE_MIN_STEPS` steps (K = 1: the usual replacement; K = 3: 0163's race,
    whose trial H wins), H replays the history once, the outputs are the reference's, the loris is avoided and
    priced for the next routes, nobody banned."""
    torch.manual_seed(0)
    servers = {f"L{i}": FakeServer(0, 4, inference_rps=1e6) for i in range(lorises)}
    for server in servers.values():
        server.delay_s = FLOOR_LORIS_S
    servers["H"] = FakeServer(0, 4)
    manager = _manager(servers)
    session, route, took_s = _timed_generation(manager)
    moved = _outpaced(session)
    assert len(moved) == 1 and moved[0].startswith("L"), session.stall_events
    assert not [e for e in session.stall_events if e.action != "outpaced"]
    assert route == ["H"]
    on_h = sum(tokens for _, tokens in servers["H"].requests)
    assert TOKENS <= on_h <= TOKENS + 8, on_h  # each position once (a race's trial re-sends at most 8)
    assert took_s < TOKENS * FLOOR_LORIS_S / 2, took_s  # main: every step on the loris, >= 10 s
    assert moved[0] in manager.avoided_peers() and not manager.bans.banned_peers()
    # the client's next routes price the loris by what it delivered (here after its avoidance ran out)
    assert manager.observed_steps.block_s(moved[0], time.monotonic()) == pytest.approx(FLOOR_LORIS_S / 4, rel=0.5)


def _turns(
    manager: FakeManager, x: torch.Tensor, turns: list[tuple[int, int]]
) -> tuple[InferenceSession, torch.Tensor, list[str]]:
    """A conversation over `x` [1, T, H] in one session: each turn a prompt of `turns[i][0]` positions (one long
    step), then `turns[i][1]` one-token steps; the session, its outputs [1, T, H], its route at the end."""
    outs, t = [], 0
    with InferenceSession(manager, max_length=x.shape[1]) as session:
        for prompt, decoded in turns:
            outs.append(session.step(x[:, t : t + prompt]))
            t += prompt
            for _ in range(decoded):
                outs.append(session.step(x[:, t : t + 1]))
                t += 1
        route = [s.peer_id for s, _ in session.route]
    assert t == x.shape[1]
    return session, torch.cat(outs, dim=1), route


def test_a_server_that_crawls_on_prompts_loses_the_next_turn():
    """L (announcing 1e6 blocks/s: routes take it) answers decode steps at once and every long step 3 s late
    (under the 4 s floor: never late); H announces honest figures (1,000 blocks/s, a prefill rate). Two turns of a
    conversation, each a 40-token prompt and 10 tokens: the first prompt goes to L (nothing known), then before the
    second prompt the client prices it on L at what L delivered on long steps and moves to H (the replay and the
    prompt there), once; outputs are the reference's, L avoided, nobody banned. On main L holds both prompts (its
    decode steps are faster than what H announces: nothing to judge)."""
    torch.manual_seed(0)
    servers = {"L": FakeServer(0, 4, inference_rps=1e6), "H": _prefilling(FakeServer(0, 4, inference_rps=1e3))}
    servers["L"].long_delay_s = PROMPT_LORIS_S
    manager = _manager(servers)
    x = torch.randn(1, 100, HIDDEN)
    session, outputs, route = _turns(manager, x, [(40, 10), (40, 10)])
    torch.testing.assert_close(outputs, reference(x, 4))
    assert [e.action for e in session.stall_events] == ["outpaced"], session.stall_events
    event = session.stall_events[0]
    assert event.peer_id == "L" and event.num_tokens == 40 and event.detected_after_s > 2 * event.step_deadline_s
    assert route == ["H"]
    assert [tokens for _, tokens in servers["L"].requests if tokens > 8] == [40]  # the second prompt never went there
    assert sum(tokens for _, tokens in servers["H"].requests) == 50 + 50  # the replay with the prompt, then 10 steps
    assert "L" in manager.avoided_peers() and not manager.bans.banned_peers()
    assert manager.observed_steps.token_block_s("L", time.monotonic()) == pytest.approx(
        PROMPT_LORIS_S / 40 / 4, rel=0.5
    )


def test_a_fresh_sessions_prompt_is_routed_past_a_server_seen_crawling_on_prompts():
    """L (1e6 blocks/s announced) answers decode steps at once and every long step 3 s late; H announces honest
    figures. A first conversation (a 40-token prompt, 10 tokens) goes to L by its figures and the client times L's
    prompt. A second conversation, a fresh session of the same client, plans its route for its first step, a 40-token
    prompt, at what L delivered on long steps and opens on H: the prompt never meets L's crawl again (on main L, by
    its decode figure, took it: 3 s more). Outputs are the reference's; nothing moved, avoided or banned."""
    torch.manual_seed(0)
    servers = {"L": FakeServer(0, 4, inference_rps=1e6), "H": _prefilling(FakeServer(0, 4, inference_rps=1e3))}
    servers["L"].long_delay_s = PROMPT_LORIS_S
    manager = _manager(servers)
    x = torch.randn(1, 50, HIDDEN)
    first, outputs, route = _turns(manager, x, [(40, 10)])
    torch.testing.assert_close(outputs, reference(x, 4))
    assert route == ["L"] and not first.stall_events
    assert manager.observed_steps.token_block_s("L", time.monotonic()) is not None
    y = torch.randn(1, 50, HIDDEN)
    second, outputs, route = _turns(manager, y, [(40, 10)])
    torch.testing.assert_close(outputs, reference(y, 4))
    assert route == ["H"] and not second.stall_events
    assert [tokens for _, tokens in servers["L"].requests if tokens > 8] == [40]  # the first conversation's prompt
    assert sum(tokens for _, tokens in servers["H"].requests) == 50
    assert not manager.avoided_peers() and not manager.bans.banned_peers()
    # a route for decode steps alone (a session opened on a one-token step) still prices L by its decode figure
    assert manager.make_sequence(0, 4, mode="min_latency")[0].peer_id == "L"


def test_a_span_only_two_faster_servers_cover_moves_to_the_pair():
    """L (blocks 0:4, announcing 1e6 blocks/s) answers every step 0.5 s late (a floor loris); no other server holds
    0:4, but P (0:2) and Q (2:4) do, each answering at once: the session moves once to the chain P => Q, which
    replays the history (each position once, no race), outputs the reference's. On main only single servers were
    candidates: the session crawled on L for all 20 steps."""
    torch.manual_seed(0)
    servers = {"L": FakeServer(0, 4, inference_rps=1e6), "P": FakeServer(0, 2), "Q": FakeServer(2, 4)}
    servers["L"].delay_s = FLOOR_LORIS_S
    manager = _manager(servers)
    session, route, took_s = _timed_generation(manager)
    assert _outpaced(session) == ["L"] and len(session.stall_events) == 1, session.stall_events
    assert route == ["P", "Q"]
    for name in ("P", "Q"):
        assert sum(tokens for _, tokens in servers[name].requests) == TOKENS  # each position once: the replay, then
    assert took_s < TOKENS * FLOOR_LORIS_S / 2, took_s  # main: every step on L, >= 10 s
    assert "L" in manager.avoided_peers() and not manager.bans.banned_peers()


def test_the_next_routes_price_a_server_by_what_it_delivered():
    """L announces 1e6 blocks/s, H 100: routes take L. Once this client saw L deliver 0.5 s steps over 4 blocks,
    L is priced at ANNOUNCED_DISCOUNT / 0.125 s = 32 blocks/s and routes take H (on main: L every time; each
    client's first route: its next ones weigh its own sessions' load on H too)."""
    servers = {"L": FakeServer(0, 4, inference_rps=1e6), "H": FakeServer(0, 4)}
    for _ in range(10):  # fresh clients (each route counts as its client's load on the server: one route each)
        assert _manager(servers).make_sequence(0, 4, mode="min_latency")[0].peer_id == "L"
        manager = _manager(servers)
        manager.observed_steps.note("L", FLOOR_LORIS_S / 4, time.monotonic())
        assert manager.make_sequence(0, 4, mode="min_latency")[0].peer_id == "H"


def test_honest_servers_within_the_margin_keep_their_sessions_whatever_their_steps():
    """Honest loaded servers, each step a little slower or faster than another's (the whole span S at 30 ms a decode
    step and 0.3 s a prompt; the pair P => Q at 10 ms and 0.2 s each; all announcing 100 blocks/s and a prefill
    figure), conversations of two turns one after the other: no move for delivery, before a prompt or after a decode
    step, nothing avoided (no flapping)."""
    servers = {
        "S": _prefilling(FakeServer(0, 4)),
        "P": _prefilling(FakeServer(0, 2)),
        "Q": _prefilling(FakeServer(2, 4)),
    }
    servers["S"].delay_s, servers["S"].long_delay_s = 0.03, 0.3
    for name in ("P", "Q"):
        servers[name].delay_s, servers[name].long_delay_s = 0.01, 0.2
    manager = _manager(servers)
    x = torch.randn(1, 40, HIDDEN)
    for _ in range(3):
        session, outputs, _ = _turns(manager, x, [(12, 8), (12, 8)])
        torch.testing.assert_close(outputs, reference(x, 4))
        assert not session.stall_events
    assert not manager.avoided_peers()


@pytest.mark.parametrize("delays", [(0.03, 0.02), (0.05, 0.01, 0.03)], ids=["two", "three"])
def test_honest_servers_within_the_margin_keep_their_sessions(delays: tuple[float, ...]):
    """Honest servers of one span answering at different paces (their load), each announcing 100 blocks/s (40 ms a
    step): sessions one after the other, each 20 steps, the client measuring every server it used; no session is
    ever moved for delivery (the slowest is within `SLOW_RATIO` x what the others deliver, or its announced figure
    discounted), so nothing flaps."""
    servers = {f"S{i}": FakeServer(0, 4) for i in range(len(delays))}
    for server, delay_s in zip(servers.values(), delays, strict=True):
        server.delay_s = delay_s
    manager = _manager(servers)
    x = torch.randn(1, TOKENS, HIDDEN)
    used = set()
    for _ in range(4):
        session, outputs, route = _generate(manager, x)
        torch.testing.assert_close(outputs, reference(x, 4))
        assert not session.stall_events
        used.update(route)
    assert not manager.avoided_peers()


@pytest.mark.parametrize(("then_s", "moves"), [(0.2, 1), (FLOOR_LORIS_S, 2)], ids=["within", "broken"])
def test_a_session_moves_for_delivery_at_most_once_a_period_while_the_move_keeps_its_promise(then_s, moves):
    """L0 (in use, 1e6 blocks/s announced) slows to 0.5 s a step; the session moves for a step expected at ~0.16 s
    (L1 and H announce 100 blocks/s) and the race puts it on L1 (H answers a session's first step only once L1's
    answer was judged: `AnswersAfter`); then L1 slows to `then_s` and H is measured fast (another session's figure):
    a move would pay. Within 2x its promise (0.2 s) L1 keeps the session for `MOVE_PERIOD_S` (honest servers whose
    load moves about are not chased: one move); past it (0.5 s) the promise is broken and the period no longer holds
    the blocks (decision 0214: a second move, to H; 0189's pacing held a destination 3000x over its promise, which
    let a fresh identity that won the race hold the session a period)."""
    servers = {"L0": FakeServer(0, 4, inference_rps=1e6), "L1": FakeServer(0, 4), "H": AnswersAfter(0, 4)}
    servers["L0"].delay_s, servers["H"].delay_s = FLOOR_LORIS_S, 0.05
    manager = _manager(servers)
    servers["H"].after = Judgements(manager).of("L1")  # type: ignore[attr-defined]
    x = torch.randn(1, 24, HIDDEN)
    with InferenceSession(manager, max_length=256) as session:
        session.pacer = MovePacer()
        outs = []
        for t in range(24):
            if session.route and session.route[0][0].peer_id == "L1" and servers["L1"].delay_s != then_s:
                servers["L1"].delay_s, servers["H"].delay_s = then_s, 0.0
                manager.observed_steps.note("H", 0.001, time.monotonic())
            outs.append(session.step(x[:, t : t + 1]))
        torch.testing.assert_close(torch.cat(outs, dim=1), reference(x, 4))
    assert _outpaced(session) == ["L0", "L1"][:moves], session.stall_events
    # (the first verdict: a pause of the client's loop past a step's 1 s deadline adds a `slow` event before it)
    verdict = next(e for e in session.stall_events if e.action == "outpaced")
    assert verdict.detected_after_s > 2 * verdict.step_deadline_s


def test_move_pacer_holds_blocks_a_period_while_they_keep_the_moves_promise():
    """`MovePacer`: blocks moved for a promised step move again within `MOVE_PERIOD_S` only where they deliver over
    `SLOW_RATIO` x it (per block: a hop of a chain is held to its share), or where nothing overlaps; after the
    period, freely."""
    pacer = MovePacer()
    pacer.moved(100.0, (0, 4), 0.1)
    assert not pacer.may_move(110.0, (0, 4), 0.2) and not pacer.may_move(110.0, (0, 4), None)
    assert pacer.may_move(110.0, (0, 4), 0.21)
    assert not pacer.may_move(110.0, (2, 4), 0.1) and pacer.may_move(110.0, (2, 4), 0.11)  # 2 of its 4 blocks
    assert pacer.may_move(110.0, (4, 8), 10.0) and pacer.may_move(110.0, (4, 8), None)  # other blocks
    assert pacer.may_move(100.0 + delivery.MOVE_PERIOD_S, (0, 4), 0.0)


@pytest.mark.parametrize(("identities", "honest_requests"), [(5, 1), (3, 9)], ids=["crawl_at_once", "behave_first"])
def test_fresh_identities_winning_races_in_turn_hold_the_session_a_judgment_each(identities, honest_requests):
    """N identities (1e6 blocks/s announced) each answer a session's first `honest_requests` requests at once (the
    race's trial, and 8 steps more in the second case) and every later one 0.25 s late; H answers in 20 ms. Each
    wins the race of the move off the one before it (its trial first) and crawls. On main the pacing held the blocks
    a `MOVE_PERIOD_S` after a move whatever the destination delivered: the second identity kept the session for the
    rest of its 64 steps (~60 slow steps, ~16 s against H's ~1.3 s; hrev12's Left: five identities hold it for good).
    Now each breaks its move's promise (a step expected at ~1 ms) and holds the session one judgment
    (`JUDGE_MIN_STEPS` slow steps, `JUDGE_PERIOD_S`), not a period; the session ends on H, each identity left once,
    outputs the reference's, nobody banned."""
    torch.manual_seed(0)
    slow_s = 0.25
    lorises = {f"L{i}": TrialsAtOnce(0, 4, slow_s, honest_requests=honest_requests) for i in range(identities)}
    servers: dict[str, FakeServer] = {**lorises, "H": FakeServer(0, 4, inference_rps=1000.0)}
    servers["H"].delay_s = 0.02
    manager = _manager(servers)
    session, route = _long_session(manager, torch.randn(1, 64, HIDDEN), 256)
    held = sum(loris.slow_answers for loris in lorises.values())
    assert route == ["H"], (route, session.stall_events)
    assert sorted(_outpaced(session)) == sorted(lorises), session.stall_events
    assert held <= identities * (delivery.JUDGE_MIN_STEPS + 2), held  # main: ~60 (every step after the first race)
    assert not manager.bans.banned_peers()


def test_two_lorises_of_one_chain_both_lose_the_session_within_the_period():
    """L0 (blocks 0:2) and L1 (2:4) announce 1e6 blocks/s and answer every step 0.5 s late; H0 and H1 hold the same
    blocks and answer at once. Both spans move (the pacer holds blocks that moved, not the session: decision 0196;
    one move a session a minute kept the chain on L1 for the period, as the swarm simulator showed for many sessions
    in a swarm of lorises, decision 0195), the outputs are the reference's."""
    servers = {"L0": FakeServer(0, 2, inference_rps=1e6), "L1": FakeServer(2, 4, inference_rps=1e6)}
    servers["L0"].delay_s = servers["L1"].delay_s = FLOOR_LORIS_S
    servers["H0"], servers["H1"] = FakeServer(0, 2), FakeServer(2, 4)
    manager = _manager(servers)
    x = torch.randn(1, TOKENS, HIDDEN)
    session, outputs, route = _generate(manager, x)
    torch.testing.assert_close(outputs, reference(x, 4))
    assert sorted(_outpaced(session)) == ["L0", "L1"], session.stall_events
    assert route == ["H0", "H1"]


class FarManager(FakeManager):
    """A client whose RTT to `far` servers is `FAR_RTT_S` (beyond the policy's region), 1 ms to the others."""

    FAR_RTT_S = 0.15

    def __init__(self, servers: dict[str, FakeServer], far: set[str]):
        self.far = far
        super().__init__(servers, 4, request_timeout_s=20.0, liveness_check_period_s=1.0)

    def measure_rtts_s(self, peer_ids):
        return {p: self.FAR_RTT_S if p in self.far else 0.001 for p in peer_ids}


def test_a_loris_alone_in_the_clients_region_loses_the_session_to_a_far_server():
    """L, the only server of the client's region (1 ms away), announces 1e6 blocks/s and answers 0.5 s a step; H,
    150 ms away, announces 1,000 blocks/s (expected 4 blocks x 4 ms + 150 ms). The session moves to H: the move's
    avoidance needs only the rest of the view to cover the blocks (decision 0196: 0189 asked the region to, as for a
    server out of cache, so a region's only server of some blocks kept its sessions however slowly it served)."""
    servers = {"L": FakeServer(0, 4, inference_rps=1e6), "H": FakeServer(0, 4, inference_rps=1000.0)}
    servers["L"].delay_s = FLOOR_LORIS_S
    manager = FarManager(servers, far={"H"})
    assert not manager.may_avoid("L")  # (a server out of cache would be waited for)
    x = torch.randn(1, TOKENS, HIDDEN)
    session, outputs, route = _generate(manager, x)
    torch.testing.assert_close(outputs, reference(x, 4))
    assert _outpaced(session) == ["L"] and route == ["H"], session.stall_events
    assert "L" in manager.avoided_peers()


def test_observed_figures_leave_out_the_rtt():
    """A span's delivered step less the client's RTT, per block, is what `ObservedSteps` keeps (decision 0196), and
    a measured server's pace is that x the blocks + its RTT: a server seen on 1 block over a 150 ms link is not
    expected at 4 x 150 ms on 4 blocks (0189 noted the RTT per block)."""
    servers = {"A": FakeServer(0, 4, inference_rps=1e6), "B": FakeServer(0, 4, inference_rps=100.0)}
    manager = FarManager(servers, far={"B"})
    now = time.monotonic()
    block_s = delivery.observed_block_s(manager, "B", 0.16, 1)
    assert block_s == pytest.approx(0.01)
    manager.observed_steps.note("B", block_s, now)
    b = next(s for s in manager.spans if s.peer_id == "B")
    assert pace_of(manager, b, now).decode_s(4) == pytest.approx(4 * 0.01 + FarManager.FAR_RTT_S)
    assert delivery.observed_block_s(manager, "A", 0.5, 4) == pytest.approx((0.5 - 0.001) / 4)


def _span(peer: str, rps: float | None, start: int = 0, end: int = 4) -> RemoteSpanInfo:
    info = record_of(start, end, rps if rps is not None else 100.0)
    if rps is None:
        info.inference_rps = None
    return RemoteSpanInfo(peer, start, end, info)


def _judge(
    manager: FakeManager,
    span: RemoteSpanInfo,
    step_s: float,
    steps: int,
    history: int,
    nbytes: int = 0,
    now: float | None = None,
    *,
    tokens: int = 0,
    token_s: float | None = None,
) -> Outpaced | None:
    """`judge` for `span` delivering decode steps of `step_s` (long steps at `token_s` a token), before a long step
    of `tokens` (0: after a decode step), with `steps` decode steps left and `history` positions to replay."""
    now = time.monotonic() if now is None else now
    own = pace_of(manager, span, now, step_s=step_s, token_s=token_s)
    return judge(manager, span, own, Workload(tokens, steps, history, nbytes), now)


def test_judge_weighs_the_saving_against_the_move():
    """The rule: over SLOW_RATIO x the other's expected step, and the saving over the rest beats the price by the
    margin; nothing with no steps left or with only the span's own server; a server with no figure is expected at
    the routes' default rate."""
    servers = {"A": FakeServer(0, 4, inference_rps=1e6), "B": FakeServer(0, 4, inference_rps=100.0)}
    manager = _manager(servers)
    a = manager.spans[0] if manager.spans[0].peer_id == "A" else manager.spans[1]
    now = time.monotonic()
    b_s = ANNOUNCED_DISCOUNT * 4 / 100.0 + 0.001  # B's expected step: 4 blocks at 100/s, discounted, + its RTT
    verdict = _judge(manager, a, 0.5, 100, 10, 0, now)
    assert verdict is not None and [h.peer_id for h in verdict.route] == ["B"]
    assert verdict.other_s == pytest.approx(b_s) and verdict.saving_s == pytest.approx(100 * (0.5 - b_s))
    assert _judge(manager, a, 1.9 * b_s, 100, 10, 0, now) is None  # within the ratio
    assert _judge(manager, a, 0.5, 0, 10, 0, now) is None  # the session is over
    assert _judge(manager, a, 0.5, 2, 10, 0, now) is None  # two steps left: the move costs more than they save
    # a long history makes the replay cost more than the rest saves
    assert _judge(manager, a, 0.5, 20, 100_000, 0, now) is None
    manager.observed_steps.note("B", 0.3 / 4, now)  # B seen at 0.3 s a step: 0.5 is within 2x
    assert _judge(manager, a, 0.5, 100, 10, 0, now) is None
    no_figure = FakeServer(0, 4)
    no_figure.server_info = lambda: _span("N", None).server_info  # (300 blocks/s, as routes price it)
    unannounced = _manager({"A": FakeServer(0, 4, inference_rps=1e6), "N": no_figure})
    a = next(s for s in unannounced.spans if s.peer_id == "A")
    verdict = _judge(unannounced, a, 0.5, 100, 10, 0, now)
    assert verdict is not None and verdict.other_s == pytest.approx(ANNOUNCED_DISCOUNT * 4 / 300 + 0.001)
    only = _manager({"A": FakeServer(0, 4, inference_rps=1e6)})
    assert _judge(only, only.spans[0], 0.9, 100, 10, 0, now) is None


def test_judge_weighs_chains_of_several_servers():
    """Where only two servers together cover the span (P and Q, halves), the chain is the candidate: its decode
    step is the sum of theirs, each replays the history over its blocks; a chain within the ratio is no move."""
    servers = {"L": FakeServer(0, 4, inference_rps=1e6), "P": FakeServer(0, 2), "Q": FakeServer(2, 4)}
    manager = _manager(servers)
    span = next(s for s in manager.spans if s.peer_id == "L")
    now = time.monotonic()
    half_s = ANNOUNCED_DISCOUNT * 2 / 100.0 + 0.001  # each half: 2 blocks at 100/s, discounted, + its RTT
    verdict = _judge(manager, span, 0.5, 100, 10, 0, now)
    assert verdict is not None and [(h.peer_id, h.start, h.end) for h in verdict.route] == [("P", 0, 2), ("Q", 2, 4)]
    assert verdict.other_s == pytest.approx(2 * half_s)
    replay_s = 2 * (0.001 + 10 * 2 * ANNOUNCED_DISCOUNT / 100.0)  # each half: 10 positions over 2 blocks, + RTT
    assert verdict.price_s == pytest.approx(delivery.MOVE_FIXED_S + replay_s)
    assert _judge(manager, span, 1.9 * 2 * half_s, 100, 10, 0, now) is None
    # a server covering more than the span is cut to it
    wide = _manager({"L": FakeServer(1, 3, inference_rps=1e6), "W": FakeServer(0, 4)})
    span = next(s for s in wide.spans if s.peer_id == "L")
    verdict = _judge(wide, span, 0.5, 100, 10, 0, now)
    assert verdict is not None and [(h.peer_id, h.start, h.end) for h in verdict.route] == [("W", 1, 3)]


def test_a_candidate_waits_for_the_step_in_progress_over_its_whole_span():
    """The swarm simulator's honest chase (decision 0205): a span of 2 blocks delivering 40 ms steps beside a busy
    server holding 8 blocks (a whole-model card) announcing 4 ms a block at the client: the wide server's step for
    those 2 blocks waits for the step in progress over all 8 (half of it, at its busy share), 25 ms in all, so 40 ms
    is within 2x and the session stays (main expected 9 ms and moved a piece of the chain onto the busy server, paying
    the wait it left out); a crawl still moves there, and an idle wide server is expected as before."""
    servers = {"A": FakeServer(2, 4, inference_rps=100.0), "W": FakeServer(0, 8, inference_rps=1000.0)}
    busy = servers["W"].server_info()
    busy.busy_fraction = 1.0
    servers["W"].server_info = lambda: busy  # type: ignore[method-assign]
    manager = FakeManager(servers, 8, request_timeout_s=20.0, liveness_check_period_s=1.0)
    a = next(s for s in manager.spans if s.peer_id == "A")
    w = next(s for s in manager.spans if s.peer_id == "W")
    now = time.monotonic()
    block_s = ANNOUNCED_DISCOUNT / 1000.0
    wait_s = 1.0 * 0.5 * 8 * block_s  # half a step over W's 8 blocks, busy all the time
    assert delivery.step_wait_s(w, block_s) == pytest.approx(wait_s)
    assert pace_of(manager, w, now).decode_s(2) == pytest.approx(2 * block_s + 0.001 + wait_s)
    assert _judge(manager, a, 0.04, 100, 10, 0, now) is None
    verdict = _judge(manager, a, 0.5, 100, 10, 0, now)  # a crawl still moves
    assert verdict is not None and [(h.peer_id, h.start, h.end) for h in verdict.route] == [("W", 2, 4)]
    assert verdict.other_s == pytest.approx(2 * block_s + 0.001 + wait_s)
    # what the client measured there replaces the figure, the wait is added all the same
    manager.observed_steps.note("W", 0.002, now)
    assert pace_of(manager, w, now).decode_s(2) == pytest.approx(2 * 0.002 + 0.001 + 0.5 * 8 * 0.002)
    busy.busy_fraction = 0.0  # idle: a step there waits for nothing
    manager.observed_steps = ObservedSteps()
    verdict = _judge(manager, a, 0.04, 100, 10, 0, now)
    assert verdict is not None and verdict.other_s == pytest.approx(2 * block_s + 0.001)


def test_judge_prices_a_long_step_at_what_the_server_delivered_on_long_steps():
    """Before a 40-token prompt: a server seen at 0.05 s a token on long steps (decode steps as fast as the other's)
    loses the step to one whose prefill is expected 20x faster, replay included; not where the prompt is short
    enough that the move costs more, nor where the other delivered long steps as slowly (observed, not announced),
    nor where the other's decode steps are so much slower that the session's rest loses more than the prompt saves."""
    servers = {"L": FakeServer(0, 4, inference_rps=1e6), "H": _prefilling(FakeServer(0, 4, inference_rps=1e6))}
    manager = _manager(servers)
    span = next(s for s in manager.spans if s.peer_id == "L")
    now = time.monotonic()
    verdict = _judge(manager, span, 0.005, 10, 20, 0, now, tokens=100, token_s=0.05)
    assert verdict is not None and [h.peer_id for h in verdict.route] == ["H"]
    h_token_s = ANNOUNCED_DISCOUNT * 4 / PREFILL_RPS  # H's prefill figure, discounted
    assert verdict.delivered_s == pytest.approx(100 * 0.05)
    assert verdict.other_s == pytest.approx(0.001 + 100 * h_token_s)
    assert _judge(manager, span, 0.005, 10, 20, 0, now, tokens=20, token_s=0.05) is None  # 1 s saved < 2 x 1 s
    assert _judge(manager, span, 0.005, 10, 20, 0, now, tokens=100) is None  # its long steps: its word only
    assert _judge(manager, span, 0.005, 500, 20, 0, now, tokens=100, token_s=0.05) is not None
    manager.observed_steps.note("H", 0.5 / 4, now)  # H's decode steps seen at 0.5 s: 256 of them cost far more
    assert _judge(manager, span, 0.005, 500, 20, 0, now, tokens=100, token_s=0.05) is None
    manager.observed_steps.note("H", 0.001, now)
    manager.observed_steps.note_long("H", 0.04 / 4, now)  # H seen at 0.04 s a token on long steps: within 2x
    assert _judge(manager, span, 0.005, 10, 20, 0, now, tokens=100, token_s=0.05) is None


def test_pace_of_a_server_prefers_what_the_client_measured():
    """A server's pace: the span's own clock, else what this client measured there (without the RTT: decision 0196)
    plus the RTT, else its record's figures discounted plus the RTT; no prefill figure: its decode step a token."""
    manager = _manager({"B": _prefilling(FakeServer(0, 4)), "C": FakeServer(0, 4)})
    b = next(s for s in manager.spans if s.peer_id == "B")
    c = next(s for s in manager.spans if s.peer_id == "C")
    now = time.monotonic()
    pace = pace_of(manager, b, now)
    assert pace.decode_s(4) == pytest.approx(0.001 + 4 * ANNOUNCED_DISCOUNT / 100.0)
    assert pace.long_s(4, 10) == pytest.approx(0.001 + 10 * 4 * ANNOUNCED_DISCOUNT / PREFILL_RPS)
    assert pace_of(manager, c, now).token_block_s == pytest.approx(ANNOUNCED_DISCOUNT / 100.0)
    manager.observed_steps.note("B", 0.01, now)
    manager.observed_steps.note_long("B", 0.002, now)
    pace = pace_of(manager, b, now)
    assert (pace.decode_s(4), pace.long_s(4, 10)) == (pytest.approx(0.04 + 0.001), pytest.approx(0.08))
    pace = pace_of(manager, b, now, step_s=0.2, token_s=0.1)
    assert (pace.decode_s(4), pace.long_s(4, 10)) == (pytest.approx(0.2), pytest.approx(1.0))
    work = Workload(0, 5, 10, 2_000_000)
    assert pace.replay_s(4, work) == pytest.approx(10 * 0.1 + 4.0)  # its positions and the bytes both ways


def test_observed_steps_price_only_servers_slower_than_their_discounted_figure(monkeypatch: pytest.MonkeyPatch):
    table = ObservedSteps()
    fast, slow, none = _span("F", 100.0), _span("S", 1e6), _span("N", None)
    table.note("F", 3.0 / 100, 0.0)  # 3x its figure: within the discount, its price stands
    table.note("S", 0.25, 0.0)
    table.note("N", 0.1, 0.0)
    table.note("bad", float("nan"), 0.0)
    priced = {s.peer_id: s.server_info.inference_rps for s in table.priced([fast, slow, none], 1.0)}
    assert priced == {"F": 100.0, "S": pytest.approx(ANNOUNCED_DISCOUNT / 0.25), "N": pytest.approx(40.0)}
    assert table.block_s("bad", 0.0) is None
    assert slow.server_info.inference_rps == 1e6  # the view's records are not changed
    later = observed_steps.OBSERVED_TTL_S + 1.0
    assert table.block_s("S", later) is None and table.priced([slow], later)[0].server_info.inference_rps == 1e6
    monkeypatch.setattr(observed_steps, "OBSERVED_MAX_PEERS", 2)
    table.note("X", 0.1, 2.0)
    assert table.block_s("S", 2.0) is None and table.block_s("N", 2.0) is None  # the slowest, then the oldest
    assert table.block_s("F", 2.0) == 3.0 / 100 and table.block_s("X", 2.0) == 0.1  # (decision 0231)


def test_observed_steps_price_a_long_steps_route_by_the_long_steps_seen():
    """For a route whose first step is long, a server seen delivering long steps slower than `ANNOUNCED_DISCOUNT` x
    its announced long step is priced that many times under its figure (the lower of its two prices); within the
    discount, for a decode step's route, or past `OBSERVED_TTL_S`, its price stands."""
    table = ObservedSteps()
    crawl, honest, both = _span("C", 1e6), _span("H", 100.0), _span("B", 1e6)
    table.note_long("C", 1e-3, 0.0)  # 250x its discounted figure: 4 x 1e-6 s a token a block (no prefill figure)
    table.note_long("H", 3.0 / 100, 0.0)  # 3x: within the discount
    table.note("B", 0.25, 0.0)  # decode steps priced at 16 blocks/s ...
    table.note_long("B", 8e-6, 0.0)  # ... and long steps 2x under the discount: half that
    priced = {s.peer_id: s.server_info.inference_rps for s in table.priced([crawl, honest, both], 1.0, 9)}
    assert priced == {"C": pytest.approx(4e3), "H": 100.0, "B": pytest.approx(8.0)}
    decode = {s.peer_id: s.server_info.inference_rps for s in table.priced([crawl, honest, both], 1.0, 8)}
    assert decode == {"C": 1e6, "H": 100.0, "B": pytest.approx(16.0)}
    later = observed_steps.OBSERVED_TTL_S + 1.0
    assert table.priced([crawl], later, 40)[0].server_info.inference_rps == 1e6


def test_a_server_a_session_moves_to_is_no_candidate_until_measured_again():
    """A session's move marks its target pending: other sessions' judgments skip it (its figure was taken without the
    moved session's load: they would all move onto it at once) until this client notes a newer figure there, or
    `PENDING_S` passed."""
    servers = {"A": FakeServer(0, 4, inference_rps=1e6), "B": FakeServer(0, 4, inference_rps=100.0)}
    manager = _manager(servers)
    a = next(s for s in manager.spans if s.peer_id == "A")
    table = manager.observed_steps
    assert _judge(manager, a, 0.5, 100, 10, 0, 100.0) is not None
    table.moving_to("B", 100.0)
    assert table.pending("B", 100.5) and _judge(manager, a, 0.5, 100, 10, 0, 100.5) is None
    assert not table.pending("B", 100.0 + observed_steps.PENDING_S)
    table.note("B", 0.01, 101.0)  # measured since the move
    assert not table.pending("B", 101.0) and _judge(manager, a, 0.5, 100, 10, 0, 101.0) is not None


class PatternServer(FakeServer):
    """`FakeServer` whose n-th answer comes `pattern[n % len(pattern)]` seconds late: a hostile server timing its
    steps against the client's judgment of what it delivers."""

    def __init__(self, start: int, end: int, pattern: tuple[float, ...], inference_rps: float = 1e6):
        self.pattern, self.answers = pattern, 0
        super().__init__(start, end, inference_rps=inference_rps)

    @property
    def delay_s(self) -> float:
        self.answers += 1
        return self.pattern[(self.answers - 1) % len(self.pattern)]

    @delay_s.setter
    def delay_s(self, value: float) -> None:
        pass


def _long_session(manager: FakeManager, x: torch.Tensor, max_length: int) -> tuple[InferenceSession, list[str]]:
    """One token a step over `x` [1, T, H] in a session of `max_length` (a long rest: a move pays), outputs checked
    against the reference; the session and its route at the end."""
    with InferenceSession(manager, max_length=max_length) as session:
        outputs = torch.cat([session.step(x[:, t : t + 1]) for t in range(x.shape[1])], dim=1)
        route = [s.peer_id for s, _ in session.route]
    torch.testing.assert_close(outputs, reference(x, 4))
    return session, route


def test_a_server_slow_on_fewer_than_half_of_its_steps_is_judged_by_them():
    """L answers 3 decode steps of every 8 0.5 s late (under the floor) and the rest at once: 0.19 s a token, 11x
    what H (1000 blocks/s announced: 17 ms expected) would deliver. The median of L's recent steps was its fast ones
    (on main: no move, every slow step paid, the route stays L); what it delivers counts them: the session moves."""
    torch.manual_seed(0)
    fast, slow = 0.0, FLOOR_LORIS_S
    servers: dict[str, FakeServer] = {"L": PatternServer(0, 4, (fast, slow, fast, fast, slow, fast, fast, slow))}
    servers["H"] = FakeServer(0, 4, inference_rps=1000.0)
    manager = _manager(servers)
    session, route = _long_session(manager, torch.randn(1, 16, HIDDEN), 256)
    assert _outpaced(session) == ["L"], session.stall_events
    assert route == ["H"] and not manager.bans.banned_peers()


def test_a_server_late_on_every_step_within_its_late_budget_is_judged_by_them():
    """L answers every decode step 1.2 s late: 0.2 s past its 1 s deadline, which the late budget's leak (10% of
    wall time) nearly refills, so 0144's rule would keep it for ~100 steps. Its late steps were left out of what it
    delivers (on main: never judged, the route stays L, a 'slow' event a step); they count now: it is outpaced."""
    torch.manual_seed(0)
    servers: dict[str, FakeServer] = {"L": PatternServer(0, 4, (1.2,)), "H": FakeServer(0, 4)}
    manager = _manager(servers)
    session, route = _long_session(manager, torch.randn(1, 8, HIDDEN), 256)
    assert _outpaced(session) == ["L"], session.stall_events
    assert route == ["H"] and not manager.bans.banned_peers()


class FastWhileJudged(FakeServer):
    """`FakeServer` that answers `FAST_S` late, but the step after each answer the client judges its delivery on
    (the first answer `JUDGE_PERIOD_S` after the last judged one: it can tell them apart by its own clock) `SLOW_S`
    after that judged answer: the steps before each judgment are all fast."""

    FAST_S, SLOW_S = 0.02, 0.8

    def __init__(self, start: int, end: int, inference_rps: float = 1e6):
        self.judged_at, self.after_judgment = -math.inf, False
        super().__init__(start, end, inference_rps=inference_rps)

    @property
    def delay_s(self) -> float:
        now = time.monotonic()
        delay = max(0.0, self.judged_at + self.SLOW_S - now) if self.after_judgment else self.FAST_S
        self.after_judgment = now + delay - self.judged_at >= delivery.JUDGE_PERIOD_S
        if self.after_judgment:
            self.judged_at = now + delay
        return delay

    @delay_s.setter
    def delay_s(self, value: float) -> None:
        pass


def test_a_server_slow_between_judgments_is_judged_by_every_step():
    """L answers one step a second 0.8 s late, just after the client judged its delivery, and the rest 20 ms late:
    the last 8 steps before each judgment are fast (on main their median is 20 ms, within 2x H's expected 17 ms: no
    move, the route stays L), while L delivers ~0.07 s a token. Every step of the window counts now: the session
    moves."""
    torch.manual_seed(0)
    servers: dict[str, FakeServer] = {"L": FastWhileJudged(0, 4), "H": FakeServer(0, 4, inference_rps=1000.0)}
    manager = _manager(servers)
    session, route = _long_session(manager, torch.randn(1, 60, HIDDEN), 256)
    assert _outpaced(session) == ["L"], session.stall_events
    assert route == ["H"] and not manager.bans.banned_peers()


def test_delivered_step_counts_every_step_of_its_window_but_one_hiccup():
    """`StepClock.delivered_step_s`: the mean of the decode steps answered in the last `window_s` (at least the last
    `window_steps`) less the slowest (one hiccup a window is ignored, a second one counts); late steps count as
    on-time ones do; prompts and zero-token steps never; None below `min_steps`."""
    clock = StepClock(announced_step_s=0.001)
    for t, elapsed_s in enumerate((0.01, 0.01, 3.0)):
        clock.delivered(1, elapsed_s, float(t))
    assert clock.delivered_step_s(4, 8, 8.0, 3.0) is None
    clock.delivered(1, 0.01, 3.0)
    assert clock.delivered_step_s(4, 8, 8.0, 3.0) == pytest.approx(0.01)  # the hiccup trimmed
    clock.delivered(1, 1.0, 4.0)
    assert clock.delivered_step_s(4, 8, 8.0, 4.0) == pytest.approx((0.03 + 1.0) / 4)
    clock.delivered(100, 50.0, 5.0)  # a prompt
    clock.delivered(0, 50.0, 5.0)  # a zero-token step
    for t in range(8):
        clock.delivered(1, 1.2, 5.0 + t)
    assert clock.delivered_step_s(4, 8, 8.0, 13.0) == pytest.approx(1.2)
    # 100 fast steps in the last second after a slow one: all of the window counts, not the last 8
    clock = StepClock(announced_step_s=0.001)
    clock.delivered(1, 0.9, 10.0)
    clock.delivered(1, 0.9, 10.5)
    for i in range(100):
        clock.delivered(1, 0.001, 10.5 + i / 100)
    assert clock.delivered_step_s(4, 8, 8.0, 11.5) == pytest.approx((0.9 + 0.1) / 101)
    assert clock.delivered_step_s(4, 8, 0.5, 11.5) == pytest.approx(0.001)  # (a window of the last 0.5 s)
    # per row and token: 16 rows in 0.32 s, 8 tokens of 2 rows in 0.32 s, both 0.02 s a row and token
    clock = StepClock(announced_step_s=0.001)
    for t in range(4):
        clock.delivered(1, 0.32, float(t), rows=16)
        clock.delivered(8, 0.32, float(t), rows=2)
    assert clock.delivered_step_s(4, 8, 8.0, 4.0) == pytest.approx(0.02)


@pytest.mark.parametrize(("rows", "tokens"), [(16, 1), (2, 8)], ids=["batch", "speculative"])
def test_a_heavy_session_on_honest_servers_is_not_moved(rows: int, tokens: int):
    """Two honest CPU servers of one span, each announcing 100 blocks/s (40 ms a token over 4 blocks: 0.16 s
    expected at the client) and taking ~22 ms a row-token: a session of 16 rows (or 2 rows of 8-token steps) waits
    0.35 s a step on either. On main its step was compared with the other's single-token figure (0.35 > 2 x 0.16 s):
    it moved to the other server, as slow for it, after a replay, and the server left was priced as slow for the
    client's next routes. A step is judged per row and token now: no move, nothing avoided."""
    torch.manual_seed(0)
    servers = {"A": FakeServer(0, 4), "B": FakeServer(0, 4)}
    for server in servers.values():
        server.delay_s = 0.35
    manager = _manager(servers)
    x = torch.randn(rows, 6 * tokens, HIDDEN)
    with InferenceSession(manager, max_length=256) as session:
        steps = [session.step(x[:, t : t + tokens]) for t in range(0, x.shape[1], tokens)]
    torch.testing.assert_close(torch.cat(steps, dim=1), reference(x, 4))
    assert not _outpaced(session) and not manager.avoided_peers(), session.stall_events


def test_a_clients_next_session_races_the_server_it_measured_before_fresh_identities():
    """The client's first session walks L0 and L1 (each answering a session's first request at once and every later
    one 0.25 s late) and ends on H (50 ms a step), which it measures. Then 5 fresh identities of the same kind join,
    announcing 1e6 blocks/s: the next session starts on one of them (routes price what they announce) and moves after
    one judgment; its race lets H, measured delivering what the move needs, run a round alone, and H wins (on main the
    first fresh identity's trial won and held the session the period; with the promise alone each of the 5 wins in
    turn, one judgment each: decision 0214). H then keeps the session for the period: it is held to its own trial's
    pace, not to the 1 ms the verdict expected of a fresh identity's claim (held to that, it was moved off again
    for the claims, and the session walked the fresh identities). H's trial (a session's first step, a replay) comes
    0.2 s late: a trial answered as fast as its steps, 50 ms, was a promise the client's own overhead on each decode
    step broke on a CPU-starved machine (0.23 s a step delivered under 3 CPU hogs: moved off H)."""
    torch.manual_seed(0)
    slow_s = 0.25
    servers: dict[str, FakeServer] = {f"L{i}": TrialsAtOnce(0, 4, slow_s) for i in range(2)}
    servers["H"] = SlowFirstStep(0, 4, first_delay_s=0.2, inference_rps=1000.0)
    servers["H"].delay_s = 0.05
    manager = _manager(servers)
    _, route = _long_session(manager, torch.randn(1, 80, HIDDEN), 256)  # (over a second on H: judged, measured)
    assert route == ["H"] and manager.observed_steps.block_s("H", time.monotonic()) is not None
    fresh = {f"F{i}": TrialsAtOnce(0, 4, slow_s) for i in range(5)}
    servers.update(fresh)
    manager.update()
    session, route = _long_session(manager, torch.randn(1, 64, HIDDEN), 256)
    assert route == ["H"], (route, session.stall_events)
    assert len(_outpaced(session)) == 1 and _outpaced(session)[0] in fresh, session.stall_events
    assert sum(loris.slow_answers for loris in fresh.values()) <= delivery.JUDGE_MIN_STEPS + 2


def test_the_server_a_race_moves_a_session_to_is_the_one_marked_pending():
    """L (in use) turns slow; H1 announces the best figure (the verdict's candidate) but answers a session's first step
    only once H2's answer was judged (`AnswersAfter`), H2 answers at once and wins the race. The session is on H2: H2 is the server whose figure was taken without the
    moved session's load, so H2 is no candidate for the client's other sessions until measured again (before hrev12
    only H1, where no session went, was marked; until decision 0214 both were)."""
    torch.manual_seed(0)
    servers: dict[str, FakeServer] = {"L": FakeServer(0, 4, inference_rps=1e6)}
    servers["H1"], servers["H2"] = AnswersAfter(0, 4, inference_rps=1e5), FakeServer(0, 4)
    servers["L"].delay_s, servers["H1"].delay_s = FLOOR_LORIS_S, 0.05
    manager = _manager(servers)
    servers["H1"].after = Judgements(manager).of("H2")  # type: ignore[attr-defined]
    x = torch.randn(1, 12, HIDDEN)
    with InferenceSession(manager, max_length=256) as session:
        for t in range(x.shape[1]):
            session.step(x[:, t : t + 1])
            if _outpaced(session) and session.route[0][0].peer_id != "L":
                break  # (the step after the verdict moved it)
        now = time.monotonic()
        assert [s.peer_id for s, _ in session.route] == ["H2"], session.stall_events
        assert manager.observed_steps.pending("H2", now)
        # the verdict's server, where the session did not go, stays a candidate (decision 0214: marked, it was none
        # for `PENDING_S`, and a loris that won the race against it kept the session as long)
        assert not manager.observed_steps.pending("H1", now)


class SlowFirstStep(FakeServer):
    """`FakeServer` answering each session's first request `first_delay_s` late (a replay, a race's trial), the later
    ones `delay_s` late."""

    def __init__(self, start: int, end: int, first_delay_s: float, inference_rps: float = 100.0):
        self.first_delay_s, self.steady_delay_s = first_delay_s, 0.0
        super().__init__(start, end, inference_rps=inference_rps)

    @property
    def delay_s(self) -> float:
        session_id = self.requests[-1][0]["session_id"]
        first = sum(metadata["session_id"] == session_id for metadata, _ in self.requests) == 1
        return self.first_delay_s if first else self.steady_delay_s

    @delay_s.setter
    def delay_s(self, value: float) -> None:
        self.steady_delay_s = value


class TrialsAtOnce(FakeServer):
    """`FakeServer` answering each session's first `honest_requests` requests (a race's trial, then as many more) at
    once and every later one `slow_s` late: it wins races, then crawls. `slow_answers`: how many it held so."""

    def __init__(self, start: int, end: int, slow_s: float, inference_rps: float = 1e6, honest_requests: int = 1):
        self.slow_s, self.honest_requests, self.slow_answers = slow_s, honest_requests, 0
        super().__init__(start, end, inference_rps=inference_rps)

    @property
    def delay_s(self) -> float:
        session_id = self.requests[-1][0]["session_id"]
        if sum(metadata["session_id"] == session_id for metadata, _ in self.requests) <= self.honest_requests:
            return 0.0
        self.slow_answers += 1
        return self.slow_s

    @delay_s.setter
    def delay_s(self, value: float) -> None:
        pass


def test_a_race_after_a_move_for_delivery_leaves_out_servers_seen_as_slow():
    """L0 (in use) crawls at 0.5 s a step; L1, which this client saw deliver as slowly, answers trials at once and
    crawls after; H answers in 20 ms. The move's race took L1 on main (first trial answer; the race never read what
    the client measured), which then held the session a whole `MOVE_PERIOD_S` (one move a period): two identities
    alternate so, each back once its avoidance ends. Now a race for a span left as slow leaves out servers seen
    delivering no better than the verdict allows: H takes it."""
    torch.manual_seed(0)
    servers: dict[str, FakeServer] = {"L0": FakeServer(0, 4, inference_rps=1e6), "L1": TrialsAtOnce(0, 4, 0.5)}
    servers["H"] = FakeServer(0, 4, inference_rps=1000.0)
    servers["L0"].delay_s, servers["H"].delay_s = FLOOR_LORIS_S, 0.02
    manager = _manager(servers)
    manager.observed_steps.note("L1", 0.5 / 4, time.monotonic())  # (a session of this client ran on it lately)
    x = torch.randn(1, 12, HIDDEN)
    with InferenceSession(manager, max_length=256) as session:
        outputs = torch.cat([session.step(x[:, t : t + 1]) for t in range(x.shape[1])], dim=1)
        route = [s.peer_id for s, _ in session.route]
    torch.testing.assert_close(outputs, reference(x, 4))
    assert _outpaced(session)[:1] == ["L0"], session.stall_events
    assert route == ["H"], (route, session.stall_events)
