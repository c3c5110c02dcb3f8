"""LoRA adapters on the fast path, measured: `python -m benchmarks.engine.lora --out DIR`.

In one process on one card: a span of Llama-3-8B-shaped corolla blocks (random bf16 weights) carrying `--adapters`
rank-`--rank` LoRA adapters on q, k, v, o, gate, up and down. After a `--prefix_tokens` prefix per session, the
merged decode step (CUDA graphs, inputs on the GPU, host-timed median) of: 1 session on the base model, 1 session
on an adapter, 8 sessions on one adapter, 8 sessions on 8 different adapters and 8 base sessions; the torch ops one
decode step adds per layer for an adapted row (the CPU profiler on the same engine, eager); the same span's engine
without adapters at 1 and 8 sessions (what base rows should cost); each step's floor (weights + the distinct adapters' bytes + the KV prefix, / copy
bandwidth); and the plain path a user with adapters gets today (`benchmarks.common.contiguous_steps` per session with
peft-style `LoraLinear`s under `using_adapter`: sessions one after another, nothing merged). Also the engine's
output against the plain path's on the same prompt and token. `--shape tiny --device cpu` dry-runs the code."""

from __future__ import annotations

import argparse
import collections
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import LlamaConfig

from benchmarks.common.contiguous_steps import contiguous_step
from benchmarks.common.engine_steps import device_token_inputs, merged_decode_ms
from benchmarks.common.measure import copy_bandwidth_bytes_per_s, host_median_ms
from benchmarks.common.model import NAMED_SHAPES, random_blocks
from benchmarks.common.report import log
from corolla.engine.config import EngineConfig
from corolla.engine.span_engine import EngineSession, SpanEngine, StepRequest
from corolla.engine.spans.fast_llama import FastLlamaSpan
from corolla.engine.spans.fast_lora import SpanAdapters
from corolla.models.block_base import CorollaBlock
from corolla.models.lora import LoraWeights, add_adapter
from corolla.models.positions import RotaryEmbedding
from corolla.server.backend import SpanBackend

# aten ops that only make views or metadata (no kernel on a GPU)
NO_KERNEL_OPS = frozenset(
    f"aten::{op}"
    for op in "t transpose view slice select as_strided reshape _reshape_alias expand unsqueeze squeeze detach "
    "alias resolve_conj resolve_neg empty lift_fresh numpy_T".split()
)
MODULES = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]


def build_blocks(
    shape: str, layers: int, names: list[str], rank: int, dev: torch.device, dtype: torch.dtype
) -> tuple[LlamaConfig, list[CorollaBlock]]:
    """`layers` llama blocks with random weights on `dev`, each carrying every adapter of `names`."""
    config = replace(NAMED_SHAPES[shape], num_layers=layers).hf_config()
    h, inter = config.hidden_size, config.intermediate_size
    d = h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (inter, h), "up": (inter, h)}
    shapes["down"] = (h, inter)
    gen = torch.Generator().manual_seed(0)
    blocks = random_blocks(config, layers, dev, dtype)
    for i, block in enumerate(blocks):
        for name in names:
            weights = {}
            for module in MODULES:
                out_f, in_f = shapes[module.split(".")[1].removesuffix("_proj")]
                a = torch.randn(rank, in_f, generator=gen) / in_f**0.5
                b = torch.randn(out_f, rank, generator=gen) * 0.02
                weights[module] = (a, b, 2.0)
            add_adapter(block, name, LoraWeights("bench", i, weights))
    return config, blocks


def open_sessions(engine: SpanEngine, adapters: list[str], prefix: int, length: int, gen) -> list[EngineSession]:
    sessions = []
    for name in adapters:
        s = engine.open_session(1, length, adapter=name)
        engine.step(
            s, torch.randn(1, prefix, engine.hidden_size, device=engine.device, generator=gen).to(engine.dtype), 0
        )
        sessions.append(s)
    return sessions


def step_ms(engine: SpanEngine, sessions: list[EngineSession], prefix: int, steps: int, gen) -> float:
    """Median host time of one merged decode step of `sessions` (inputs on the device)."""
    inputs = device_token_inputs(engine, len(sessions), steps, gen)
    engine.decode_many([StepRequest(s, x, prefix) for s, x in zip(sessions, inputs[0], strict=True)])  # warm
    times = merged_decode_ms(engine, sessions, prefix, inputs)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def ops_per_step(engine: SpanEngine, name: str, prefix: int, gen) -> dict[str, int]:
    """aten ops (one kernel each on a GPU) that an adapted row adds to one eager decode step over the span's layers:
    the CPU profiler's counts for a session on adapter `name` minus those for a base session (each after one
    unprofiled step, so that cached per-step tables are built)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    counts = []
    for adapter in ("", name):
        with engine.open_session(1, prefix + 4, adapter=adapter) as session:
            h = engine.hidden_size
            engine.step(session, torch.randn(1, prefix, h, device=engine.device, generator=gen).to(engine.dtype), 0)
            token = torch.randn(1, 1, h, device=engine.device, generator=gen).to(engine.dtype)
            graphs, engine.graphs = engine.graphs, None  # eager: the graph replay would hide the ops
            try:
                engine.decode_many([StepRequest(session, token, prefix)])
                with profile(activities=activities) as prof:
                    engine.decode_many([StepRequest(session, token, prefix + 1)])
            finally:
                engine.graphs = graphs
        top: collections.Counter[str] = collections.Counter()
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                top["cuda kernels"] += 1  # what the GPU ran (the CUDA activity), beside the aten ops
                continue
            parent = event.cpu_parent
            outer = parent is None or not parent.name.startswith("aten::")  # nested ops run inside their caller
            if outer and event.name.startswith("aten::") and event.name not in NO_KERNEL_OPS:
                top[event.name] += 1
        counts.append(top)
    added = {op: counts[1][op] - counts[0][op] for op in counts[1] | counts[0]}
    return {op: n for op, n in sorted(added.items()) if n}


def prologue_plan(model: FastLlamaSpan, layer: int) -> dict[str, bool]:
    """Fused adapter form, single-row decode step of `layer`: projection -> whether its prologue runs inside both
    its GEMM and the adapters' shrink (tuned kernels for both) rather than once ahead of them."""
    if model.adapters is None:
        return {}
    w, plan = model.layers[layer], {}
    for projection, weight, prologue, residual in (
        ("qkv", w.w_qkv, "rmsnorm", False),
        ("gate_up", w.w_gate_up, "rmsnorm", False),
        ("down", w.w_down, "silu", True),
    ):
        p = model.adapters.layers[layer].get(projection)
        if p is not None and weight is not None:
            n, k = int(p.bt.shape[1]), int(p.a.shape[1])
            plan[projection] = model.prologue_fused(n, k, int(p.a.shape[0]), prologue, residual)
    return plan


def plain_round_ms(backend: SpanBackend, adapters: list[str], prefix: int, steps: int, gen) -> float:
    """Median time of one step of every session on the plain path, one session after another (as the plain executor
    runs sessions on different adapters)."""
    indices = sorted(backend.blocks)
    h, dev, dt = backend.hidden_size, backend.device, backend.dtype
    length = prefix + steps + 8
    caches = []
    for name in adapters:
        cache = [[d.make_zeros() for d in per] for per in backend.cache_descriptors(indices, 1, length)]
        x = torch.randn(1, prefix, h, device=dev, generator=gen).to(dt)
        contiguous_step(backend, x, cache, 0, name)
        caches.append(cache)
    tokens = iter([torch.randn(1, 1, h, device=dev, generator=gen).to(dt) for _ in range((steps + 1) * len(adapters))])
    position = [prefix]

    def one_round() -> None:
        for name, cache in zip(adapters, caches, strict=True):
            contiguous_step(backend, next(tokens), cache, position[0], name)
        position[0] += 1

    return host_median_ms(one_round, steps, dev)


@torch.inference_mode()
def agreement(engine: SpanEngine, backend: SpanBackend, name: str, prefix: int, gen) -> float:
    """Relative error of the engine's decode output against the plain path's (same prompt, token, adapter)."""
    indices = sorted(backend.blocks)
    h, dev, dt = engine.hidden_size, engine.device, engine.dtype
    prompt = torch.randn(1, prefix, h, device=dev, generator=gen).to(dt)
    token = torch.randn(1, 1, h, device=dev, generator=gen).to(dt)
    cache = [[d.make_zeros() for d in per] for per in backend.cache_descriptors(indices, 1, prefix + 8)]
    contiguous_step(backend, prompt, cache, 0, name)
    expected = contiguous_step(backend, token, cache, prefix, name)
    with engine.open_session(1, prefix + 8, adapter=name) as session:
        engine.step(session, prompt, 0)
        got = engine.step(session, token, prefix)
    return float((got.float() - expected.float()).norm() / expected.float().norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(NAMED_SHAPES), default="llama-3-8b")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--prefix_tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cpu only for a dry run of the code paths")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    lines: list[str] = []
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    bandwidth = copy_bandwidth_bytes_per_s(dev) if dev.type == "cuda" else 1e10
    names = [f"adapter{i}" for i in range(args.adapters)]
    n = args.sessions
    results: dict = {"device": card, "shape": args.shape, "layers": args.layers, "adapters": args.adapters}
    results.update(rank=args.rank, prefix_tokens=args.prefix_tokens, sessions=n, bandwidth_bytes_per_s=bandwidth)
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    base = args.out / f"lora-{args.shape}-{card.lower().replace(' ', '-')}-{stamp}"

    def save() -> None:  # after every section: a run cut short keeps what it measured
        base.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
        base.with_suffix(".log").write_text("\n".join(lines) + "\n")

    log(lines, f"device {card}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; {args.layers} {args.shape} layers, "
               f"{args.adapters} adapters of rank {args.rank} on q,k,v,o,gate,up,down")  # fmt: skip
    started = time.perf_counter()
    config, blocks = build_blocks(args.shape, args.layers, names, args.rank, dev, dtype)
    length = args.prefix_tokens + args.steps + 16
    page_tokens = 64
    pages = (n + 2) * -(-length // page_tokens) + 4
    kv_bytes_per_token = (
        2 * args.layers * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    )
    kv_bytes_per_token *= torch.empty((), dtype=dtype).element_size()
    engine_config = EngineConfig(
        kv_pool_bytes=pages * page_tokens * kv_bytes_per_token,
        max_seq_len_tokens=length,
        max_batch_rows=n,
        graph_buckets=tuple(sorted({1, n})),
    )
    gen = torch.Generator(device=dev).manual_seed(1)
    prefix_bytes = args.prefix_tokens * kv_bytes_per_token
    scenarios = {
        "1_base": [""],
        "1_adapter": [names[0]],
        f"{n}_one_adapter": [names[0]] * n,
        f"{n}_different_adapters": [names[i % len(names)] for i in range(n)],
        f"{n}_base": [""] * n,
    }

    def floor_ms(rows: list[str], one_adapter_bytes: int) -> float:
        distinct = len({r for r in rows if r})
        return (weight_bytes + distinct * one_adapter_bytes + len(rows) * prefix_bytes) / bandwidth * 1000

    mark = time.perf_counter()
    engine = SpanEngine.from_blocks(blocks, engine_config)
    engine.warmup()
    assert isinstance(engine.model, FastLlamaSpan)
    weight_bytes = engine.model.weight_bytes()
    results["weight_bytes"] = weight_bytes
    plan = prologue_plan(engine.model, 0)
    results["prologue_in_both_gemms"] = plan
    log(lines, f"engine built and warmed up in {time.perf_counter() - mark:.1f} s; "
               f"single-row prologue inside the base and shrink GEMMs: {plan}")  # fmt: skip
    adapters = engine.adapters
    assert isinstance(adapters, SpanAdapters)  # a FastLlamaSpan's: stacked
    one_adapter_bytes = adapters.nbytes() // adapters.num_adapters  # every adapter has the same ranks here
    results["stored_bytes"] = {"all": adapters.nbytes(), "one_adapter": one_adapter_bytes}
    log(lines, f"engine: stacks {adapters.nbytes() / 2**20:.0f} MiB (one adapter "
               f"{one_adapter_bytes / 2**20:.1f} MiB), shared with the blocks' LoraLinear")  # fmt: skip
    try:
        added = ops_per_step(engine, names[0], 8, gen)
    except RuntimeError as e:  # the profiler (CUPTI) missing on the device: say so, keep timing
        added = {}
        results["ops_per_step_error"] = str(e)
        log(lines, f"engine: op count failed: {e}")
    results["ops_per_step"] = added
    aten = {k.removeprefix("aten::"): v for k, v in added.items() if k.startswith("aten::")}
    kernels = f", {added['cuda kernels']} CUDA kernels" if "cuda kernels" in added else ""
    log(lines, f"engine: an adapted row adds per decode step over {args.layers} layers (eager) "
               f"{sum(aten.values())} aten ops{kernels}: " + ", ".join(f"{k} {v}" for k, v in aten.items()))  # fmt: skip
    rows_out: dict[str, dict[str, float]] = {}
    for scenario, rows in scenarios.items():
        sessions = open_sessions(engine, rows, args.prefix_tokens, length, gen)
        ms = step_ms(engine, sessions, args.prefix_tokens, args.steps, gen)
        for s in sessions:
            s.close()
        floor = floor_ms(rows, one_adapter_bytes)
        rows_out[scenario] = {"step_ms": ms, "floor_ms": floor, "x_floor": ms / floor}
        log(lines, f"engine {scenario:22s} {ms:7.3f} ms/step (floor {floor:.3f} ms, {ms / floor:.2f}x)")
    one, same = rows_out["1_adapter"]["step_ms"], rows_out[f"{n}_one_adapter"]["step_ms"]
    mixed = rows_out[f"{n}_different_adapters"]["step_ms"]
    rows_out["ratios"] = {"mixed_vs_1_adapter": mixed / one, "mixed_vs_same_adapter": mixed / same}
    log(lines, f"engine: {n} different adapters / 1 adapter step = {mixed / one:.2f}x; / {n} sessions on "
               f"one adapter = {mixed / same:.2f}x (target <= 1.5x)")  # fmt: skip
    results["engine"] = rows_out
    save()

    # the same span's engine without adapters: what base rows should cost
    assert engine is not None and isinstance(engine.model, FastLlamaSpan)
    rotary = getattr(blocks[0].get_submodule("attn"), "rotary", None)
    assert isinstance(rotary, RotaryEmbedding)
    inv_freq = rotary.inv_freq(dev, 0)  # [D/2] fp32
    bare = FastLlamaSpan(engine.model.spec, engine.model.layers, inv_freq, max_positions=engine.model.max_positions,
                         use_triton=engine.config.use_triton)  # fmt: skip
    bare.ops = engine.model.ops  # the kernels tuned at the first engine's warm-up
    del engine  # its pool and graphs
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    no_adapters = SpanEngine(bare, EngineConfig(**{**vars(engine_config), "tune_gemm": False}))
    no_adapters.warmup()
    results["engine_without_adapters"] = {}
    for scenario in ("1_base", f"{n}_base"):
        sessions = open_sessions(no_adapters, scenarios[scenario], args.prefix_tokens, length, gen)
        ms = step_ms(no_adapters, sessions, args.prefix_tokens, args.steps, gen)
        for s in sessions:
            s.close()
        results["engine_without_adapters"][scenario] = {"step_ms": ms}
        log(lines, f"engine without adapters {scenario:8s} {ms:7.3f} ms/step")
    del no_adapters
    save()

    backend = SpanBackend(dict(enumerate(blocks)), config=config, dtype=dtype, device=dev, adapters=tuple(names))
    agree_engine = SpanEngine.from_blocks(blocks, EngineConfig(**{**vars(engine_config), "tune_gemm": False}))
    rel = {name: agreement(agree_engine, backend, name, args.prefix_tokens, gen) for name in ("", names[1])}
    del agree_engine
    results["rel_err_engine_vs_plain"] = rel
    log(lines, "engine vs plain path, one decode step: " + ", ".join(f"{k or 'base'} {v:.4f}" for k, v in rel.items()))
    results["plain"] = {}
    for scenario in ("1_adapter", f"{n}_different_adapters"):
        ms = plain_round_ms(backend, scenarios[scenario], args.prefix_tokens, min(args.steps, 10), gen)
        results["plain"][scenario] = {"round_ms": ms}
        log(lines, f"plain path {scenario:22s} {ms:8.3f} ms per step of every session (one after another)")
        save()
    mixed = results["engine"][f"{n}_different_adapters"]["step_ms"]
    plain_mixed = results["plain"][f"{n}_different_adapters"]["round_ms"]
    results["mixed_speedup_vs_plain"] = plain_mixed / mixed
    log(lines, f"{n} sessions on {n} adapters: engine {mixed:.3f} ms vs plain {plain_mixed:.2f} ms "
               f"({plain_mixed / mixed:.1f}x); total {time.perf_counter() - started:.0f} s")  # fmt: skip
    save()


if __name__ == "__main__":
    main()
