"""Measurements of corolla's engine on the GPU: the span's single-session decode step (host to host, and the
CUDA-graph replay alone), prefill throughput, and many concurrent sessions through the bench's in-process
`ContinuousBatcher` (the labelled in-process row; the server schedules through its runtime instead)."""

from __future__ import annotations

import asyncio
import time

import torch

from benchmarks.common.batcher import ContinuousBatcher
from benchmarks.common.measure import event_median_ms, median, percentile, sync
from corolla.engine import SpanEngine
from corolla.engine.span_engine import EngineSession, StepRequest


def device_token_inputs(
    engine: SpanEngine, sessions: int, steps: int, gen: torch.Generator
) -> list[list[torch.Tensor]]:
    """`steps` x `sessions` random one-token inputs [1, 1, H] on the engine's device, in its dtype."""
    h, dev = engine.hidden_size, engine.device

    def token() -> torch.Tensor:
        return torch.randn(1, 1, h, device=dev, generator=gen).to(engine.dtype)

    return [[token() for _ in range(sessions)] for _ in range(steps)]


def merged_decode_ms(
    engine: SpanEngine, sessions: list[EngineSession], position: int, inputs: list[list[torch.Tensor]]
) -> list[float]:
    """Host milliseconds of each merged decode step: step i feeds `inputs[i][k]` to `sessions[k]` at `position + i`
    (the device synchronized before and after, so each figure is the step's own)."""
    times = []
    for i, step_inputs in enumerate(inputs):
        reqs = [StepRequest(s, x, position + i) for s, x in zip(sessions, step_inputs, strict=True)]
        sync(engine.device)
        start = time.perf_counter()
        engine.decode_many(reqs)
        sync(engine.device)
        times.append((time.perf_counter() - start) * 1000)
    return times


def _cpu_inputs(n: int, rows: int, tokens: int, hidden: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(rows, tokens, hidden).to(dtype) for _ in range(n)]


@torch.inference_mode()
def single_session(engine: SpanEngine, *, prefix_tokens: int, steps: int) -> dict:
    """Batch-1 decode after a `prefix_tokens` prompt: per-step host-to-host milliseconds (what a server's step
    costs, inputs and outputs on the CPU) and the graph replay alone (device time)."""
    h, dtype = engine.hidden_size, engine.dtype
    prompt = _cpu_inputs(1, 1, prefix_tokens, h, dtype)[0]
    tokens = _cpu_inputs(steps + 5, 1, 1, h, dtype)
    with engine.open_session(1, prefix_tokens + steps + 8) as session:
        engine.step(session, prompt, 0)
        for i in range(5):  # warm-up (captures the bucket-1 graph if not yet captured)
            engine.step(session, tokens[i], prefix_tokens + i)
        times = []
        for i in range(steps):
            sync()
            start = time.perf_counter()
            engine.step(session, tokens[5 + i], prefix_tokens + 5 + i)
            times.append((time.perf_counter() - start) * 1000)
        replay_ms = None
        graphs = engine.graphs
        if graphs is not None:  # replays at the session's last position (rewrites the same slot)
            replay_ms = event_median_ms(lambda: graphs.run(1), 50)
    return {"step_ms": times, "median_ms": median(times), "p90_ms": percentile(times, 0.9), "replay_ms": replay_ms}


@torch.inference_mode()
def prefill(engine: SpanEngine, *, tokens: int, iters: int = 3) -> dict:
    """Tokens per second of one `tokens`-long prompt (input and output on the CPU), median of `iters` runs."""
    prompt = _cpu_inputs(1, 1, tokens, engine.hidden_size, engine.dtype)[0]
    times = []
    with engine.open_session(1, tokens) as session:
        for i in range(iters + 1):
            sync()
            start = time.perf_counter()
            engine.step(session, prompt, 0)  # position 0 each time: a rollback over the same pages
            sync()
            if i:
                times.append((time.perf_counter() - start) * 1000)
    ms = median(times)
    return {"tokens": tokens, "median_ms": ms, "tokens_per_s": tokens / (ms / 1000)}


@torch.inference_mode()
def concurrent_sessions(engine: SpanEngine, *, sessions: int, prefix_tokens: int, steps: int) -> dict:
    """`sessions` clients, each decoding `steps` tokens through one `ContinuousBatcher` after its own prompt (as
    coroutines of one asyncio loop, like the server's handler); per-step latency seen by each client and aggregate
    tokens/s. Also the engine's merged step alone."""
    h, dtype = engine.hidden_size, engine.dtype
    max_len = prefix_tokens + 2 * steps + 16
    opened = [engine.open_session(1, max_len) for _ in range(sessions)]
    try:
        prompt = _cpu_inputs(1, 1, prefix_tokens, h, dtype)[0]
        for s in opened:
            engine.step(s, prompt, 0)
        tokens = _cpu_inputs(steps, 1, 1, h, dtype)
        # 1) the engine's merged step alone (one thread, all sessions in every forward)
        merged = []
        for i in range(steps):
            reqs = [StepRequest(s, tokens[i], prefix_tokens + i) for s in opened]
            sync()
            start = time.perf_counter()
            engine.decode_many(reqs)
            merged.append((time.perf_counter() - start) * 1000)
        # 2) real concurrency as a server sees it: one asyncio loop (the RPC handler's), one coroutine per session,
        # results handed back from the batcher thread through futures
        base = prefix_tokens + steps
        latencies: list[list[float]] = [[] for _ in opened]
        rates: list[float] = []  # each client's steps over its own window

        async def client(k: int) -> None:
            began = time.perf_counter()
            for i in range(steps):
                start = time.perf_counter()
                await batcher.step(opened[k], tokens[i], base + i)
                latencies[k].append((time.perf_counter() - start) * 1000)
            rates.append(steps / (time.perf_counter() - began))

        async def all_clients() -> float:
            wall_start = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(*(client(k) for k in range(sessions))), 300)
            return time.perf_counter() - wall_start

        with ContinuousBatcher(engine) as batcher:
            wall_s = asyncio.run(all_clients())
            rows = list(batcher.batch_rows_history)
        per_session = [median(lat[2:] or lat) for lat in latencies]  # skip each client's first two (ramp-up)
        all_lat = [x for lat in latencies for x in lat[2:]]
        return {
            "sessions": sessions,
            "merged_step_ms": median(merged[2:] or merged),
            "merged_tokens_per_s": sessions / (median(merged[2:] or merged) / 1000),
            "client_step_median_ms": median(all_lat),
            "client_step_p90_ms": percentile(all_lat, 0.9),
            "client_step_mean_ms": sum(all_lat) / max(1, len(all_lat)),
            "worst_session_median_ms": max(per_session),
            "aggregate_tokens_per_s": sessions * steps / wall_s,
            "session_rates_tok_s": sum(rates),
            "mean_batch_rows": sum(rows) / max(1, len(rows)),
        }
    finally:
        for s in opened:
            s.close()
