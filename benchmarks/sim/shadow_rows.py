"""What a shadow session's rows cost the replica that runs them (issue 37, decision 0268): a decode step's expected time
when shadow requests (`client.session.shadows`: a mirrored session's positions sent `SHADOW_BATCH_ROWS` at a time)
ride it, and the per-row cost calibrated on decision 0260's measurement.

The catalogue's roofline charges a decode step max(bytes read, FLOPs): below the crossover extra rows are free. 0260
measured otherwise on an H100 (`benchmarks.field.verify_cost --layers 32`, a whole Llama-3-8B in bf16, a 32-token
prompt then 256 decode steps per session): 64 sessions with 48 shadows (112 rows a forward) cost +9.9% of the real
decode, 16 sessions with 12 shadows +2.6%, one session +0.5%; the GEMMs, attention, RoPE / KV writes and copies of the
extra rows each grew. So a shadow row is charged its FLOPs at an efficiency `ROW_FLOPS_EFFICIENCY` added to the
step (no overlap with the weights' reads), fitted so that this model of 0260's bench gives its +9.9% at 64 sessions
(`fit_row_efficiency`); the roofline's compute term still applies where it says more (a compute-bound card pays
each row at the catalogue's `FLOPS_EFFICIENCY`). Each request also reads its session's KV once (its positions share
one sequence's keys and values: 0260's attention at 36% of distinct rows').

Requests reach a replica as a Poisson stream (sessions of a swarm start at different times), so the rows of a step
are K x a request's rows with K ~ Poisson(requests a step); the step's time is convex in K (the roofline's max), and
its expectation is taken exactly (`expected_excess`), not at the mean."""

from __future__ import annotations

import math
from dataclasses import dataclass

from benchmarks.sim.catalogue import (
    BANDWIDTH_EFFICIENCY,
    FLOPS_EFFICIENCY,
    GPUS,
    STEP_OVERHEAD_S,
    ModelSpec,
    ServerPerf,
)
from corolla.client.session.shadows import DEFAULT_SHADOW_FRACTION, SHADOW_BATCH_ROWS

# Llama-3-8B: q/o 4096x4096, k/v 4096x1024, MLP 3 x 4096x14336 per block (config.json of meta-llama/Meta-Llama-3-8B)
LLAMA3_8B = ModelSpec("Llama-3-8B", 32, 4096, 8, 128, 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
# decision 0260's bench: one H100, 32 bf16 layers, a 32-token prompt then 256 decode steps (mean context 160 tokens)
BENCH_PERF = ServerPerf(GPUS["H100-80GB"], LLAMA3_8B, "fp16")
BENCH_CONTEXT_TOKENS = 32 + 256 // 2
# sessions -> the cost of the real decode measured (0260, benchmarks/RESULTS.md "Where the shadow rows' cost goes")
MEASURED_COST = {64: 0.099, 16: 0.026, 1: 0.005}
FIT_SESSIONS = 64  # the loaded replica, the figure the target misses: fitted there, the others are checks
ROW_COSTS = ("calibrated", "roofline")  # `--shadow_rows`: fitted to 0260, or the catalogue's roofline alone
POISSON_MEAN_MAX = 200.0  # past this many requests a step, K is taken at its mean (its spread is ~7% of it)


@dataclass
class ShadowLoad:
    """The shadow requests reaching a server: per second, `requests_per_s` of them, `rows` span-equivalent rows (a
    shadow over part of the span counts that part) and `context` tokens of KV read (span-equivalent)."""

    requests_per_s: float = 0.0
    rows: float = 0.0
    context: float = 0.0

    def add(self, other: ShadowLoad, sign: float = 1.0) -> None:
        self.requests_per_s += sign * other.requests_per_s
        self.rows += sign * other.rows
        self.context += sign * other.context


def row_s(perf: ServerPerf, efficiency: float) -> float:
    """A shadow row's added time through one block: its FLOPs at `efficiency` of the card's peak (0: free)."""
    return 2 * perf.model.params_per_block / (perf.gpu.fp16_flops * efficiency) if efficiency > 0 else 0.0


def expected_excess(mean: float, k: float) -> float:
    """E[max(K - k, 0)] for K ~ Poisson(mean): mean - k + E[max(k - K, 0)], the last a finite sum over K < k."""
    if k <= 0:
        return mean - k
    if mean > POISSON_MEAN_MAX or k > mean + 12 * math.sqrt(mean) + 30:  # (the tail past k is below 1e-12)
        return max(mean - k, 0.0)
    p, below = math.exp(-mean), 0.0
    for j in range(math.ceil(k)):
        below += (k - j) * p
        p *= mean / (j + 1)
    return mean - k + below


def expected_block_s(perf: ServerPerf, rows: float, context_tokens: float, requests: float, request_rows: float,
                     request_context: float, shadow_row_s: float) -> float:  # fmt: skip
    """One block's decode step for `rows` real rows holding `context_tokens`, with K ~ Poisson(`requests`) shadow
    requests of `request_rows` rows reading `request_context` tokens each: E over K of max(the weights' and KV's
    bytes + the rows' calibrated cost, the roofline's FLOPs), a convex function max(A + aK, B + bK)."""
    bandwidth = perf.gpu.bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY[perf.dtype]
    per_row_flops_s = 2 * perf.model.params_per_block / (perf.gpu.fp16_flops * FLOPS_EFFICIENCY)
    memory = (perf.block_bytes + context_tokens * perf.model.kv_bytes_per_token_block) / bandwidth
    compute = per_row_flops_s * rows
    a = request_context * perf.model.kv_bytes_per_token_block / bandwidth + request_rows * shadow_row_s
    b = request_rows * max(per_row_flops_s, shadow_row_s)
    high, low = (memory, a), (compute, b)  # A + aK and B + bK
    if compute > memory or (compute == memory and b > a):
        high, low = low, high
    # max(high, low) = high + max(0, low - high): the low line overtakes past K = k where it is steeper
    (h0, h1), (l0, l1) = high, low
    base = h0 + h1 * requests
    if l1 <= h1:
        return base
    k = (h0 - l0) / (l1 - h1)
    return base + (l1 - h1) * expected_excess(requests, k)


def expected_step_s(perf: ServerPerf, num_blocks: int, rows: float, context_tokens: float, requests: float,
                    load: ShadowLoad, shadow_row_s: float) -> float:  # fmt: skip
    """A step through `num_blocks` with `requests` shadow requests expected in it (`expected_block_s`)."""
    per_request = load.requests_per_s if load.requests_per_s > 0 else 1.0
    block_s = expected_block_s(perf, rows, context_tokens, requests, load.rows / per_request,
                               load.context / per_request, shadow_row_s)  # fmt: skip
    return num_blocks * block_s + STEP_OVERHEAD_S


def bench_cost(sessions: int, efficiency: float, perf: ServerPerf = BENCH_PERF) -> float:
    """This model of 0260's bench: `sessions` real rows in lockstep at the bench's mean context, `round(0.75 x
    sessions)` shadows (a lone session's counted at the fraction, as the bench counts it), each sending a request of
    `SHADOW_BATCH_ROWS` positions every as many steps, spread evenly over the steps (the bench's lockstep); -> the
    real decode's extra time with shadows."""
    shadows = max(round(DEFAULT_SHADOW_FRACTION * sessions), 1) if sessions > 1 else DEFAULT_SHADOW_FRACTION
    context = sessions * BENCH_CONTEXT_TOKENS
    plain = perf.decode_step_s(perf.model.num_blocks, sessions, context)
    per_step = shadows / SHADOW_BATCH_ROWS  # requests in a step, on average (evenly spread: at their mean)
    rows = SHADOW_BATCH_ROWS * per_step
    shadowed = (
        perf.model.num_blocks
        * max(
            perf.decode_block_s(sessions, context + per_step * BENCH_CONTEXT_TOKENS) + rows * row_s(perf, efficiency),
            perf.decode_block_s(sessions + rows, context),
        )
        + STEP_OVERHEAD_S
    )
    return shadowed / plain - 1


def fit_row_efficiency(sessions: int = FIT_SESSIONS, cost: float | None = None) -> float:
    """The FLOPs efficiency of a shadow row at which `bench_cost(sessions)` is the measured cost (bisection: the cost
    falls as the efficiency rises)."""
    target = MEASURED_COST[sessions] if cost is None else cost
    low, high = 0.05, 50.0
    if bench_cost(sessions, high) > target:
        return high  # the roofline alone already says more than measured
    for _ in range(100):
        mid = math.sqrt(low * high)
        if bench_cost(sessions, mid) > target:
            low = mid
        else:
            high = mid
    return high


ROW_FLOPS_EFFICIENCY = fit_row_efficiency()
