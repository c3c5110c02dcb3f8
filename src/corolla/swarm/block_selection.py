"""Block selection and rebalancing, pure functions with the reference's exact math (section 4): cover the weakest
window (lexicographic on sorted window throughputs, ties to the lower start), and move only if a simulated
re-convergence of the whole swarm improves its bottleneck throughput by more than `balance_quality` allows. The
same decisions as the reference, computed faster: windows compared in numpy, and no re-convergence when no
placement at all could reach the threshold."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from corolla.protocol.records import RemoteModuleInfo, RemoteSpanInfo, ServerState
from corolla.swarm.spans import compute_spans
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

EPS = 1e-3  # the current position wins ties (reduces oscillation between equally good spans)
BOUND_SLACK = 1e-9  # relative float drift the re-convergence's in-place sums may add to a block's throughput
_MAX_CONVERGENCE_PASSES = 1000  # the eps trick converges far sooner; this only bounds pathological inputs


def compute_throughputs(spans: Mapping[str, RemoteSpanInfo], *, total_blocks: int) -> np.ndarray:
    """Per-block sum of span throughputs `[total_blocks]`, summed in sorted peer-id order (bit-identical on peers)."""
    throughputs = np.zeros(total_blocks)
    for peer_id in sorted(spans):
        span = spans[peer_id]
        throughputs[span.start : span.end] += span.throughput
    return throughputs


def _choose_best_start(throughputs: np.ndarray, num_blocks: int) -> int:
    """The window whose ascending-sorted throughputs are lexicographically smallest; ties go to the lower start.

    A sorted window's first element is its minimum, so only windows with the least minimum can win; those are
    compared on their sorted values (a stable lexsort keeps ties at the lower start, as `min` over (list, i))."""
    windows = sliding_window_view(throughputs, num_blocks)  # [num_starts, num_blocks]
    mins = windows.min(axis=1)  # [num_starts]
    candidates = np.flatnonzero(mins == mins.min())  # [c], ascending starts
    if len(candidates) == 1:
        return int(candidates[0])
    ordered = np.sort(windows[candidates], axis=1)  # [c, num_blocks]
    return int(candidates[np.lexsort(ordered.T[::-1])[0]])  # lexsort's last key is the primary one


def flow_upper_bound(spans: Mapping[str, RemoteSpanInfo], *, total_blocks: int) -> float:
    """No placement of these spans (same lengths and throughputs) gets a bottleneck above this: the least block
    throughput is at most the mean, and the blocks' sum is the spans' throughput x length wherever they sit."""
    return sum(span.throughput * min(span.length, total_blocks) for span in spans.values()) / total_blocks


def choose_best_span(num_blocks: int, spans: Mapping[str, RemoteSpanInfo], *, total_blocks: int) -> range:
    """The span a new server with `num_blocks` blocks should serve, given everyone's spans (state >= JOINING)."""
    if not 1 <= num_blocks <= total_blocks:
        raise ValueError(f"num_blocks must be in [1, {total_blocks}], got {num_blocks}")
    start = _choose_best_start(compute_throughputs(spans, total_blocks=total_blocks), num_blocks)
    return range(start, start + num_blocks)


def choose_best_blocks(num_blocks: int, module_infos: Sequence[RemoteModuleInfo]) -> list[int]:
    """Indices (relative to `module_infos`) a new server with `num_blocks` blocks should serve."""
    spans = compute_spans(module_infos, min_state=ServerState.JOINING)
    return list(choose_best_span(num_blocks, spans, total_blocks=len(module_infos)))


def _move(span: RemoteSpanInfo, new_start: int) -> None:
    span.start, span.end = new_start, new_start + span.length


def should_choose_other_blocks(
    local_peer_id: str,
    module_infos: Sequence[RemoteModuleInfo],
    balance_quality: float,
    *,
    rng: random.Random | None = None,
) -> bool:
    """True if moving this server would raise the swarm's bottleneck throughput enough (quality < balance_quality).

    Never moves if leaving would open a gap. `rng` orders the simulated convergence (default: module `random`)."""
    spans = compute_spans(module_infos, min_state=ServerState.JOINING)
    return should_move_span(local_peer_id, spans, total_blocks=len(module_infos), balance_quality=balance_quality,
                            rng=rng)  # fmt: skip


def should_move_span(
    local_peer_id: str,
    spans: Mapping[str, RemoteSpanInfo],
    *,
    total_blocks: int,
    balance_quality: float,
    rng: random.Random | None = None,
) -> bool:
    """`should_choose_other_blocks` over spans (state >= JOINING) by peer id; `spans` are not modified."""
    if balance_quality > 1.0:
        return True  # debug mode: always move
    spans = {peer: replace(span) for peer, span in spans.items()}  # the simulated convergence moves them
    throughputs = compute_throughputs(spans, total_blocks=total_blocks)
    initial_throughput = throughputs.min()

    local_span = spans.get(local_peer_id)
    if local_span is None:  # the reference asserts here (a known crash); not seeing ourselves is no reason to move
        logger.warning(f"block_selection.own_span_missing(peer={local_peer_id}): staying on the current blocks")
        return False
    throughputs[local_span.start : local_span.end] -= local_span.throughput * (1 + EPS)
    if initial_throughput > EPS and throughputs.min() <= 0:
        return False  # leaving would open a gap
    new_start = _choose_best_start(throughputs, local_span.length)
    if local_span.start == new_start:
        return False
    # quality = initial / converged, and no convergence beats the bound: when even the bound leaves the quality at
    # or above the threshold, the reference's answer is False whatever the convergence does
    bound = flow_upper_bound(spans, total_blocks=total_blocks) * (1 + BOUND_SLACK)
    if initial_throughput >= (balance_quality - EPS) * bound:
        return False
    throughputs[local_span.start : local_span.end] += local_span.throughput * EPS
    _move(local_span, new_start)
    throughputs[local_span.start : local_span.end] += local_span.throughput

    rng = rng or random.Random()
    for _ in range(_MAX_CONVERGENCE_PASSES):
        peers = sorted(spans)
        rng.shuffle(peers)
        moved = False
        for peer_id in peers:
            span = spans[peer_id]
            throughputs[span.start : span.end] -= span.throughput * (1 + EPS)
            new_start = _choose_best_start(throughputs, span.length)
            throughputs[span.start : span.end] += span.throughput * EPS
            if span.start != new_start:
                _move(span, new_start)
                moved = True
            throughputs[span.start : span.end] += span.throughput
        if not moved:
            break

    new_throughput = throughputs.min()
    if new_throughput < initial_throughput or new_throughput < EPS:
        return False
    quality = initial_throughput / new_throughput
    logger.info(f"block_selection.balance(quality={quality * 100:.1f}%, threshold={balance_quality * 100:.1f}%)")
    return bool(quality < balance_quality - EPS)
