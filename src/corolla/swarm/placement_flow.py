"""A placement's max-flow through the swarm graph (Helix's capacity model): the most tokens/s a set of spans can pass
from a client through every block and back. The health monitor's bound; `benchmarks.sim` compares placements by it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.sparse import coo_matrix, csr_matrix  # type: ignore[import-untyped]
from scipy.sparse.csgraph import maximum_flow  # type: ignore[import-untyped]

INT_CAPACITY_LIMIT = 2**30  # scipy's maximum_flow takes int32 capacities; flows are scaled to fit under this
# Capacities come from announced records (hostile): one above this (no server passes 10^15 tokens/s) is clamped, so
# that the sum that scales all capacities stays finite; NaN or negative counts as 0
MAX_CAPACITY_TPS = 1e15


def placement_max_flow(
    spans: Sequence[tuple[int, int]],
    capacities_tps: Sequence[float],
    num_blocks: int,
    *,
    exact_boundaries: bool = True,
) -> float:
    """Max tokens/s from a client through servers covering blocks `[0, num_blocks)` and back (Helix's model).

    Each server is a node of capacity `capacities_tps[i]` (tokens/s at its span). Edges: source -> servers starting
    at block 0, servers ending at `num_blocks` -> sink, and server i -> server j when j starts where i ends
    (`exact_boundaries`, Helix's ILP) or, as Petals' routing allows, anywhere inside j's span (start_j <= end_i <
    end_j); server-to-server edges are unbounded."""
    if len(spans) != len(capacities_tps):
        raise ValueError(f"{len(spans)} spans but {len(capacities_tps)} capacities")
    n = len(spans)
    if n == 0:
        return 0.0
    capacities_tps = [min(c, MAX_CAPACITY_TPS) if c > 0 else 0.0 for c in capacities_tps]  # NaN > 0 is False
    total = sum(capacities_tps)
    if total <= 0:
        return 0.0
    # node i is split into in = 2i and out = 2i+1 so that its capacity is an edge; source = 2n, sink = 2n+1
    scale = INT_CAPACITY_LIMIT / (2 * total + 1)
    unbounded = int(2 * total * scale)
    rows: list[int] = []
    cols: list[int] = []
    caps: list[int] = []

    def edge(u: int, v: int, cap: int) -> None:
        rows.append(u)
        cols.append(v)
        caps.append(cap)

    source, sink = 2 * n, 2 * n + 1
    by_start: dict[int, list[int]] = {}
    for i, (start, end) in enumerate(spans):
        if not 0 <= start < end <= num_blocks:
            raise ValueError(f"span {i} = [{start}, {end}) is not inside [0, {num_blocks})")
        edge(2 * i, 2 * i + 1, int(max(capacities_tps[i], 0.0) * scale))
        if start == 0:
            edge(source, 2 * i, unbounded)
        if end == num_blocks:
            edge(2 * i + 1, sink, unbounded)
        by_start.setdefault(start, []).append(i)
    starts = np.array([s for s, _ in spans])
    ends = np.array([e for _, e in spans])
    for i, (_, end) in enumerate(spans):
        if end == num_blocks:
            continue
        targets = by_start.get(end, []) if exact_boundaries else np.flatnonzero((starts <= end) & (end < ends)).tolist()
        for j in targets:
            if j != i:
                edge(2 * i + 1, 2 * j, unbounded)
    graph = csr_matrix(coo_matrix((caps, (rows, cols)), shape=(2 * n + 2, 2 * n + 2), dtype=np.int32))
    graph.sum_duplicates()
    return float(maximum_flow(graph, source, sink).flow_value) / scale
