"""`PetalsPolicy`: Petals 2.x's own placement, rebalancing and routing (reference sections 4 and 11.2), exact, behind
the policy seam: the baseline corolla's policy is measured against (`benchmarks.sim`, `benchmarks.swarm_live`; no
product option selects it, decision 0035). Its block selection is the reference's math as pure functions: cover the
weakest window (lexicographic on sorted window throughputs, ties to the lower start), and move only if a simulated
re-convergence of the whole swarm improves its bottleneck throughput by more than `balance_quality` allows; the same
decisions as the reference, computed faster: windows compared in numpy, and no re-convergence when no placement at
all could reach the threshold."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from corolla.protocol.records import RemoteModuleInfo, RemoteSpanInfo, ServerState
from corolla.swarm.policy import MoveDecision, RouteMode, ServerCapacity, others, own_span
from corolla.swarm.route_planning import make_max_throughput_route, make_min_latency_route
from corolla.swarm.spans import compute_spans, compute_throughputs
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DEFAULT_BALANCE_QUALITY = 0.75  # Petals' --balance_quality
EPS = 1e-3  # the current position wins ties (reduces oscillation between equally good spans)
BOUND_SLACK = 1e-9  # relative float drift the re-convergence's in-place sums may add to a block's throughput
_MAX_CONVERGENCE_PASSES = 1000  # the eps trick converges far sooner; this only bounds pathological inputs


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


@dataclass(frozen=True)
class PetalsPolicy:
    """Cover the weakest window with all `max_blocks`; move when a simulated re-convergence of the swarm would raise
    its bottleneck by more than `balance_quality` allows (ignoring the reload); route inference by min latency and
    forward/backward by span-length-weighted random choice. Load fields and `client_load` are ignored."""

    balance_quality: float = DEFAULT_BALANCE_QUALITY
    name: str = "petals"
    uses_rtts: bool = False
    route_region_rtt_s: float | None = None  # routes over the whole swarm

    def choose_span(self, me: ServerCapacity, spans: Sequence[RemoteSpanInfo], total_blocks: int) -> range:
        num_blocks = min(me.max_blocks, total_blocks)
        return choose_best_span(num_blocks, _by_peer(others(spans, me.peer_id)), total_blocks=total_blocks)

    def choose_move(
        self,
        me: ServerCapacity,
        spans: Sequence[RemoteSpanInfo],
        total_blocks: int,
        *,
        reload_s: float,
        since_move_s: float,
        rng: random.Random,
    ) -> MoveDecision:
        by_peer = _by_peer(spans)
        flow_now = _bottleneck(by_peer, total_blocks)
        mine = own_span(spans, me.peer_id)
        if mine is None:  # the reference asserts here (a known crash); not seeing ourselves is no reason to move
            return MoveDecision(None, flow_now, flow_now, "own span not in the swarm's records")
        if self.balance_quality <= 0 or not should_move_span(
            me.peer_id, by_peer, total_blocks=total_blocks, balance_quality=self.balance_quality, rng=rng
        ):
            return MoveDecision(None, flow_now, flow_now, "balanced enough")
        # Petals leaves (announces OFFLINE), then joins again by choose_best_blocks without itself
        rest = _by_peer(others(spans, me.peer_id))
        target = choose_best_span(mine.length, rest, total_blocks=total_blocks)
        after = dict(rest)
        after[me.peer_id] = RemoteSpanInfo(me.peer_id, target.start, target.stop, mine.server_info)
        return MoveDecision(target, flow_now, _bottleneck(after, total_blocks), "swarm below balance_quality")

    def choose_route(
        self,
        spans: Sequence[RemoteSpanInfo],
        start: int,
        end: int,
        *,
        mode: RouteMode,
        client_rtts_s: Mapping[str, float],
        cache_tokens_needed: int | None = None,
        client_load: Mapping[str, float] | None = None,
        waited_s: float = 0.0,
        rng: random.Random,
    ) -> list[RemoteSpanInfo]:
        if mode == "min_latency":
            return make_min_latency_route(
                spans, start, end, client_rtts_s=client_rtts_s, cache_tokens_needed=cache_tokens_needed
            )
        if mode == "max_throughput":
            return make_max_throughput_route(spans, start, end, client_rtts_s=client_rtts_s, rng=rng)
        raise ValueError(f"mode must be 'min_latency' or 'max_throughput', got {mode!r}")


def _by_peer(spans: Sequence[RemoteSpanInfo]) -> dict[str, RemoteSpanInfo]:
    return {span.peer_id: span for span in spans}


def _bottleneck(spans: Mapping[str, RemoteSpanInfo], total_blocks: int) -> float:
    return float(compute_throughputs(spans, total_blocks=total_blocks).min()) if total_blocks else 0.0
