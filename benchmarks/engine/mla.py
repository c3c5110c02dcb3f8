"""GPU benchmark of the DeepSeek-V3 fast path at real layer shapes (random weights): `python -m
benchmarks.engine.mla --out DIR` (`--tiny --device cpu`: a dry run of every code path in seconds).

In one process, on one card: the copy bandwidth; transformers' own `DeepseekV3Model` layers (1 dense + N MoE, bf16,
sdpa) decoding at batch 1 after a prefix (then freed: the experts of one MoE layer take ~23 GB); corolla's plain
DeepSeek-V3 blocks built with the same shapes and their fast-path engine (`FastMlaSpan`: latent paged cache, CUDA
graphs) decoding the same way, against the floor (the bytes a batch-1 step reads: attention, dense MLP, routers,
the 8 chosen + shared experts / bandwidth); the engine's step against the plain blocks' step on the same input
(relative error, bf16). Writes a JSON and a log under --out."""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common.measure import copy_bandwidth_bytes_per_s, host_median_ms, sync
from benchmarks.common.model import default_dtype
from benchmarks.common.report import log
from corolla.engine.config import EngineConfig
from corolla.engine.span_engine import SpanEngine
from corolla.engine.spans.fast_mla import FastMlaSpan
from corolla.models.block_base import CorollaBlock
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DEEPSEEK_V3_SHAPES = dict(  # one DeepSeek-V3 / Kimi K2 decoder layer (the 671B model's)
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)
TINY_SHAPES = dict(  # --tiny: the same code paths at test sizes
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)


def make_config(shapes: dict, num_layers: int, max_positions: int):
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        **shapes,
        num_hidden_layers=num_layers,
        first_k_dense_replace=1,
        vocab_size=128,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        rope_interleave=True,
    )
    config._attn_implementation = "sdpa"
    return config


@torch.no_grad()
def randomize(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Matrices ~ N(0, 0.02), norms 1, the routers' choice bias ~ N(0, 0.01) (a parameter or a buffer)."""
    for name, buf in module.named_buffers():
        if "bias" in name and buf.is_floating_point():
            buf.normal_(0.0, 0.01, generator=gen)
    for name, p in module.named_parameters():
        if p.ndim >= 2:
            p.normal_(0.0, 0.02, generator=gen)
        elif "bias" in name:
            p.normal_(0.0, 0.01, generator=gen)
        else:
            p.fill_(1.0)


@torch.inference_mode()
def bench_transformers(config, device: torch.device, dtype: torch.dtype, prefix: int, steps: int) -> dict:
    """transformers' DeepseekV3Model layers: batch-1 decode step (host-timed, inputs on the device) after `prefix`."""
    from transformers import DeepseekV3Model, DynamicCache

    gen = torch.Generator(device=device).manual_seed(0)
    with torch.device("meta"), default_dtype(dtype):
        model = DeepseekV3Model(config)
    model = model.to_empty(device=device).eval()
    randomize(model, gen)
    model.rotary_emb = type(model.rotary_emb)(config).to(device)  # its inv_freq buffer, computed (not from meta)
    h = config.hidden_size
    cache = DynamicCache(config=config)
    model(inputs_embeds=torch.randn(1, prefix, h, device=device, dtype=dtype, generator=gen), past_key_values=cache)
    xs = [torch.randn(1, 1, h, device=device, dtype=dtype, generator=gen) for _ in range(steps + 3)]
    it = iter(xs)
    ms = host_median_ms(lambda: model(inputs_embeds=next(it), past_key_values=cache), steps + 3, device)
    experts_impl = getattr(config, "_experts_implementation", None)
    return {"step_ms": ms, "attn_implementation": "sdpa", "experts_implementation": str(experts_impl)}


def kernel_profile(span: FastMlaSpan, graphs, engine: SpanEngine, lines: list[str]) -> list[dict]:
    """Device time per kernel of one eager batch-1 decode step (the graph's inputs as last replayed), largest first:
    where the step's time goes (eager: the sum excludes the launch gaps the graph removes)."""
    from torch.profiler import ProfilerActivity, profile

    def step() -> None:
        inputs = graphs.inputs_for(1)
        span.decode(inputs.hidden[:1], inputs.positions[:1], inputs.block_tables[:1], engine.pool)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us = float(getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0))
        if us > 0:
            rows.append({"kernel": event.key[:90], "calls": int(event.count), "us": us})
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    log(lines, f"eager decode step kernels: {sum(r['calls'] for r in rows)} launches, {total / 1000:.3f} ms device")
    for r in rows[:14]:
        log(lines, f"  {r['us']:9.1f} us  x{r['calls']:<3d} {r['kernel']}")
    return rows


@torch.inference_mode()
def bench_corolla(config, device, dtype, args: argparse.Namespace, bandwidth: float, lines: list[str]) -> dict:
    from corolla.models.registry import get_family

    prefix, steps = args.prefix_tokens, args.steps
    gen = torch.Generator(device=device).manual_seed(1)
    family = get_family(config)
    with torch.device("meta"), default_dtype(dtype):
        blocks = [family.build_block(config, i) for i in range(config.num_hidden_layers)]
    for i, block in enumerate(blocks):
        blocks[i] = block.to_empty(device=device).to(dtype).eval()  # GroupLimitedMoE keeps its router in fp32
        randomize(blocks[i], gen)
    engine_config = EngineConfig(
        kv_pool_bytes=1 << 30,
        page_size_tokens=64,
        max_seq_len_tokens=prefix + steps + 64,
        graph_buckets=(1, 8),
        tune_gemm=not args.no_tune,
    )
    engine = SpanEngine.from_blocks(blocks, engine_config)
    assert isinstance(engine.model, FastMlaSpan)
    span: FastMlaSpan = engine.model
    started = time.perf_counter()
    tune = engine.warmup()
    log(
        lines,
        f"corolla warm-up (kernel tuning: {not args.no_tune}, graph capture): {time.perf_counter() - started:.1f} s",
    )
    active = span.active_weight_bytes()
    floor_ms = active / bandwidth * 1000
    h = config.hidden_size
    prompt = torch.randn(1, prefix, h, generator=torch.Generator().manual_seed(2)).to(dtype)
    tokens = [torch.randn(1, 1, h).to(dtype) for _ in range(steps + 5)]
    result: dict = {
        "active_bytes": active,
        "weight_bytes": span.weight_bytes(),
        "kv_bytes_per_token_per_layer": span.spec.kv_layout.bytes_per_token(dtype, 1),
        "floor_ms": floor_ms,
        "tuned_slots": len(tune),
        "graphs": engine.graphs is not None,
    }
    with engine.open_session(1, prefix + steps + 8) as session:
        engine.step(session, prompt, 0)
        for i in range(5):
            engine.step(session, tokens[i], prefix + i)
        pos = iter(range(prefix + 5, prefix + 5 + steps))
        it = iter(tokens[5:])
        result["step_ms"] = host_median_ms(lambda: engine.step(session, next(it), next(pos)), steps, device)
        if engine.graphs is not None:
            graphs = engine.graphs
            result["replay_ms"] = host_median_ms(lambda: graphs.run(1), 20, device)
            result["kernels"] = kernel_profile(span, graphs, engine, lines)
        if "experts" in tune:
            result["experts_config"] = tune["experts"]["best"]
        # the engine's decode step against the plain blocks' step on the same prefix and token
        plain = [b for b in blocks if isinstance(b, CorollaBlock)]
        caches = [[d.make_zeros() for d in b.cache_descriptors(1, prefix + 1)] for b in plain]
        ref = prompt.to(device)
        for b, c in zip(plain, caches, strict=True):
            ref = b(ref, cache=c, position=0)
        ref, x = tokens[0].to(device), tokens[0]
        for b, c in zip(plain, caches, strict=True):
            ref = b(ref, cache=c, position=prefix)
        got = engine.step(session, x, prefix).to(device)  # rollback to the prefix: rewrites position `prefix`
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        result["rel_error_vs_plain_blocks"] = err
    # eight sessions merged in one step
    opened = [engine.open_session(1, prefix + 16) for _ in range(8)]
    short = prompt[:, : min(prefix, 64)]
    for s in opened:
        engine.step(s, short, 0)
    from corolla.engine.span_engine import StepRequest

    n = short.shape[1]
    counter = iter(range(10_000))

    def merged_step() -> None:
        k = next(counter)
        engine.decode_many([StepRequest(s, tokens[k % len(tokens)], n + k) for s in opened])

    result["merged8_step_ms"] = host_median_ms(merged_step, min(steps, 12), device)
    for s in opened:
        s.close()
    if args.long_max_tokens:
        runs = [("kernel", args.long_max_tokens), ("torch", args.long_max_tokens), ("kernel", prefix + steps + 64)]
        for attention, max_tokens in runs if span.kernels is not None else runs[1:2]:
            name = f"{'long' if max_tokens == args.long_max_tokens else 'short'}_{attention}"
            try:  # short_kernel: the same untuned engine at the main engine's max length (the control)
                result[name] = bench_long_max(blocks, span, attention, max_tokens, args, device, lines)
            except Exception as e:  # recorded and shown (e.g. the torch path out of memory), the run goes on
                result[name] = {"error": repr(e)}
                log(lines, f"{name}: FAILED {e!r}")
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    log(
        lines,
        f"corolla fast path: step {result['step_ms']:.3f} ms (graph replay {result.get('replay_ms', float('nan')):.3f}"
        f" ms), floor {floor_ms:.3f} ms ({active / 1e9:.2f} GB active of {result['weight_bytes'] / 1e9:.1f} GB) -> "
        f"{result['step_ms'] / floor_ms:.2f}x floor; 8 sessions merged: {result['merged8_step_ms']:.3f} ms; "
        f"rel. error vs plain blocks {result['rel_error_vs_plain_blocks']:.2e}",
    )
    return result


@torch.inference_mode()
def bench_long_max(blocks, tuned: FastMlaSpan, attention: str, max_tokens: int, args, device, lines: list[str]) -> dict:
    """An engine over the same blocks allowing `max_tokens` per row with graph buckets `--long_buckets`
    (the tuned span's kernel choices copied, no re-tuning), attention by the Triton kernel or the torch reference:
    the memory its warm-up (graph capture) takes beyond the pool, and the batch-1 step after the same prefix."""
    buckets = tuple(int(b) for b in args.long_buckets.split(","))
    config = EngineConfig(
        kv_pool_bytes=1 << 30,
        page_size_tokens=64,
        max_seq_len_tokens=max_tokens,
        max_batch_rows=max(buckets),
        graph_buckets=buckets,
        tune_gemm=False,
    )
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    engine = SpanEngine.from_blocks(blocks, config)
    span = engine.model
    assert isinstance(span, FastMlaSpan)
    span.ops.single_row_gemm.update(tuned.ops.single_row_gemm)
    span.expert_config = tuned.expert_config
    span.use_attention_kernels = attention == "kernel"
    started = time.perf_counter()
    engine.warmup()
    warm_s = time.perf_counter() - started
    pool_bytes = sum(t.numel() * t.element_size() for t in (engine.pool.k, engine.pool.v))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    h, prefix = span.spec.hidden_size, args.prefix_tokens
    prompt = torch.randn(1, prefix, h, generator=torch.Generator().manual_seed(2)).to(span.dtype)
    tokens = [torch.randn(1, 1, h).to(span.dtype) for _ in range(args.steps + 5)]
    with engine.open_session(1, prefix + args.steps + 8) as session:
        engine.step(session, prompt, 0)
        for i in range(5):
            engine.step(session, tokens[i], prefix + i)
        pos, it = iter(range(prefix + 5, prefix + 5 + args.steps)), iter(tokens[5:])
        step_ms = host_median_ms(lambda: engine.step(session, next(it), next(pos)), args.steps, device)
        replay_big = None
        if engine.graphs is not None:
            graphs = engine.graphs
            replay_big = host_median_ms(lambda: graphs.run(max(buckets)), 10, device)
    result = {
        "attention": attention,
        "max_seq_len_tokens": engine.max_seq_len_tokens,
        "graph_buckets": buckets,
        "warmup_s": warm_s,
        "warmup_peak_bytes_beyond_pool": peak - before - pool_bytes if device.type == "cuda" else None,
        "step_ms": step_ms,
        f"replay_{max(buckets)}_rows_ms": replay_big,
    }
    log(
        lines,
        f"max length {engine.max_seq_len_tokens}, buckets {buckets}, {attention} attention: warm-up {warm_s:.1f} s, "
        f"peak {(peak - before - pool_bytes) / 2**20:.0f} MiB beyond the pool; batch-1 step "
        f"{step_ms:.3f} ms (prefix {prefix}); {max(buckets)}-row graph replay {replay_big} ms",
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--moe_layers", type=int, default=2, help="MoE layers after the one dense layer")
    parser.add_argument("--prefix_tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cuda", help="cpu only for a dry run (with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="test-sized layers instead of DeepSeek-V3's")
    parser.add_argument("--skip_transformers", action="store_true")
    parser.add_argument("--no_tune", action="store_true", help="cuBLAS for every projection (no kernel timing)")
    parser.add_argument("--long_max_tokens", type=int, default=8192, help="0: skip the long max-length engines")
    parser.add_argument("--long_buckets", default="1,8,64", help="graph buckets of the long max-length engines")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    positions = max(4096, args.long_max_tokens)  # the engines cap their max length at the config's positions
    config = make_config(TINY_SHAPES if args.tiny else DEEPSEEK_V3_SHAPES, 1 + args.moe_layers, positions)
    lines: list[str] = []
    bandwidth = copy_bandwidth_bytes_per_s(dev) if dev.type == "cuda" else 1e10
    results: dict = {
        "device": name,
        "bandwidth_bytes_per_s": bandwidth,
        "prefix_tokens": args.prefix_tokens,
        "layers": f"1 dense + {args.moe_layers} MoE",
        "shapes": "tiny" if args.tiny else "deepseek_v3",
        "dtype": str(dtype),
    }
    log(lines, f"device {name}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; {results['layers']} layers, {dtype}")
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    base = args.out / f"mla-{name.lower().replace(' ', '-')}-{stamp}"

    def save() -> None:  # after every phase: a later failure keeps what was measured
        base.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
        base.with_suffix(".log").write_text("\n".join(lines) + "\n")

    phases = [("corolla", lambda: bench_corolla(config, dev, dtype, args, bandwidth, lines))]
    if not args.skip_transformers:  # first: its experts and ours do not fit on one card together
        phases.insert(
            0, ("transformers", lambda: bench_transformers(config, dev, dtype, args.prefix_tokens, args.steps))
        )
    for phase, run in phases:
        started = time.perf_counter()
        try:
            results[phase] = run()
        except Exception as e:  # recorded and shown, never hidden: the run goes on to the next phase
            results[phase] = {"error": repr(e), "traceback": traceback.format_exc()}
            log(lines, f"{phase}: FAILED {e!r}")
        results[phase]["phase_s"] = time.perf_counter() - started
        gc.collect()  # the phase's model is unreachable now: give its memory back before the next one
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            results[phase]["memory_left_allocated_bytes"] = torch.cuda.memory_allocated(dev)
        if phase == "transformers" and "step_ms" in results[phase]:
            log(lines, f"transformers DeepseekV3Model layers: step {results[phase]['step_ms']:.3f} ms")
        save()
    if "step_ms" in results.get("transformers", {}) and "step_ms" in results["corolla"]:
        speedup = results["transformers"]["step_ms"] / results["corolla"]["step_ms"]
        results["speedup_vs_transformers"] = speedup
        log(lines, f"corolla / transformers step: {speedup:.1f}x faster")
    save()


if __name__ == "__main__":
    main()
