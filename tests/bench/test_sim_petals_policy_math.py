"""Block selection and span math (reference section 4): weakest gap first, lexicographic windows with ties to the
lower start, moves only when the simulated swarm improves enough and never opening a gap, peer-independent."""

import random
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.sim.petals_policy import (
    choose_best_blocks,
    choose_best_span,
    should_choose_other_blocks,
    should_move_span,
)
from corolla.protocol.records import RemoteModuleInfo, RemoteSpanInfo, ServerInfo, ServerState
from corolla.protocol.uids import make_uid
from corolla.swarm.spans import compute_spans, compute_throughputs

ONLINE, JOINING, OFFLINE = ServerState.ONLINE, ServerState.JOINING, ServerState.OFFLINE


def swarm(num_blocks, servers, *, first_block=0, with_bounds=True, order_seed=None):
    """module_infos for `servers = [(peer, start, end, throughput[, state])]` (indices relative to first_block)."""
    infos = [RemoteModuleInfo(make_uid("m", first_block + i), {}) for i in range(num_blocks)]
    entries = list(servers)
    if order_seed is not None:
        random.Random(order_seed).shuffle(entries)
    for peer, start, end, throughput, *state in entries:
        bounds = dict(start_block=first_block + start, end_block=first_block + end) if with_bounds else {}
        info = ServerInfo(state=state[0] if state else ONLINE, throughput=float(throughput), **bounds)
        for i in range(start, end):
            infos[i].servers[peer] = info
    return infos


def test_new_server_fills_the_weakest_gap():
    assert choose_best_blocks(2, swarm(8, [("A", 0, 3, 5), ("B", 5, 8, 5)])) == [3, 4]
    assert choose_best_blocks(4, swarm(8, [("A", 0, 4, 10), ("B", 4, 8, 1)])) == [4, 5, 6, 7]
    # offline servers don't count; joining ones do
    assert choose_best_blocks(2, swarm(4, [("A", 0, 2, 9, OFFLINE), ("B", 2, 4, 9, JOINING)])) == [0, 1]


def test_ties_go_to_the_lower_start():
    assert choose_best_blocks(3, swarm(8, [])) == [0, 1, 2]
    assert choose_best_blocks(2, swarm(8, [("A", 0, 2, 1), ("B", 6, 8, 1)])) == [2, 3]


def test_windows_compare_lexicographically_on_sorted_values():
    # throughputs [1, 0, 3, 0, 0, 2]: windows of 2 sorted: (0,1) (0,3) (0,3) (0,0) (0,2) -> start 3
    infos = swarm(6, [("A", 0, 1, 1), ("B", 2, 3, 3), ("C", 5, 6, 2)])
    np.testing.assert_array_equal(
        compute_throughputs(compute_spans(infos, min_state=JOINING), total_blocks=6), [1, 0, 3, 0, 0, 2]
    )
    assert choose_best_blocks(2, infos) == [3, 4]
    # [2, 0, 0, 1]: windows (0,2) (0,0) (0,1) -> the window whose second-weakest block is weakest
    assert choose_best_blocks(2, swarm(4, [("A", 0, 1, 2), ("B", 3, 4, 1)])) == [1, 2]


def test_moves_only_when_quality_below_balance_quality():
    infos = swarm(4, [("A", 0, 2, 10), ("B", 0, 2, 10), ("C", 2, 4, 1)])
    # moving B to [2, 4) raises the bottleneck from 1 to 10: quality 0.1
    assert should_choose_other_blocks("B", infos, balance_quality=0.75)
    assert not should_choose_other_blocks("B", infos, balance_quality=0.05)
    # a balanced swarm stays put
    balanced = swarm(4, [("A", 0, 2, 10), ("B", 0, 2, 10), ("C", 2, 4, 10), ("D", 2, 4, 10)])
    assert not should_choose_other_blocks("B", balanced, balance_quality=0.75)
    assert should_choose_other_blocks("B", balanced, balance_quality=1.5)  # > 1 forces a move (debug)


def test_never_moves_if_that_opens_a_gap():
    infos = swarm(4, [("A", 0, 2, 10), ("C", 2, 4, 1)])
    assert not should_choose_other_blocks("A", infos, balance_quality=0.99)
    # a swarm that cannot be fully covered keeps a zero bottleneck: moving gains nothing
    gap = swarm(6, [("A", 0, 2, 10), ("B", 0, 2, 10)])
    assert not should_choose_other_blocks("A", gap, balance_quality=0.75)


def test_own_span_missing_is_not_a_crash():
    assert not should_choose_other_blocks("ghost", swarm(4, [("A", 0, 4, 1)]), balance_quality=0.75)


def test_deterministic_across_peers():
    servers = [(f"peer{i}", i % 5, i % 5 + 3, 0.1 * (i + 1)) for i in range(12)]
    views = [swarm(8, servers, order_seed=seed) for seed in range(5)]  # each peer sees records in another order
    sums = [compute_throughputs(compute_spans(v, min_state=JOINING), total_blocks=8) for v in views]
    for s in sums[1:]:
        assert s.tobytes() == sums[0].tobytes()  # bit-identical float sums
    assert len({tuple(choose_best_blocks(3, v)) for v in views}) == 1
    decisions = {
        should_choose_other_blocks(p, v, 0.75, rng=random.Random(seed))
        for seed, v in enumerate(views)
        for p in ("peer0",)
    }
    assert len(decisions) == 1


def test_compute_spans_semantics():
    # one surviving key rebuilds the whole span from start_block/end_block
    infos = swarm(6, [("A", 1, 5, 3)], first_block=10)
    for i in (1, 2, 4):
        infos[i].servers.clear()
    spans = compute_spans(infos, min_state=JOINING)
    assert (spans["A"].start, spans["A"].end) == (1, 5)
    # without bounds, consecutive records of the same state extend the span
    plain = compute_spans(swarm(6, [("A", 1, 4, 3)], with_bounds=False), min_state=JOINING)
    assert (plain["A"].start, plain["A"].end) == (1, 4)
    # a higher state seen later replaces the lower one
    infos = swarm(4, [], with_bounds=False)
    infos[0].servers["A"] = ServerInfo(state=JOINING, throughput=1.0)
    infos[1].servers["A"] = ServerInfo(state=ONLINE, throughput=2.0)
    infos[2].servers["A"] = ServerInfo(state=JOINING, throughput=1.0)
    span = compute_spans(infos, min_state=JOINING)["A"]
    assert (span.start, span.end, span.state, span.throughput) == (1, 2, ONLINE, 2.0)
    assert compute_spans(infos, min_state=ONLINE)["A"].start == 1
    # bounds are clipped to the requested window
    window = swarm(6, [("A", 0, 6, 1)], first_block=0)[2:4]
    span = compute_spans(window, min_state=JOINING)["A"]
    assert (span.start, span.end) == (0, 2)


def test_bad_num_blocks():
    with pytest.raises(ValueError):
        choose_best_blocks(5, swarm(4, []))


def reference_should_move(local, spans, total_blocks, balance_quality, rng):
    """Petals' `should_choose_other_blocks`, line by line in plain Python (the oracle for the faster version)."""
    eps = 1e-3
    spans = {peer: replace(span) for peer, span in spans.items()}
    throughputs = compute_throughputs(spans, total_blocks=total_blocks)
    initial = throughputs.min()

    def best_start(n):
        return min((sorted(throughputs[i : i + n].tolist()), i) for i in range(total_blocks - n + 1))[1]

    span = spans[local]
    throughputs[span.start : span.end] -= span.throughput * (1 + eps)
    if initial > eps and throughputs.min() <= 0:
        return False
    new_start = best_start(span.length)
    if span.start == new_start:
        return False
    throughputs[span.start : span.end] += span.throughput * eps
    span.start, span.end = new_start, new_start + span.length
    throughputs[span.start : span.end] += span.throughput
    while True:
        peers = sorted(spans)
        rng.shuffle(peers)
        moved = False
        for peer in peers:
            span = spans[peer]
            throughputs[span.start : span.end] -= span.throughput * (1 + eps)
            new_start = best_start(span.length)
            throughputs[span.start : span.end] += span.throughput * eps
            if span.start != new_start:
                span.start, span.end = new_start, new_start + span.length
                moved = True
            throughputs[span.start : span.end] += span.throughput
        if not moved:
            break
    new = throughputs.min()
    return bool(new >= initial and new >= eps and initial / new < balance_quality - eps)


@pytest.mark.parametrize("seed", range(16))
def test_fast_rebalancing_check_decides_as_the_reference(seed):
    rng = random.Random(seed)
    total = rng.choice([8, 24, 80])
    kinds = [rng.choice([1.0, 2.0, 5.0, 13.5]) for _ in range(3)]  # repeated throughputs make tied windows
    spans = {}
    for i in range(rng.randint(2, 40)):
        length = rng.randint(1, total // 2)
        start = rng.randint(0, total - length)
        spans[f"p{i:02d}"] = RemoteSpanInfo(
            f"p{i:02d}", start, start + length, ServerInfo(state=ONLINE, throughput=rng.choice(kinds))
        )
    for peer in list(spans)[:5]:
        for quality in (0.3, 0.75, 0.95):
            expected = reference_should_move(peer, spans, total, quality, random.Random(seed))
            got = should_move_span(peer, spans, total_blocks=total, balance_quality=quality, rng=random.Random(seed))
            assert got == expected, (peer, quality)
    throughputs = compute_throughputs(spans, total_blocks=total)
    for length in range(1, total + 1):
        want = min((sorted(throughputs[i : i + length].tolist()), i) for i in range(total - length + 1))[1]
        assert choose_best_span(length, spans, total_blocks=total).start == want
