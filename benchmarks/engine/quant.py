"""GPU benchmark of the fast path with quantized weights and of Qwen3 on the fast path (random weights, real layer
shapes): `python -m benchmarks.engine.quant --out DIR`.

Measures in one process, on one card: the copy bandwidth; a span step (batch 1, after a 512-token prefix) of 32
Llama-3-8B-shaped layers in bf16, NF4 and INT8 (`--kinds`), each against its floor (bytes the step reads /
bandwidth), the same step as a server's device thread runs it (`server_step_ms`: hidden states as bytes in, a
launched forward, the output's bytes out) and the replay of its graph alone (CUDA events: the rest of the step is
the host's part), optionally its kernels under torch's profiler (`--profile_steps`: launches and GPU time per
step), each step's kernels by position in a layer (`--timeline`: the single session's and the merged step's) and
where its host part goes (`--host_split`: `host_split`, `bare_steps`); 64 NF4 sessions in one merged step against
one; whether two identical NF4 sessions merged in one step give identical rows; a Qwen3-32B-shaped span (a few
layers) against its floor and transformers' own Qwen3 layers. Writes a JSON and a log under --out."""

from __future__ import annotations

import argparse
import ast
import functools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common.measure import copy_bandwidth_bytes_per_s, event_median_ms, sync
from benchmarks.common.quantize import quantize_int8, quantize_nf4
from benchmarks.common.report import log
from corolla.engine.batcher import execute_steps, launch_steps
from corolla.engine.config import EngineConfig
from corolla.engine.kv.kv_pool import KVLayout
from corolla.engine.span_engine import SpanEngine, StepRequest
from corolla.engine.spans.fast_llama import FastLlamaSpan, LayerWeights, LlamaSpec

LLAMA3_8B = LlamaSpec(
    hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336, rms_norm_eps=1e-5
)
QWEN3_32B = LlamaSpec(
    hidden_size=5120,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=25600,
    rms_norm_eps=1e-6,
    qk_norm=True,
)
TINY = LlamaSpec(  # --tiny: a CPU dry run of every code path in seconds
    hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512, rms_norm_eps=1e-6
)
PROJECTIONS = ("w_qkv", "w_o", "w_gate_up", "w_down")


def free_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_layer(spec: LlamaSpec, device: torch.device, gen: torch.Generator) -> LayerWeights:
    h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim

    def mat(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=device, generator=gen) * (0.5 / math.sqrt(k))).to(torch.bfloat16)

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, device=device, generator=gen)).to(torch.bfloat16)

    return LayerWeights(
        ln1=norm(h),
        w_qkv=mat(spec.q_size + 2 * spec.kv_size, h),
        b_qkv=None,
        w_o=mat(h, spec.q_size),
        b_o=None,
        ln2=norm(h),
        w_gate_up=mat(2 * i, h),
        b_gate_up=None,
        w_down=mat(h, i),
        b_down=None,
        q_norm=norm(d) if spec.qk_norm else None,
        k_norm=norm(d) if spec.qk_norm else None,
    )


def quantized(layer: LayerWeights, kind: str) -> LayerWeights:
    fn = quantize_nf4 if kind == "nf4" else quantize_int8
    return LayerWeights(**{**vars(layer), **{name: fn(getattr(layer, name)) for name in PROJECTIONS}})


GPU_KV_POOL_BYTES = 6 << 30
PAGE_TOKENS = 64  # EngineConfig's default page


def kv_pool_bytes_for(spec: LlamaSpec, layers_n: int, sessions: int, tokens_per_session: int) -> int:
    """Bytes of KV pool that `sessions` sessions of up to `tokens_per_session` tokens each take (whole pages, bf16),
    plus one page per session of slack."""
    pages = sessions * (-(-tokens_per_session // PAGE_TOKENS) + 1)
    return (
        pages * PAGE_TOKENS * KVLayout.heads(spec.num_kv_heads, spec.head_dim).bytes_per_token(torch.bfloat16, layers_n)
    )


KERNEL_CHOICES_DIR: str | None = None  # --kernel_choices_dir: the tuner's choices kept there (a second run times none)


def make_engine(
    spec: LlamaSpec, layers: list[LayerWeights], max_rows: int, pool_bytes: int = 0
) -> tuple[SpanEngine, dict]:
    """The engine over `layers` (a KV pool of at least `pool_bytes`) and its warm-up's kernel timings (empty on
    CPU; without timings where `KERNEL_CHOICES_DIR` held the choices)."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float32) / spec.head_dim))
    model = FastLlamaSpan(spec, layers, inv_freq, max_positions=2048, use_triton=layers[0].ln1.is_cuda)
    buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_rows)
    config = EngineConfig(
        kv_pool_bytes=max(pool_bytes, GPU_KV_POOL_BYTES if layers[0].ln1.is_cuda else 0),
        max_seq_len_tokens=1024,
        max_batch_rows=max_rows,
        graph_buckets=buckets,
        kernel_choices_dir=KERNEL_CHOICES_DIR,
    )
    engine = SpanEngine(model, config)
    report = engine.warmup() if engine.device.type == "cuda" else {}
    return engine, report


def random_quantized_engine(
    kind: str, device: torch.device, layers_n: int, sessions: int, prefix_tokens: int, gen: torch.Generator
) -> tuple[SpanEngine, dict, list[LayerWeights], float]:
    """The A/B tools' engine: `layers_n` random Llama-3-8B-shaped layers (TINY off CUDA) quantized to `kind`, KV for
    `sessions` sessions of `prefix_tokens` + 64 tokens: (the engine, its warm-up's kernel timings, the layers, the
    copy bandwidth its floor is taken against in bytes/s: measured on CUDA, 1e10 elsewhere)."""
    spec = LLAMA3_8B if device.type == "cuda" else TINY
    bandwidth = copy_bandwidth_bytes_per_s(device) if device.type == "cuda" else 1e10
    layers = [quantized(random_layer(spec, device, gen), kind) for _ in range(layers_n)]
    engine, report = make_engine(
        spec, layers, sessions, kv_pool_bytes_for(spec, layers_n, sessions, prefix_tokens + 64)
    )
    return engine, report, layers, bandwidth


def log_kernels(lines: list[str], kind: str, report: dict, layer: LayerWeights, bandwidth: float) -> dict:
    """Per projection shape: the chosen kernel's microseconds per layer call against that weight's floor (its
    bytes / bandwidth), for the single-row step (and the tl.dot kernel at 64 rows for quantized weights)."""
    rows = {}
    for name in PROJECTIONS:
        w = getattr(layer, name)
        n, k = w.shape
        nbytes = w.nbytes() if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()
        floor_us = nbytes / bandwidth * 1e6
        hits = [r for key, r in report.items() if key[1:3] == (n, k) or key[:2] == (n, k)]
        if not hits:
            continue
        best_us = min(r["best_us"] for r in hits)
        row = {"n": n, "k": k, "bytes": nbytes, "floor_us": floor_us, "best_us": best_us, "x_floor": best_us / floor_us}
        row["best"] = str(min(hits, key=lambda r: r["best_us"])["best"])
        row["all_us"] = hits[0].get("all_us", {})  # every candidate's time (the tuner's table)
        if "gemm_best_us" in hits[0]:  # (no candidates' times where the choices came from --kernel_choices_dir)
            row["gemm_all_us"] = hits[0].get("gemm_all_us", {})
            row["gemm_64_rows_us"] = hits[0]["gemm_best_us"]
            row["gemm_best"] = str(hits[0].get("gemm_best"))
        row["families_us"] = kernel_families(kind, row)
        for prologue, r in hits[0].get("prologues", {}).items():  # the norm/SiLU pair against the fused kernels
            row[f"{prologue}_fusion"] = r
            if r:
                fused = ", ".join(f"{c} {us:.1f}" for c, us in r["all_us"].items())
                log(lines, f"    {prologue}: pair {r['unfused_us']:.1f} us; fused {fused} -> {r['fused'] or 'pair'}")
        rows[name] = row
        extra = f", tl.dot at 64 rows {row['gemm_64_rows_us']:.1f} us" if "gemm_64_rows_us" in row else ""
        log(lines, f"  {kind} {name} [{n}x{k}]: 1 row {best_us:.1f} us, floor {floor_us:.1f} us "
                   f"({best_us / floor_us:.2f}x) with {row['best']}{extra}")  # fmt: skip
        for label, best in row["families_us"].items():
            log(
                lines,
                f"    {label}: " + ", ".join(f"{fam} {us:.1f} us ({us / floor_us:.2f}x)" for fam, us in best.items()),
            )
    return rows


NF4_FAMILIES = {  # kernel -> name, for the per-shape micro-benchmark table
    "gemv": "table GEMV (fp32 levels)",
    "tile": "tile GEMV (mma)",
    "mma": "matrix units (tl.dot)",
    "mmaf": "matrix units, folded table (tl.dot)",
}


def kernel_families(kind: str, row: dict) -> dict:
    """Best microseconds per kernel family among the tuner's candidates: {"1 row": {...}, "64 rows": {...}}."""
    out: dict[str, dict[str, float]] = {}
    for label, table in (("1 row", row.get("all_us", {})), ("64 rows", row.get("gemm_all_us", {}))):
        best: dict[str, float] = {}
        for text, us in table.items():
            parsed = ast.literal_eval(text) if text.startswith("(") else None
            name: str
            if isinstance(parsed, tuple) and len(parsed) == 2 and isinstance(parsed[1], tuple):  # quantized
                kernel = str(parsed[0])
                name = NF4_FAMILIES.get(kernel, kernel) if kind == "nf4" else kernel
                name = "block tl.dot" if kernel == "block" else name
            elif isinstance(parsed, tuple):  # a dense single-row Triton config
                name = f"Triton {parsed[0]}" if isinstance(parsed[0], str) else "Triton skinny GEMM"
            else:
                name = "cuBLAS (unfused)"
            best[name] = min(us, best.get(name, float("inf")))
        if best:
            out[label] = best
    return out


STEPS = 30  # timed decode steps per measurement
PROLOGUE_AB_PAIRS = 3  # alternated fused/separate pairs of the quantized step (prologue_ab)


def token_steps(engine: SpanEngine, sessions: list, position: int, gen: torch.Generator) -> list[StepRequest]:
    """One decode step of each session at `position`: random hidden states [1, 1, H] on the engine's device."""
    h, dev, dtype = engine.hidden_size, engine.device, engine.dtype
    return [StepRequest(s, torch.randn(1, 1, h, device=dev, dtype=dtype, generator=gen), position) for s in sessions]


def step_ms(
    engine: SpanEngine, sessions: list, prefix: int, steps: int | None = None
) -> tuple[float, list[torch.Tensor]]:
    """Median milliseconds of one merged decode step of `sessions` (each after `prefix` tokens), GPU inputs."""
    gen = torch.Generator(device=engine.device).manual_seed(7)
    times, outs = [], []
    for i in range(steps or STEPS):
        reqs = token_steps(engine, sessions, prefix + i, gen)
        sync(engine.device)
        start = time.perf_counter()
        outs = engine.decode_many(reqs)
        sync(engine.device)
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[len(times) // 2], outs


def server_step_ms(engine: SpanEngine, sessions: list, prefix: int, steps: int | None = None) -> float:
    """Median milliseconds of one merged decode step of `sessions` as a server's device thread runs it: each
    session's hidden states as the bytes a reply arrives with (`StepRequest.of_bytes`, checked as
    `EngineExecutor.prepare_step` checks them), one launched forward (`batcher.launch_steps`) and its output's bytes
    in the pinned buffer (`PendingSteps.wait`: the spinning wait of a lone row); the engine's own forward off the
    graph path (`execute_steps`). From the request's build to the bytes: what `step_ms` leaves out of a server's
    step (the input's copy from pinned memory, the output's copy back) and in (the output's clone on the device)."""
    gen = torch.Generator().manual_seed(7)
    h, dtype = engine.hidden_size, engine.dtype
    shape = (1, 1, h)
    times = []
    for i in range(steps or STEPS):
        raws = [
            torch.randn(shape, generator=gen).to(dtype).view(torch.uint8).numpy().reshape(-1).data for _ in sessions
        ]
        sync(engine.device)
        start = time.perf_counter()
        reqs = []
        for session, raw in zip(sessions, raws, strict=True):
            req = StepRequest.of_bytes(session, prefix + i, raw, dtype, shape)
            engine.check_inputs(req)
            reqs.append(req)
        pending = launch_steps(engine, reqs)
        results = pending.wait() if pending is not None else execute_steps(engine, reqs)
        times.append((time.perf_counter() - start) * 1000)
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            raise failed[0]
    return sorted(times)[len(times) // 2]


def host_split(engine: SpanEngine, sessions: list, prefix: int) -> dict:
    """Where a host-timed step of `sessions` goes (`step_ms`'s steps; medians over STEPS, microseconds): on the host,
    its work before the graph's replay call (`before_us`), the call (`replay_call_us`), its work after the call until
    `decode_many` returns (`after_us`) and the wait for the device then (`wait_us`); on the device, from CUDA events
    recorded at the step's start and around the replay (~2 us of host each), the time from the start to the replay
    (`to_replay_us`: the host's work before it and the input copies) and the replay's own (`graph_us`, to set against
    the back-to-back replay)."""
    graphs = engine.graphs
    assert graphs is not None
    run, marks = graphs.run, [0.0, 0.0]
    start_event, before, after = (torch.cuda.Event(enable_timing=True) for _ in range(3))

    def timed_run(*args, **kwargs) -> torch.Tensor:
        marks[0] = time.perf_counter()
        before.record()
        out = run(*args, **kwargs)
        after.record()
        marks[1] = time.perf_counter()
        return out

    gen = torch.Generator(device=engine.device).manual_seed(7)
    split: dict[str, list[float]] = {k: [] for k in ("before_us", "replay_call_us", "after_us", "wait_us")}
    split.update(to_replay_us=[], graph_us=[])
    graphs.run = timed_run  # type: ignore[method-assign]  # (this instance only, for these steps)
    try:
        for i in range(STEPS):
            reqs = token_steps(engine, sessions, prefix + i, gen)
            sync(engine.device)
            t0 = time.perf_counter()
            start_event.record()
            engine.decode_many(reqs)
            t_returned = time.perf_counter()
            sync(engine.device)
            t_end = time.perf_counter()
            split["before_us"].append((marks[0] - t0) * 1e6)
            split["replay_call_us"].append((marks[1] - marks[0]) * 1e6)
            split["after_us"].append((t_returned - marks[1]) * 1e6)
            split["wait_us"].append((t_end - t_returned) * 1e6)
            split["to_replay_us"].append(start_event.elapsed_time(before) * 1e3)
            split["graph_us"].append(before.elapsed_time(after) * 1e3)
    finally:
        del graphs.run  # the class's method again
    return {k: sorted(v)[len(v) // 2] for k, v in split.items()}


BARE_ROUNDS = 8  # alternated rounds of every bare variant (`bare_steps`)


def bare_session_tokens(prefix: int) -> int:
    """The length `bare_steps`' own session is opened for: its prefix, its first step, then one step per engine-step
    call of every round (and a few spare)."""
    return prefix + BARE_ROUNDS * (max(1, STEPS // 2) + 1) + 4


def bare_steps(engine: SpanEngine, prefix: int, gen: torch.Generator) -> dict:
    """What each device operation queued before the graph's replay adds to a host-timed step (CUDA only): after one
    engine step staged the session's inputs, each variant runs from a synchronized, idle device to the synchronize
    after it, STEPS // 2 times per round over BARE_ROUNDS alternated rounds; per variant the median microseconds
    and the lowest and highest round medians. Variants: a 1-kernel graph (`tiny`), the replay alone, after an event
    record, after the positions/tables copy from a pinned block (`h2d`), after the hidden states' device copy
    (`d2d`), the engine's four operations (`step_ops`: both copies, the replay, the output's clone), one graph
    holding both copies and the span (`graph_with_copies` + clone: no operation queued before the replay) and the
    engine's own step (`engine_step`: `decode_many` of a session of its own at the next position each time, the
    requests made outside the timing)."""
    assert engine.graphs is not None and engine.device.type == "cuda"
    steps = max(1, STEPS // 2)
    session = open_prefilled(engine, 1, prefix, gen, tokens=bare_session_tokens(prefix))[0]
    try:
        return _bare_steps(engine, session, steps, prefix, gen)
    finally:
        session.close()  # (also where a variant failed: the merged step after it needs the pages)


def _bare_steps(engine: SpanEngine, session, steps: int, prefix: int, gen: torch.Generator) -> dict:
    """`bare_steps` over its own `session`."""
    graphs = engine.graphs
    dev = engine.device
    assert graphs is not None
    sessions, rows, layers = [session], 1, session.layers
    engine.decode_many(token_steps(engine, sessions, prefix, gen))  # stages the rows' positions and tables
    target = graphs.inputs_for(rows)
    head_end = target.layout.hidden_offset
    head = target.block[:head_end].to("cpu").pin_memory()  # [head_end] uint8: the staged positions and tables
    graph_head, graph_rows = target.block[:head_end], target.hidden[:rows].view(rows, 1, -1)  # [rows, 1, H]
    x = torch.randn(rows, 1, engine.hidden_size, device=dev, generator=gen).to(engine.dtype)
    event = torch.cuda.Event()
    side = torch.cuda.Stream(dev)
    tiny_x = torch.zeros(1, device=dev)
    tiny = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        tiny_x.add_(1)
    torch.cuda.current_stream(dev).wait_stream(side)
    with torch.cuda.graph(tiny, stream=side):
        tiny_x.add_(1)

    def run() -> torch.Tensor:
        return graphs.run(rows, layers, reset=False)

    def step_ops() -> None:
        graph_head.copy_(head, non_blocking=True)
        graph_rows.copy_(x)
        run().clone()

    variants: dict[str, Callable[[], object]] = {
        "tiny": tiny.replay,
        "replay": run,
        "record+replay": lambda: (event.record(), run()),
        "h2d+replay": lambda: (graph_head.copy_(head, non_blocking=True), run()),
        "d2d+replay": lambda: (graph_rows.copy_(x), run()),
        "step_ops": step_ops,
    }
    try:  # the copies as the first nodes of the span's own graph
        whole = torch.cuda.CUDAGraph()
        side.wait_stream(torch.cuda.current_stream(dev))
        span_args = (target.hidden, target.positions, target.block_tables, engine.pool, layers)
        with torch.cuda.graph(whole, stream=side):
            graph_head.copy_(head, non_blocking=True)
            graph_rows.copy_(x)
            whole_out = engine.model.decode(*span_args)  # [bucket, H]

        def graph_with_copies() -> torch.Tensor:
            whole.replay()
            return whole_out[:rows].clone()

        variants["graph_with_copies"] = graph_with_copies
    except Exception as e:  # a measurement aid: the other variants stand
        print(f"graph_with_copies failed: {type(e).__name__}: {str(e)[:300]}")
    requests: list[list[StepRequest]] = []
    variants["engine_step"] = lambda: engine.decode_many(requests.pop())
    times: dict[str, list[list[float]]] = {name: [] for name in variants}
    for _ in range(BARE_ROUNDS):
        for name, fn in variants.items():
            if name == "engine_step":  # each at the session's next position (popped from the end)
                start = session.length_tokens
                requests[:] = [token_steps(engine, sessions, start + j, gen) for j in reversed(range(steps + 1))]
            fn()
            round_times = []
            for _ in range(steps):
                sync(dev)
                t0 = time.perf_counter()
                fn()
                sync(dev)
                round_times.append((time.perf_counter() - t0) * 1e6)
            times[name].append(round_times)
    out: dict[str, dict[str, float]] = {}
    for name, rounds in times.items():
        flat = sorted(t for r in rounds for t in r)
        medians = [sorted(r)[len(r) // 2] for r in rounds]
        out[name] = {"median_us": flat[len(flat) // 2], "round_min_us": min(medians), "round_max_us": max(medians)}
    return out


def prologue_ab(engine: SpanEngine, sessions: list, prefix: int, lines: list[str], kind: str, floor: float) -> dict:
    """The single-session step with the tuner's fused norm/SiLU prologues (`ops.quant_fused`) against the same
    engine with them off (the separate kernels + the best kernels), graphs captured afresh for each, alternated
    over PROLOGUE_AB_PAIRS pairs in the same minutes: {"fused_ms": [...], "unfused_ms": [...]} and medians."""
    assert isinstance(engine.model, FastLlamaSpan)
    ops, fused = engine.model.ops, dict(engine.model.ops.quant_fused)
    times: dict[str, list[float]] = {"unfused_ms": [], "fused_ms": []}
    assert engine.graphs is not None
    for _ in range(PROLOGUE_AB_PAIRS):
        for label, choice in (("unfused_ms", {}), ("fused_ms", fused)):
            ops.quant_fused = dict(choice)
            engine.graphs.clear()  # captured again with this choice
            engine.graphs.capture_all()
            times[label].append(step_ms(engine, sessions, prefix)[0])
    ops.quant_fused = fused
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    log(lines, f"  {kind} prologues fused vs separate ({PROLOGUE_AB_PAIRS} alternated pairs): "
               f"{med['fused_ms']:.3f} ms ({med['fused_ms'] / floor:.2f}x floor) vs {med['unfused_ms']:.3f} ms "
               f"({med['unfused_ms'] / floor:.2f}x); fused {times['fused_ms']}, separate {times['unfused_ms']}")  # fmt: skip
    return {**times, "median_fused_ms": med["fused_ms"], "median_unfused_ms": med["unfused_ms"]}


def open_prefilled(engine: SpanEngine, count: int, prefix: int, gen: torch.Generator, tokens: int = 0) -> list:
    """`count` sessions of up to `tokens` tokens (default: prefix + 64), each prefilled with `prefix` random ones."""
    sessions = []
    for _ in range(count):
        s = engine.open_session(1, tokens or prefix + 64)
        hidden = torch.randn(1, prefix, engine.hidden_size, device=engine.device, generator=gen).to(engine.dtype)
        engine.step(s, hidden, 0)
        sessions.append(s)
    return sessions


def profile_steps(engine: SpanEngine, sessions: list, prefix: int, steps: int) -> dict:
    """The device's kernels (and copies) over `steps` decode steps under torch's profiler: per name, launches and
    microseconds per step, and the GPU's busy microseconds per step (their sum)."""
    from torch.profiler import ProfilerActivity, profile

    step_ms(engine, sessions, prefix, steps=3)  # warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step_ms(engine, sessions, prefix, steps=steps)
    per_name: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            row = per_name.setdefault(event.name, [0.0, 0.0])
            row[0] += 1 / steps
            row[1] += event.time_range.elapsed_us() / steps
    kernels = sorted(per_name.items(), key=lambda item: -item[1][1])
    return {
        "launches_per_step": sum(n for n, _ in per_name.values()),
        "busy_us_per_step": sum(us for _, us in per_name.values()),
        "top": [{"name": name[:100], "per_step": n, "us_per_step": us} for name, (n, us) in kernels[:12]],
    }


def step_timeline(engine: SpanEngine, sessions: list, prefix: int, layers_n: int) -> dict:
    """One decode step's kernels in launch order under torch's profiler (the middle of 3 profiled steps), folded by
    their position within a layer: per position the kernel's name, its mean device microseconds and the mean gap
    before it (its start less the previous kernel's end; negative where they overlap), over the layers; and the
    layers' span (their first kernel's start to their last one's end), busy time and gaps, in microseconds."""
    from torch.profiler import ProfilerActivity, profile

    step_ms(engine, sessions, prefix, steps=3)  # warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step_ms(engine, sessions, prefix, steps=3)
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "emcpy" not in e.name),
        key=lambda e: e.time_range.start,
    )
    per_step = len(events) // 3
    step = events[per_step : 2 * per_step]  # [kernels of the middle step]
    names = [e.name for e in step]
    period = per_step // layers_n if layers_n else 0  # kernels per layer (the rest run before or after the layers)
    # the layers' kernels: the longest stretch where names repeat with the period
    start = next((i for i in range(len(step)) if names[i : i + period * (layers_n - 1)]
                  == names[i + period : i + period * layers_n]), 0) if period else 0  # fmt: skip
    rows = []
    for j in range(period):
        idx = [start + layer * period + j for layer in range(layers_n) if start + layer * period + j < len(step)]
        durs = [step[i].time_range.elapsed_us() for i in idx]
        gaps = [step[i].time_range.start - step[i - 1].time_range.end for i in idx if i > 0]
        rows.append({"name": names[idx[0]][:90], "us": sum(durs) / len(durs), "gap_us": sum(gaps) / max(1, len(gaps))})
    layers = step[start : start + period * layers_n] or step  # the layers' kernels (their span: no host time)
    busy = sum(e.time_range.elapsed_us() for e in layers)
    span = layers[-1].time_range.end - layers[0].time_range.start
    by_name: dict[str, list[float]] = {}  # every kernel of the step by name (kernels on two streams fold unevenly)
    for e in step:
        by_name.setdefault(e.name[:90], []).append(e.time_range.elapsed_us())
    names_us = {n: {"per_step": len(v), "us": sum(v) / len(v)} for n, v in by_name.items()}
    return {"kernels": len(step), "per_layer": period, "span_us": span, "busy_us": busy, "gaps_us": span - busy,
            "layer": rows, "by_name": names_us, "step_us": step[-1].time_range.end - step[0].time_range.start}  # fmt: skip


def log_timeline(lines: list[str], kind: str, tl: dict) -> None:
    log(lines, f"  {kind} timeline: {tl['kernels']} kernels per step ({tl['per_layer']} per layer), the layers' span "
               f"{tl['span_us']:.0f} us = busy {tl['busy_us']:.0f} + gaps {tl['gaps_us']:.0f}; one layer:")  # fmt: skip
    for row in tl["layer"]:
        log(lines, f"    {row['us']:7.2f} us  gap {row['gap_us']:6.2f} us  {row['name'][:80]}")


def log_profile(lines: list[str], kind: str, prof: dict) -> None:
    log(lines, f"  {kind} profile: {prof['launches_per_step']:.0f} launches per step, GPU busy "
               f"{prof['busy_us_per_step'] / 1000:.3f} ms per step")  # fmt: skip
    for row in prof["top"]:
        n, us = row["per_step"], row["us_per_step"]
        log(lines, f"    {us:8.1f} us/step {n:6.1f}/step {us / n:7.2f} us each  {row['name'][:70]}")


def bench_llama(
    results: dict, lines: list[str], bandwidth: float, prefix: int, layers_n: int, dev, sessions_n: int,
    kinds: tuple[str, ...] = ("bf16", "nf4", "int8"), profile: int = 0, timeline: bool = False, split: bool = False,
) -> None:  # fmt: skip
    """`kinds`: which of bf16, nf4, int8 to run, in the order given; `profile` > 0: also that many steps of each kind's
    single-session step under the profiler (CUDA only); `timeline`: one step's kernels by position in a layer (the
    single session's and the merged step's); `split`: where the single-session host-timed step's time goes
    (`host_split`) and what each device operation before the replay adds (`bare_steps`). NF4 and bf16 also run
    `sessions_n` sessions merged in one step (bf16's: the same-run baseline of the merged NF4 step)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    spec = TINY if dev.type == "cpu" else LLAMA3_8B
    dense = [random_layer(spec, dev, gen) for _ in range(layers_n)]
    bf16_ms = None
    for kind in kinds:
        layers = dense if kind == "bf16" else [quantized(layer, kind) for layer in dense]
        # every session this kind opens: one, the others of the merged step and two twins (prefix + 64 tokens); with
        # `split` also the bare steps' own (closed before the merged step opens its sessions, but int8 has no room
        # beside `one` without it)
        merged = kind in ("nf4", "bf16")
        pool = kv_pool_bytes_for(spec, layers_n, sessions_n + 2 if merged else 1, prefix + 64)
        if split:
            pool += kv_pool_bytes_for(spec, layers_n, 1, bare_session_tokens(prefix))
        started = time.perf_counter()
        # [1, 64] rows: graph buckets
        engine, report = make_engine(spec, layers, 64 if merged else 1, pool)
        warmup_s = time.perf_counter() - started  # the engine's start: kernel tuning and graph capture
        floor = engine.model.weight_bytes() / bandwidth * 1000
        kernels = log_kernels(lines, kind, report, layers[0], bandwidth)
        one = open_prefilled(engine, 1, prefix, gen)
        ms, _ = step_ms(engine, one, prefix)
        served = server_step_ms(engine, one, prefix)
        row: dict[str, object] = {"step_ms": ms, "floor_ms": floor, "x_floor": ms / floor, "server_step_ms": served}
        also = f", as a server runs it {served:.3f} ms ({served / floor:.2f}x)"
        if engine.graphs is not None:  # the graph alone (device time): the rest of the step is the host's part
            replay_ms = row["replay_ms"] = event_median_ms(functools.partial(engine.graphs.run, 1), STEPS)
            also += f", replay {replay_ms:.3f} ms (host part {ms - replay_ms:.3f} ms)"
        if split and engine.graphs is not None:
            try:
                hs = row["host_split"] = host_split(engine, one, prefix)
                log(lines, f"  {kind} step split (us, medians): host before the replay {hs['before_us']:.1f}, replay "
                           f"call {hs['replay_call_us']:.1f}, after it {hs['after_us']:.1f}, wait {hs['wait_us']:.1f}; "
                           f"device start -> replay {hs['to_replay_us']:.1f}, graph {hs['graph_us']:.1f}")  # fmt: skip
            except Exception as e:  # a measurement aid: its failure is logged, the step's row stands
                log(lines, f"  {kind} step split failed: {type(e).__name__}: {str(e)[:300]}")
            try:
                bs = row["bare_steps"] = bare_steps(engine, prefix, gen)
                log(lines, f"  {kind} bare steps (us from an idle device to the synchronize; median [round medians' "
                           "range]): " + ", ".join(f"{name} {v['median_us']:.1f} [{v['round_min_us']:.1f}-"
                                                   f"{v['round_max_us']:.1f}]" for name, v in bs.items()))  # fmt: skip
            except Exception as e:  # a measurement aid: its failure is logged, the step's row stands
                log(lines, f"  {kind} bare steps failed: {type(e).__name__}: {str(e)[:300]}")
        row["weight_bytes"] = engine.model.weight_bytes()
        row["warmup_s"] = warmup_s
        row["kernels"] = kernels
        log(lines, f"llama3-8b x{layers_n} {kind}: step {ms:.3f} ms, floor {floor:.3f} ms ({ms / floor:.2f}x){also}; "
                   f"warm-up (tuning + graphs) {warmup_s:.1f} s")  # fmt: skip
        if isinstance(engine.model, FastLlamaSpan) and engine.model.ops.quant_fused and dev.type == "cuda" \
                and PROLOGUE_AB_PAIRS > 0:  # fmt: skip
            try:
                row["prologue_ab"] = prologue_ab(engine, one, prefix, lines, kind, floor)
            except Exception as e:  # a measurement aid: its failure is logged, the step's row stands
                log(lines, f"  {kind} prologue A/B failed: {type(e).__name__}: {str(e)[:300]}")
        if profile > 0 and dev.type == "cuda":
            try:
                prof = profile_steps(engine, one, prefix, profile)
                row["profile"] = prof
                log_profile(lines, kind, prof)
            except Exception as e:  # a measurement aid: its failure is logged, the step's row stands
                log(lines, f"  {kind} profile failed: {type(e).__name__}: {str(e)[:300]}")
        if timeline and dev.type == "cuda":
            try:
                timeline_row = row["timeline"] = step_timeline(engine, one, prefix, layers_n)
                log_timeline(lines, kind, timeline_row)
            except Exception as e:  # a measurement aid: its failure is logged, the step's row stands
                log(lines, f"  {kind} timeline failed: {type(e).__name__}: {str(e)[:300]}")
        if merged:
            many = open_prefilled(engine, sessions_n - 1, prefix, gen)
            ms64, _ = step_ms(engine, one + many, prefix, steps=max(1, STEPS // 2))
            row["sessions"] = sessions_n
            row["step_many_ms"] = ms64
            if engine.graphs is not None:
                row["replay_many_ms"] = event_median_ms(functools.partial(engine.graphs.run, sessions_n), STEPS)
                log(lines, f"  {sessions_n} {kind} sessions: replay {row['replay_many_ms']:.3f} ms")
            row["speedup_many"] = sessions_n * ms / ms64
            if timeline and dev.type == "cuda":
                try:
                    timeline_row = row["timeline_many"] = step_timeline(engine, one + many, prefix, layers_n)
                    log_timeline(lines, f"{sessions_n} {kind} sessions", timeline_row)
                except Exception as e:  # a measurement aid: its failure is logged, the step's row stands
                    log(lines, f"  {sessions_n} {kind} sessions timeline failed: {type(e).__name__}: {str(e)[:300]}")
            log(lines, f"  {sessions_n} {kind} sessions: step {ms64:.3f} ms = {sessions_n * ms / ms64:.1f}x the "
                       f"tokens/s of one")  # fmt: skip
            bf16_many = results.get("llama3_8b_bf16", {}).get("step_many_ms")
            if kind == "nf4" and bf16_many:
                row["many_x_bf16"] = ms64 / bf16_many
                log(lines, f"  {sessions_n} nf4 / {sessions_n} bf16 sessions step = {ms64 / bf16_many:.2f}")
        if kind == "bf16":
            for s in one + many:
                s.close()
        if kind == "nf4":
            # two identical sessions merged in one step (plus others) must give identical rows
            twins = open_prefilled(engine, 0, prefix, gen)
            h0 = torch.randn(1, prefix, engine.hidden_size, device=dev, generator=gen).to(engine.dtype)
            for _ in range(2):
                s = engine.open_session(1, prefix + 8)
                engine.step(s, h0, 0)
                twins.append(s)
            x = torch.randn(1, 1, engine.hidden_size, device=dev, generator=gen).to(engine.dtype)
            outs = engine.decode_many([StepRequest(s, x, prefix) for s in twins] + [
                StepRequest(s, torch.randn_like(x), s.length_tokens) for s in many[:5]
            ])  # fmt: skip
            row["twins_identical"] = bool(torch.equal(outs[0], outs[1]))
            log(lines, f"  two identical nf4 sessions in one merged step: identical={row['twins_identical']}")
            for s in one + many + twins:
                s.close()
        results[f"llama3_8b_{kind}"] = row
        if kind == "bf16":
            bf16_ms = ms
        elif bf16_ms is not None:
            row["x_bf16"] = ms / bf16_ms
            log(lines, f"  {kind} / bf16 step = {ms / bf16_ms:.2f}")
        del engine, layers
        free_cache(dev)
    del dense
    free_cache(dev)


def bench_qwen3(results: dict, lines: list[str], bandwidth: float, prefix: int, layers_n: int, dev) -> None:
    from transformers import DynamicCache, Qwen3Config, Qwen3Model

    gen = torch.Generator(device=dev).manual_seed(1)
    spec = QWEN3_32B if dev.type == "cuda" else LlamaSpec(**{**vars(TINY), "qk_norm": True})
    layers = [random_layer(spec, dev, gen) for _ in range(layers_n)]
    engine, _ = make_engine(spec, layers, 1, kv_pool_bytes_for(spec, layers_n, 1, prefix + 64))
    floor = engine.model.weight_bytes() / bandwidth * 1000
    ms, _ = step_ms(engine, open_prefilled(engine, 1, prefix, gen), prefix)
    log(lines, f"qwen3-32b x{layers_n} bf16 corolla: step {ms:.3f} ms, floor {floor:.3f} ms ({ms / floor:.2f}x)")
    del engine
    free_cache(dev)
    config = Qwen3Config(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        num_hidden_layers=layers_n,
        vocab_size=128,
        max_position_embeddings=2048,
        rms_norm_eps=spec.rms_norm_eps,
    )
    config._attn_implementation = "sdpa"
    model = Qwen3Model(config).to(dev, torch.bfloat16).eval()
    with torch.inference_mode():
        cache = DynamicCache(config=config)
        model(inputs_embeds=torch.randn(1, prefix, spec.hidden_size, device=dev, dtype=torch.bfloat16),
              past_key_values=cache, use_cache=True)  # fmt: skip
        times = []
        for _ in range(30):
            x = torch.randn(1, 1, spec.hidden_size, device=dev, dtype=torch.bfloat16)
            sync(dev)
            start = time.perf_counter()
            model(inputs_embeds=x, past_key_values=cache, use_cache=True)
            sync(dev)
            times.append((time.perf_counter() - start) * 1000)
    hf_ms = sorted(times)[len(times) // 2]
    log(lines, f"qwen3-32b x{layers_n} transformers (sdpa, eager): step {hf_ms:.3f} ms ({hf_ms / ms:.1f}x corolla)")
    results["qwen3_32b"] = {"layers": layers_n, "step_ms": ms, "floor_ms": floor, "x_floor": ms / floor,
                            "transformers_ms": hf_ms}  # fmt: skip


def main() -> None:
    global STEPS, PROLOGUE_AB_PAIRS, KERNEL_CHOICES_DIR
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefix_tokens", type=int, default=512)
    parser.add_argument("--llama_layers", type=int, default=32)
    parser.add_argument("--qwen3_layers", type=int, default=4, help="0 skips the Qwen3 span")
    parser.add_argument("--sessions", type=int, default=64, help="NF4 sessions merged in one step")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--device", default="cuda", help="cpu only for a dry run of the code paths")
    parser.add_argument(
        "--kinds", default="bf16,nf4,int8", help="comma-separated subset of bf16,nf4,int8, run in this order"
    )
    parser.add_argument("--profile_steps", type=int, default=0, help="> 0: each kind's step under the profiler too")
    parser.add_argument("--timeline", action="store_true", help="each kind's step: its kernels by position in a layer")
    parser.add_argument("--host_split", action="store_true",
                        help="each kind's step: host and device parts, then the bare steps (CUDA)")  # fmt: skip
    parser.add_argument("--prologue_ab_pairs", type=int, default=PROLOGUE_AB_PAIRS,
                        help="alternated fused/separate prologue pairs of the quantized step; 0 skips them")  # fmt: skip
    parser.add_argument("--kernel_choices_dir", default=None,
                        help="the tuner's choices kept in this folder: a run after one that stored them times none "
                             "(an A/B of two engines on the same kernels)")  # fmt: skip
    args = parser.parse_args()
    KERNEL_CHOICES_DIR = args.kernel_choices_dir
    kinds = tuple(args.kinds.split(","))  # run in the order given (bf16 first for the x bf16 ratios)
    if not kinds or set(kinds) - {"bf16", "nf4", "int8"} or len(set(kinds)) < len(kinds):
        parser.error(f"--kinds takes a comma-separated subset of bf16,nf4,int8, got {args.kinds!r}")
    STEPS, PROLOGUE_AB_PAIRS = args.steps, args.prologue_ab_pairs
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    lines: list[str] = []
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    bandwidth = copy_bandwidth_bytes_per_s(dev) if dev.type == "cuda" else 1e10
    results: dict = {"device": name, "bandwidth_bytes_per_s": bandwidth, "prefix_tokens": args.prefix_tokens}
    log(lines, f"device {name}; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    bench_llama(
        results,
        lines,
        bandwidth,
        args.prefix_tokens,
        args.llama_layers,
        dev,
        args.sessions,
        kinds,
        args.profile_steps,
        args.timeline,
        args.host_split,
    )
    if args.qwen3_layers > 0:
        bench_qwen3(results, lines, bandwidth, args.prefix_tokens, args.qwen3_layers, dev)
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    base = args.out / f"quant-{name.lower().replace(' ', '-')}-{stamp}"
    base.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    base.with_suffix(".log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
