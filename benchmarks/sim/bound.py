"""The reference bound (Helix's capacity model): a placement's max-flow through the swarm graph, and the best-known
placement for a set of servers (a stage-packing search, then a MILP through scipy's HiGHS with a time limit).
Nothing here is called optimal: the MILP stops at its time limit and reports the best incumbent it found."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp  # type: ignore[import-untyped]
from scipy.sparse import coo_matrix, csr_matrix  # type: ignore[import-untyped]

from corolla.swarm.placement_flow import placement_max_flow
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class ServerKind:
    """A class of identical servers: `capacity_tps[k - 1]` is the tokens/s one of them passes when it holds k blocks
    (Helix's node capacity; its length is the most blocks the card can hold)."""

    name: str
    capacity_tps: tuple[float, ...]

    @property
    def max_blocks(self) -> int:
        return len(self.capacity_tps)

    def capacity_at(self, num_blocks: int) -> float:
        if not 1 <= num_blocks <= self.max_blocks:
            raise ValueError(f"{self.name} holds 1..{self.max_blocks} blocks, got {num_blocks}")
        return self.capacity_tps[num_blocks - 1]


@dataclass(frozen=True)
class BestKnown:
    """The best placement found: spans `[(start, end)]` in the order of the servers given, its max-flow, where it came
    from (`stage-packing` or `milp`), and the solver's upper bound when the MILP ran (inf when it did not)."""

    spans: tuple[tuple[int, int], ...]
    flow_tps: float
    method: str
    upper_bound_tps: float


def _stage_plan(kinds: Sequence[ServerKind], counts: Sequence[int], num_blocks: int, target_tps: float):
    """Stages (start, end, [kind index per server]) reaching `target_tps` at every stage, kinds kept apart (each stage
    is m servers of one kind holding the same k blocks), or None when the servers cannot cover the model."""
    groups: list[tuple[int, int, int]] = []  # (k blocks, m servers, kind index)
    for idx, (kind, count) in enumerate(zip(kinds, counts, strict=True)):
        best = None
        for k in range(1, kind.max_blocks + 1):
            cap = kind.capacity_at(k)
            m = math.ceil(target_tps / cap) if cap > 0 else count + 1
            if m <= count and (best is None or k / m > best[0] / best[1]):
                best = (k, m)
        if best is not None:
            groups.extend([(best[0], best[1], idx)] * (count // best[1]))
    groups.sort(key=lambda g: (-g[0] / g[1], g[2]))
    stages: list[tuple[int, int, list[int]]] = []
    block = 0
    for k, m, idx in groups:
        if block >= num_blocks:
            break
        end = min(block + k, num_blocks)
        stages.append((block, end, [idx] * m))
        block = end
    return stages if block >= num_blocks else None


def stage_packing_placement(
    kinds: Sequence[ServerKind], counts: Sequence[int], num_blocks: int
) -> tuple[list[tuple[int, int] | None], float]:
    """Bisection on the target flow over one-kind stages; leftover servers join the weakest stage they can hold.
    Returns each server's span (None for a server left idle), servers ordered kind by kind, and the max-flow."""
    hi = max((k.capacity_at(1) * c for k, c in zip(kinds, counts, strict=True)), default=0.0)
    lo = 0.0
    best = None
    for _ in range(50):
        mid = (lo + hi) / 2
        plan = _stage_plan(kinds, counts, num_blocks, mid)
        if plan is None:
            hi = mid
        else:
            lo, best = mid, plan
        if hi - lo < 1e-3 * max(hi, 1.0):
            break
    if best is None:
        return [None] * sum(counts), 0.0
    used = [0] * len(kinds)
    for _, _, members in best:
        for idx in members:
            used[idx] += 1
    leftovers = [idx for idx in range(len(kinds)) for _ in range(counts[idx] - used[idx])]
    stage_caps = [sum(kinds[i].capacity_at(e - s) for i in members) for s, e, members in best]
    for idx in sorted(leftovers, key=lambda i: -kinds[i].capacity_at(1)):
        fitting = [j for j, (s, e, _) in enumerate(best) if e - s <= kinds[idx].max_blocks]
        if not fitting:
            continue
        j = min(fitting, key=lambda j: stage_caps[j])
        s, e, members = best[j]
        members.append(idx)
        stage_caps[j] += kinds[idx].capacity_at(e - s)
    per_kind: list[list[tuple[int, int]]] = [[] for _ in kinds]
    for s, e, members in best:
        for idx in members:
            per_kind[idx].append((s, e))
    spans: list[tuple[int, int] | None] = []
    for idx, count in enumerate(counts):
        spans.extend(per_kind[idx] + [None] * (count - len(per_kind[idx])))
    return spans, placed_flow(kinds, counts, spans, num_blocks)


def placed_flow(
    kinds: Sequence[ServerKind], counts: Sequence[int], spans: Sequence[tuple[int, int] | None], num_blocks: int
) -> float:
    """Max-flow (exact boundaries) of spans given kind by kind in the order of `counts`; None = idle server."""
    kind_of = [idx for idx, count in enumerate(counts) for _ in range(count)]
    placed = [(span, kinds[kind_of[i]]) for i, span in enumerate(spans) if span is not None]
    return placement_max_flow(
        [span for span, _ in placed], [kind.capacity_at(span[1] - span[0]) for span, kind in placed], num_blocks
    )


def best_known_placement(
    kinds: Sequence[ServerKind], counts: Sequence[int], num_blocks: int, *, time_limit_s: float = 10.0
) -> BestKnown:
    """The best placement found within `time_limit_s`: stage packing first, then a MILP (HiGHS) over how many servers
    of each kind hold each window `[s, s + k)`, asked only for flows above the packing's. Servers are listed kind by
    kind in the order of `counts`; idle servers get the span (0, 0)."""
    if len(kinds) != len(counts):
        raise ValueError(f"{len(kinds)} kinds but {len(counts)} counts")
    spans, flow = stage_packing_placement(kinds, counts, num_blocks)
    method, upper = "stage-packing", math.inf
    if time_limit_s > 0:
        milp_spans, upper = _milp_placement(
            kinds, counts, num_blocks, min_flow_tps=flow * 1.001, time_limit_s=time_limit_s
        )
        if milp_spans is not None:
            milp_flow = placed_flow(kinds, counts, milp_spans, num_blocks)
            if milp_flow > flow:
                spans, flow, method = milp_spans, milp_flow, "milp"
    logger.info(f"bound.best_known(flow_tps={flow:.1f}, method={method}, servers={sum(counts)})")
    return BestKnown(tuple(span or (0, 0) for span in spans), flow, method, upper)


def _milp_placement(
    kinds: Sequence[ServerKind], counts: Sequence[int], num_blocks: int, *, min_flow_tps: float, time_limit_s: float
) -> tuple[list[tuple[int, int] | None] | None, float]:
    """Boundary-graph MILP: integer y[e] servers of a kind on window e, flow f[e] <= capacity * y[e], flow conserved at
    every block boundary, sum of flow out of boundary 0 >= `min_flow_tps`. Returns (spans or None when it found no
    such placement, the solver's upper bound on the flow or inf)."""
    windows = [
        (idx, s, k)
        for idx, kind in enumerate(kinds)
        if counts[idx] > 0
        for k in range(1, min(kind.max_blocks, num_blocks) + 1)
        for s in range(num_blocks - k + 1)
    ]
    n = len(windows)
    if n == 0:
        return None, math.inf
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lower: list[float] = []
    upper: list[float] = []
    row = 0
    for idx, count in enumerate(counts):  # at most `count` servers of each kind
        members = [e for e, w in enumerate(windows) if w[0] == idx]
        if members:
            rows += [row] * len(members)
            cols += members
            vals += [1.0] * len(members)
            lower.append(0.0)
            upper.append(float(count))
            row += 1
    for e, (idx, _, k) in enumerate(windows):  # f[e] - cap * y[e] <= 0
        rows += [row, row]
        cols += [n + e, e]
        vals += [1.0, -kinds[idx].capacity_at(k)]
        lower.append(-np.inf)
        upper.append(0.0)
        row += 1
    for boundary in range(1, num_blocks):  # flow into a boundary equals flow out of it
        for e, (_, s, k) in enumerate(windows):
            if s + k == boundary or s == boundary:
                rows.append(row)
                cols.append(n + e)
                vals.append(1.0 if s + k == boundary else -1.0)
        lower.append(0.0)
        upper.append(0.0)
        row += 1
    objective = np.zeros(2 * n)
    out_of_zero = [n + e for e, (_, s, _) in enumerate(windows) if s == 0]
    objective[out_of_zero] = -1.0
    rows += [row] * len(out_of_zero)
    cols += out_of_zero
    vals += [1.0] * len(out_of_zero)
    lower.append(min_flow_tps)
    upper.append(np.inf)
    matrix = csr_matrix(coo_matrix((vals, (rows, cols)), shape=(row + 1, 2 * n)))
    var_upper = np.array(
        [float(counts[idx]) for idx, _, _ in windows] + [kinds[idx].capacity_at(k) for idx, _, k in windows]
    )
    result = milp(
        objective,
        constraints=LinearConstraint(matrix, lower, upper),
        integrality=np.r_[np.ones(n), np.zeros(n)],
        bounds=Bounds(0, var_upper),
        options={"time_limit": float(time_limit_s), "disp": False},
    )
    dual = getattr(result, "mip_dual_bound", None)
    upper_bound = -float(dual) if dual is not None and math.isfinite(dual) else math.inf
    if result.x is None:
        return None, upper_bound
    per_kind: list[list[tuple[int, int]]] = [[] for _ in kinds]
    for e, (idx, s, k) in enumerate(windows):
        for _ in range(round(result.x[e])):
            per_kind[idx].append((s, s + k))
    spans: list[tuple[int, int] | None] = []
    for idx, count in enumerate(counts):
        spans.extend(per_kind[idx][:count] + [None] * (count - len(per_kind[idx][:count])))
    return spans, upper_bound
