"""The swarm policy seam: PetalsPolicy is the reference's exact math behind it; CorollaPolicy raises the swarm's
bottleneck (span length and position), moves only when the gain pays back the reload and never cycles, and routes
by load, spreading clients over near-equal chains."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from benchmarks.sim.petals_policy import PetalsPolicy, choose_best_blocks, should_choose_other_blocks
from benchmarks.sim.policies import make_policy
from corolla.protocol.records import RemoteModuleInfo, RemoteSpanInfo, ServerInfo, ServerState
from corolla.protocol.uids import make_uid
from corolla.swarm.corolla_policy import CorollaPolicy, estimated_rtt_s, loaded_block_time_s
from corolla.swarm.policy import ServerCapacity
from corolla.swarm.route_planning import make_min_latency_route
from corolla.swarm.spans import compute_spans, compute_throughputs


def span(peer: str, start: int, end: int, throughput: float = 1.0, **info) -> RemoteSpanInfo:
    info.setdefault("state", ServerState.ONLINE)
    server = ServerInfo(throughput=float(throughput), start_block=start, end_block=end, **info)
    return RemoteSpanInfo(peer, start, end, server)


def module_infos(spans: list[RemoteSpanInfo], total_blocks: int) -> list[RemoteModuleInfo]:
    infos = [RemoteModuleInfo(make_uid("m", i), {}) for i in range(total_blocks)]
    for s in spans:
        for i in range(s.start, s.end):
            infos[i].servers[s.peer_id] = s.server_info
    return infos


def bottleneck(spans: list[RemoteSpanInfo], total_blocks: int) -> float:
    return float(compute_throughputs({s.peer_id: s for s in spans}, total_blocks=total_blocks).min())


def test_make_policy_by_name():
    assert isinstance(make_policy("petals"), PetalsPolicy)
    assert isinstance(make_policy("corolla"), CorollaPolicy)
    with pytest.raises(ValueError, match="swarm policy"):
        make_policy("central")


# ---- PetalsPolicy: the reference's math, unchanged


@pytest.mark.parametrize("seed", range(6))
def test_petals_policy_is_the_reference_math(seed):
    rng = random.Random(seed)
    total = 12
    spans = []
    for i in range(rng.randint(1, 7)):
        start = rng.randrange(total)
        spans.append(span(f"P{i}", start, min(total, start + rng.randint(1, 6)), rng.choice([1, 2, 5, 9])))
    me = ServerCapacity(peer_id="me", max_blocks=4, throughput=3.0)
    policy = PetalsPolicy()
    assert list(policy.choose_span(me, spans, total)) == choose_best_blocks(4, module_infos(spans, total))
    mover = spans[0].peer_id
    decision = policy.choose_move(
        ServerCapacity(peer_id=mover, max_blocks=spans[0].length, throughput=spans[0].throughput), spans, total,
        reload_s=10.0, since_move_s=0.0, rng=random.Random(1),
    )  # fmt: skip
    expected = should_choose_other_blocks(mover, module_infos(spans, total), 0.75, rng=random.Random(1))
    assert decision.move == expected
    rtts = {s.peer_id: rng.uniform(0.001, 0.1) for s in spans}
    spans.append(span("full", 0, total, 1.0))
    route = policy.choose_route(spans, 0, total, mode="min_latency", client_rtts_s=rtts, rng=random.Random(0))
    assert route == make_min_latency_route(spans, 0, total, client_rtts_s=rtts)


def test_petals_policy_move_target_is_the_weakest_window_without_itself():
    spans = [span("A", 0, 2, 10), span("B", 0, 2, 10), span("C", 2, 4, 1)]
    me = ServerCapacity(peer_id="B", max_blocks=2, throughput=10.0)
    decision = PetalsPolicy().choose_move(me, spans, 4, reload_s=600.0, since_move_s=0.0, rng=random.Random(0))
    assert decision.target == range(2, 4) and decision.flow_now_tps == 1 and decision.flow_after_tps == 10
    # the reference ignores the reload; with balance_quality 0 it never moves
    assert (
        not PetalsPolicy(balance_quality=0.0)
        .choose_move(me, spans, 4, reload_s=0.0, since_move_s=0.0, rng=random.Random(0))
        .move
    )


# ---- CorollaPolicy placement


def test_corolla_places_like_petals_on_an_empty_or_uniform_swarm():
    me = ServerCapacity(peer_id="me", max_blocks=4, throughput=2.0)
    assert CorollaPolicy().choose_span(me, [], 10) == range(0, 4)
    assert CorollaPolicy().choose_span(me, [span("A", 0, 4, 5)], 10) == range(4, 8)
    # its own (stale) record is ignored
    assert CorollaPolicy().choose_span(me, [span("me", 0, 4, 5)], 10) == range(0, 4)


def test_corolla_holds_fewer_blocks_where_that_raises_the_bottleneck():
    # blocks 0..7 carry 10 tok/s except 4 and 5 (2 tok/s). A server of 8 blocks at 1.8 tok/s covers them all but
    # adds 1.8 to the bottleneck; holding 2 blocks it does 1.8 * 9 / 3 = 5.4 tok/s there.
    spans = [span("A", 0, 4, 10), span("B", 6, 8, 10), span("C", 4, 6, 2), span("D", 4, 6, 0.0)]
    spans[-1] = span("D", 6, 8, 0.0)
    me = ServerCapacity(peer_id="me", max_blocks=8, throughput=1.8)
    petals = PetalsPolicy().choose_span(me, spans, 8)
    corolla = CorollaPolicy().choose_span(me, spans, 8)
    assert petals == range(0, 8) and corolla == range(4, 6)
    with_petals = spans + [span("me", petals.start, petals.stop, me.throughput_for(len(petals)))]
    with_corolla = spans + [span("me", corolla.start, corolla.stop, me.throughput_for(len(corolla)))]
    assert bottleneck(with_corolla, 8) == pytest.approx(7.4)
    assert bottleneck(with_petals, 8) == pytest.approx(3.8)


def test_corolla_keeps_the_longer_span_unless_shorter_gains_enough():
    # a uniform gap: every length covering it gives the same bottleneck -> the longest (fewest hops) wins
    spans = [span("A", 0, 8, 5.0)]
    me = ServerCapacity(peer_id="me", max_blocks=4, throughput=1.0)
    chosen = CorollaPolicy().choose_span(me, spans, 8)
    assert len(chosen) == 4


def test_throughput_for_follows_petals_model_and_network_cap():
    me = ServerCapacity(peer_id="me", max_blocks=7, throughput=2.0, network_rps=5.0)
    assert me.throughput_for(7) == 2.0
    assert me.throughput_for(3) == pytest.approx(4.0)
    assert me.throughput_for(1) == 5.0  # 8.0 capped by the link


def test_corolla_prefers_the_position_its_region_lacks():
    # the swarm as a whole is balanced, but the near servers (RTT <= 30 ms) lack blocks 4..7
    spans = [span("near", 0, 4, 5), span("far1", 0, 4, 5), span("far2", 4, 8, 10)]
    me = ServerCapacity(peer_id="me", max_blocks=4, throughput=5.0, rtts_s={"near": 0.005, "far1": 0.2, "far2": 0.2})
    assert CorollaPolicy().choose_span(me, spans, 8) == range(4, 8)
    me_elsewhere = ServerCapacity(peer_id="me", max_blocks=4, throughput=5.0, rtts_s={"far2": 0.005})
    assert CorollaPolicy().choose_span(me_elsewhere, spans, 8) == range(0, 4)


def test_corolla_completes_its_regions_chains_first():
    # the swarm as a whole covers every block twice, but the near servers (RTT <= 30 ms) only blocks 0..3: a joiner
    # there takes 4..7, where the whole swarm is as strong as at 0..3 (Petals' rule alone would pick either)
    spans = [span("near", 0, 4, 5), span("far1", 0, 4, 5), span("far2", 4, 8, 5), span("far3", 4, 8, 5)]
    rtts = {"near": 0.005, "far1": 0.2, "far2": 0.2, "far3": 0.2}
    me = ServerCapacity(peer_id="me", max_blocks=4, throughput=5.0, rtts_s=rtts)
    assert CorollaPolicy().choose_span(me, spans, 8) == range(4, 8)
    # a server whose region holds 4..7 twice and 0..3 not at all moves to complete it (the swarm's bottleneck
    # stays 5 tok/s: Petals' check sees nothing to gain), but never by opening a gap in the swarm
    spans = [span("near", 0, 4, 5), span("far1", 4, 8, 5), span("far2", 4, 8, 5)]
    me = ServerCapacity(peer_id="far2", max_blocks=4, throughput=5.0, rtts_s={"near": 0.2, "far1": 0.005})
    decision = CorollaPolicy().choose_move(me, spans, 8, reload_s=10.0, since_move_s=1e6, rng=random.Random(0))
    assert decision.target == range(0, 4) and (decision.flow_now_tps, decision.flow_after_tps) == (0.0, 5.0)
    petals = PetalsPolicy().choose_move(me, spans, 8, reload_s=10.0, since_move_s=1e6, rng=random.Random(0))
    assert not petals.move
    alone = [span("near", 0, 4, 5), span("far2", 4, 8, 5)]
    decision = CorollaPolicy().choose_move(me, alone, 8, reload_s=10.0, since_move_s=1e6, rng=random.Random(0))
    assert decision.reason == "leaving would open a gap"


def move(policy, spans, peer, *, reload_s=10.0, since_move_s=1e6, max_blocks=None):
    mine = next(s for s in spans if s.peer_id == peer)
    me = ServerCapacity(peer_id=peer, max_blocks=max_blocks or mine.length, throughput=mine.throughput)
    return policy.choose_move(me, spans, 8, reload_s=reload_s, since_move_s=since_move_s, rng=random.Random(0))


def test_corolla_moves_when_the_gain_pays_back_the_reload():
    spans = [span("A", 0, 4, 10), span("B", 0, 4, 10), span("C", 4, 8, 1)]
    decision = move(CorollaPolicy(), spans, "B")
    assert decision.target == range(4, 8) and decision.flow_after_tps == 10 and decision.flow_now_tps == 1
    # B leaving [0, 4) costs nothing (C stays the bottleneck): the reload is free, however long
    assert move(CorollaPolicy(payback_s=60.0), spans, "B", reload_s=1e5).move
    # B holds all 8 blocks at 1 tok/s; on [4, 8) alone it does 1.8 tok/s: the bottleneck goes 2 -> 2.8, but while it
    # reloads the swarm drops to 1 tok/s: worth it for a 10 s reload, not for a 100 s one within a 60 s payback
    spans = [span("A", 0, 4, 10), span("C", 4, 8, 1), span("B", 0, 8, 1)]
    decision = move(CorollaPolicy(payback_s=60.0), spans, "B", reload_s=10.0)
    assert decision.target == range(4, 8) and decision.flow_after_tps == pytest.approx(2.8)
    assert move(CorollaPolicy(payback_s=60.0), spans, "B", reload_s=100.0).reason.startswith("reload costs more")
    # too soon after its last move
    assert move(CorollaPolicy(), spans, "B", since_move_s=1.0).reason.startswith("dwelling")
    # ... unless some block has no server: then filling the gap cannot wait
    gap = [span("A", 0, 4, 10), span("B", 0, 4, 10)]
    assert move(CorollaPolicy(), gap, "B", since_move_s=1.0).target == range(4, 8)


def test_corolla_moves_only_on_a_region_it_measured_in_full():
    """A server that has not measured every server announced may be missing part of its region (the unmeasured B
    here): its region's flows are unknown, so it moves only to fill a block the whole swarm lacks (decision 0025).
    On the old code it weighed {A, C, itself} as its region and moved to 4..8."""
    spans = [span("A", 0, 4, 10), span("me", 0, 4, 10), span("B", 4, 8, 10), span("C", 4, 8, 1)]

    def decide(rtts_s, swarm=spans):
        me = ServerCapacity(peer_id="me", max_blocks=4, throughput=10.0, rtts_s=rtts_s)
        return CorollaPolicy().choose_move(me, swarm, 8, reload_s=60.0, since_move_s=1e6, rng=random.Random(0))

    decision = decide({"A": 0.004, "C": 0.004})
    assert not decision.move and decision.reason == "its region not yet measured in full"
    # B measured far: the region {A, C, me} lacks throughput on 4..8, and it moves there
    assert decide({"A": 0.004, "C": 0.004, "B": 0.2}).target == range(4, 8)
    # a block no server holds is filled at once, by the whole swarm's flows
    gap = [span("A", 0, 4, 10), span("me", 0, 4, 10), span("B", 0, 4, 10)]
    assert decide({"A": 0.004}, gap).target == range(4, 8)


def test_corolla_never_opens_a_gap_and_ignores_small_gains():
    spans = [span("A", 0, 4, 10), span("C", 4, 8, 1)]
    assert move(CorollaPolicy(), spans, "A").reason == "leaving would open a gap"
    # moving B would raise the bottleneck from 10 to 10.5 only: below the 10% hysteresis
    spans = [span("A", 0, 4, 10), span("B", 0, 4, 1), span("C", 4, 8, 10), span("D", 4, 8, 0.5)]
    assert not move(CorollaPolicy(), spans, "B").move


@pytest.mark.parametrize("seed", range(5))
def test_corolla_moves_never_cycle(seed):
    """Every server checks in random order, again and again, on a static swarm: the moves stop (each one raises the
    bottleneck by at least min_gain of the bottleneck or of the mover's throughput) and the bottleneck never falls."""
    rng = random.Random(seed)
    spans = []
    for i in range(8):
        start = rng.randrange(6)
        spans.append(span(f"S{i}", start, start + 2, rng.choice([1.0, 2.0, 4.0, 8.0])))
    policy = CorollaPolicy()
    flows, moves = [bottleneck(spans, 8)], 0
    for _ in range(30):
        for peer in rng.sample([s.peer_id for s in spans], len(spans)):
            decision = move(policy, spans, peer)
            if decision.move:
                old = next(s for s in spans if s.peer_id == peer)
                me = ServerCapacity(peer_id=peer, max_blocks=2, throughput=old.throughput)
                spans = [s for s in spans if s.peer_id != peer]
                spans.append(
                    span(peer, decision.target.start, decision.target.stop, me.throughput_for(len(decision.target)))
                )
                moves += 1
                flows.append(bottleneck(spans, 8))
                floor = policy.min_gain * min(flows[-2], me.throughput_for(len(decision.target)))
                assert flows[-1] - flows[-2] >= floor - 1e-9
    assert moves <= 20
    assert all(not move(policy, spans, s.peer_id).move for s in spans)  # a fixed point


# ---- CorollaPolicy routing


def two_chains(**b_info):
    # A and B both cover everything equally fast; the client is as close to each
    return [span("A", 0, 4, 100.0, inference_rps=100.0), span("B", 0, 4, 100.0, inference_rps=100.0, **b_info)]


def test_corolla_routes_spread_over_near_equal_chains():
    spans = two_chains()
    rtts = {"A": 0.01, "B": 0.01}
    rng = random.Random(0)
    picks = Counter(
        CorollaPolicy().choose_route(spans, 0, 4, mode="min_latency", client_rtts_s=rtts, rng=rng)[0].peer_id
        for _ in range(200)
    )
    assert 60 <= picks["A"] <= 140, picks
    petals = {PetalsPolicy().choose_route(spans, 0, 4, mode="min_latency", client_rtts_s=rtts, rng=rng)[0].peer_id
              for _ in range(20)}  # fmt: skip
    assert len(petals) == 1  # Petals: every client with the same view takes the same chain


def test_corolla_routes_away_from_announced_and_client_load():
    rtts = {"A": 0.01, "B": 0.01}
    rng = random.Random(0)
    loaded = two_chains(sessions_active=20)
    picks = Counter(
        CorollaPolicy().choose_route(loaded, 0, 4, mode="min_latency", client_rtts_s=rtts, rng=rng)[0].peer_id
        for _ in range(100)
    )
    assert picks["A"] >= 95, picks
    picks = Counter(
        CorollaPolicy()
        .choose_route(two_chains(), 0, 4, mode="min_latency", client_rtts_s=rtts, client_load={"A": 20.0}, rng=rng)[0]
        .peer_id
        for _ in range(100)
    )
    assert picks["B"] >= 95, picks


def test_corolla_routes_by_announced_room_less_its_own_routes_there():
    """Petals only avoids a server announcing less cache than the session needs; corolla also prefers the server
    with room for more sessions (clients reading the same records race for the last places) and counts its own
    routes there as taken."""
    rtts = {"A": 0.01, "B": 0.01}
    rng = random.Random(0)
    per_session = 2 * 100 * 4  # K and V of 100 tokens in each of 4 blocks
    spans = [
        span("A", 0, 4, 100.0, inference_rps=100.0, cache_tokens_left=int(1.2 * per_session)),
        span("B", 0, 4, 100.0, inference_rps=100.0, cache_tokens_left=20 * per_session),
    ]

    def picks(policy, client_load=None):
        return Counter(
            policy.choose_route(spans, 0, 4, mode="min_latency", client_rtts_s=rtts, cache_tokens_needed=100,
                                client_load=client_load, rng=rng)[0].peer_id
            for _ in range(100)
        )  # fmt: skip

    assert picks(CorollaPolicy())["B"] >= 95
    assert picks(CorollaPolicy(), {"B": 19.5})["A"] >= 95  # its own sessions filled B's announced room
    assert len(picks(PetalsPolicy())) == 1  # both have room for one: Petals takes the same chain every time


def test_corolla_routes_within_the_clients_region_when_pings_are_unknown():
    # A1, A2, A3 near the client; B2 far, but the one server A1 happened to ping (100 ms). Petals assumes 300 ms for
    # every switch nobody announced and takes the far B2; corolla bounds an unknown switch by the client's RTTs to
    # both servers (the triangle inequality) and stays near
    spans = [span("A1", 0, 2, 10.0, inference_rps=100.0, next_pings={"B2": 0.1}),
             span("A2", 2, 4, 10.0, inference_rps=100.0), span("B2", 2, 4, 10.0, inference_rps=100.0),
             span("A3", 4, 6, 10.0, inference_rps=100.0)]  # fmt: skip
    rtts = {"A1": 0.01, "A2": 0.01, "A3": 0.01, "B2": 0.2}
    petals = PetalsPolicy().choose_route(spans, 0, 6, mode="min_latency", client_rtts_s=rtts, rng=random.Random(0))
    assert [s.peer_id for s in petals] == ["A1", "B2", "A3"]
    route = CorollaPolicy(route_jitter=0.0).choose_route(
        spans, 0, 6, mode="min_latency", client_rtts_s=rtts, rng=random.Random(0)
    )
    assert [s.peer_id for s in route] == ["A1", "A2", "A3"]
    assert estimated_rtt_s(spans[1], spans[3], rtts) == pytest.approx(0.02)
    assert estimated_rtt_s(spans[0], spans[2], rtts) == 0.1  # what a server measured wins
    assert estimated_rtt_s(spans[1], spans[3], {}) is None


def test_corolla_waits_for_a_chain_in_the_clients_region_before_it_leaves_it():
    """Near first (decision 0030): the client's region (A1, A2 within `region_rtt_s`) covers every block but is out
    of cache; a far chain (B1, B2) has room. Until the session has waited `near_patience_s` corolla keeps to its
    region (the refusal then makes it wait for room there) instead of spilling into the other region, whose own
    clients need that cache and where every token pays the inter-region RTT; then it takes the far chain. A region
    that lacks a block routes over the whole swarm at once; one with room leaves for speed as before. Petals takes
    the far chain at once."""
    per_session = 2 * 100 * 2  # K and V of 100 tokens in each of 2 blocks
    spans = [span("A1", 0, 2, 10.0, inference_rps=100.0, cache_tokens_left=0),
             span("A2", 2, 4, 10.0, inference_rps=100.0, cache_tokens_left=0),
             span("B1", 0, 2, 10.0, inference_rps=100.0, cache_tokens_left=50 * per_session),
             span("B2", 2, 4, 10.0, inference_rps=100.0, cache_tokens_left=50 * per_session)]  # fmt: skip
    rtts = {"A1": 0.01, "A2": 0.01, "B1": 0.15, "B2": 0.15}
    policy = CorollaPolicy(route_jitter=0.0)

    def route(spans, waited_s, policy=policy):
        chain = policy.choose_route(spans, 0, 4, mode="min_latency", client_rtts_s=rtts, cache_tokens_needed=100,
                                    waited_s=waited_s, rng=random.Random(0))  # fmt: skip
        return [s.peer_id for s in chain]

    assert route(spans, 0.0) == route(spans, policy.near_patience_s - 1) == ["A1", "A2"]
    assert route(spans, policy.near_patience_s) == ["B1", "B2"]
    assert route(spans, 0.0, PetalsPolicy()) == ["B1", "B2"]
    assert route([s for s in spans if s.peer_id != "A2"], 0.0) == ["B1", "B2"]  # its region lacks blocks 2..3
    assert route(spans[2:] + spans[:1], 0.0) == ["B1", "B2"]
    # with room in its region, a chain leaves it where that is faster (here A2 is 100x slower), as before
    roomy = [span("A1", 0, 2, 10.0, inference_rps=100.0, cache_tokens_left=50 * per_session),
             span("A2", 2, 4, 10.0, inference_rps=1.0, cache_tokens_left=50 * per_session), spans[3]]  # fmt: skip
    assert route(roomy, 0.0) == ["A1", "B2"]


def test_loaded_block_time_is_capacity_share_once_saturated():
    s = span("A", 0, 3, 50.0, inference_rps=1000.0)  # 50 tok/s over 3 blocks: 100 token-blocks/s
    assert loaded_block_time_s(s) == pytest.approx(0.01)  # (0 + 1) / 100 > 1 / 1000
    assert loaded_block_time_s(s, 4.0) == pytest.approx(0.05)
    s = span("B", 0, 3, 50.0, inference_rps=10.0, sessions_active=1)
    assert loaded_block_time_s(s) == pytest.approx(0.1)  # alone it is slower than its share


def test_corolla_route_still_covers_and_names_missing_blocks():
    from corolla.utils.errors import MissingBlocksError

    rng = random.Random(0)
    spans = [span("A", 0, 2, 5.0), span("B", 2, 5, 5.0), span("C", 1, 5, 1.0)]
    for _ in range(20):
        route = CorollaPolicy().choose_route(spans, 0, 5, mode="min_latency", client_rtts_s={}, rng=rng)
        assert route[0].start == 0 and route[-1].end == 5
        assert all(a.end == b.start for a, b in zip(route, route[1:], strict=False))
    with pytest.raises(MissingBlocksError):
        CorollaPolicy().choose_route([span("A", 0, 2)], 0, 5, mode="min_latency", client_rtts_s={}, rng=rng)
    forward = CorollaPolicy().choose_route(spans, 0, 5, mode="max_throughput", client_rtts_s={}, rng=rng)
    assert forward[0].start == 0 and forward[-1].end == 5


def test_policies_take_spans_from_compute_spans():
    """The server hands policies what `compute_spans` rebuilds from DHT records."""
    spans = [span("A", 0, 4, 10), span("B", 4, 8, 1)]
    rebuilt = list(compute_spans(module_infos(spans, 8), min_state=ServerState.JOINING).values())
    me = ServerCapacity(peer_id="me", max_blocks=4, throughput=3.0)
    for policy in (PetalsPolicy(), CorollaPolicy()):
        assert policy.choose_span(me, rebuilt, 8) == policy.choose_span(me, spans, 8) == range(4, 8)


def test_corolla_small_server_in_a_big_swarm_still_moves_to_the_bottleneck():
    # the bottleneck (blocks 4..7) is 100 tok/s; a 5 tok/s server idling in the surplus adds 5% there: less than 10%
    # of the bottleneck, but all of its own throughput, so it moves
    spans = [span("A", 0, 4, 100), span("B", 4, 8, 100), span("C", 0, 4, 50), span("M", 0, 4, 5)]
    decision = move(CorollaPolicy(), spans, "M")
    assert decision.target == range(4, 8) and decision.flow_after_tps == 105


def cached(peer: str, start: int, end: int, throughput: float, free_per_block: float) -> RemoteSpanInfo:
    """A span announcing `free_per_block` K-or-V slots of free cache on each of its blocks (Petals' unit)."""
    return span(peer, start, end, throughput, cache_tokens_left=round(free_per_block * (end - start)))


def test_corolla_places_where_the_free_cache_is_least():
    # the same throughput everywhere; blocks 5..9 have room for few sessions: a joiner that knows its cache covers
    # them (Petals' rule, and corolla without cache figures, take the lower start)
    spans = [cached("A", 0, 5, 10, 1000), cached("B", 5, 10, 10, 20)]
    me = ServerCapacity(peer_id="me", max_blocks=5, throughput=10.0, cache_tokens_per_block=(900.0,) * 5)
    assert CorollaPolicy().choose_span(me, spans, 10) == range(5, 10)
    assert PetalsPolicy().choose_span(me, spans, 10) == range(0, 5)
    assert CorollaPolicy().choose_span(ServerCapacity(peer_id="me", max_blocks=5, throughput=10.0), spans, 10) == (
        range(0, 5)
    )
    # a span that announces no free cache (an old Petals server) leaves placement to throughput alone
    no_figure = [cached("A", 0, 5, 10, 1000), span("B", 5, 10, 10)]
    assert CorollaPolicy().choose_span(me, no_figure, 10) == range(0, 5)
    # throughput still counts: a weaker throughput on 0..4 outweighs the cache there
    spans = [cached("A", 0, 5, 1, 1000), cached("B", 5, 10, 10, 800)]
    assert CorollaPolicy().choose_span(me, spans, 10) == range(0, 5)


def test_corolla_moves_its_cache_to_the_blocks_that_lack_it_and_stays_there():
    # A and "me" serve 0..4, B 5..9, all at 10 tok/s: the throughput bottleneck (10 at 5..9) is the same wherever
    # "me" is, but 5..9 have room for almost no session while 0..4 keep plenty without "me"
    me = ServerCapacity(peer_id="me", max_blocks=5, throughput=10.0, cache_tokens_per_block=(1000.0,) * 5)
    spans = [cached("A", 0, 5, 10, 1000), cached("B", 5, 10, 10, 10), cached("me", 0, 5, 10, 900)]
    decision = CorollaPolicy().choose_move(me, spans, 10, reload_s=60.0, since_move_s=1e6, rng=random.Random(0))
    assert decision.target == range(5, 10) and decision.reason == "raises the region's least free cache"
    assert decision.flow_after_tps >= decision.flow_now_tps
    assert not PetalsPolicy().choose_move(me, spans, 10, reload_s=60.0, since_move_s=1e6, rng=random.Random(0)).move
    # once there (its cache now free), leaving would empty 5..9 again: it stays
    after = [cached("A", 0, 5, 10, 1000), cached("B", 5, 10, 10, 10), cached("me", 5, 10, 10, 1000)]
    decision = CorollaPolicy().choose_move(me, after, 10, reload_s=60.0, since_move_s=1e6, rng=random.Random(0))
    assert not decision.move
    # a move for cache never lowers the throughput bottleneck: with "me" the only server of 0..4 beside a weak A,
    # it stays though 5..9 lack cache
    weak = [cached("A", 0, 5, 1, 1000), cached("B", 5, 10, 10, 10), cached("me", 0, 5, 10, 900)]
    decision = CorollaPolicy().choose_move(me, weak, 10, reload_s=60.0, since_move_s=1e6, rng=random.Random(0))
    assert not decision.move
