"""Falcon and BLOOM on the fast path, measured: `python -m benchmarks.engine.dense --out DIR`.

In one process on one card: the copy bandwidth; for each shape (Falcon-7B: 71 query heads and one KV head, rotary,
parallel attention, no biases; BLOOM-7b1: 32 heads, ALiBi, biases, sequential residual) a span of a few layers
with random bf16 weights, built as transformers' `FalconModel` / `BloomModel` and loaded into our blocks (the
engine reads the blocks' tensors in place), after a 512-token prefix: the engine's step at 1 session and at 8
sessions merged in one step (host-timed through `decode_many`, and the CUDA graph's replay alone on device events),
each against its floor (weight bytes + the KV prefix the step reads, / bandwidth) and against transformers'
forward of the same layers with a `DynamicCache` at the same batch; and the engine's output against transformers'
on the same inputs, in the same dtype and in float32. `--shapes tiny-falcon,tiny-bloom --device cpu` dry-runs the code paths."""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from benchmarks.common.engine_steps import device_token_inputs, merged_decode_ms
from benchmarks.common.hf_steps import hf_step_ms
from benchmarks.common.measure import copy_bandwidth_bytes_per_s, event_median_ms
from benchmarks.common.model import default_dtype
from benchmarks.common.report import log
from benchmarks.engine.quant import log_timeline, step_timeline
from corolla.engine.config import EngineConfig
from corolla.engine.span_engine import SpanEngine
from corolla.engine.spans.fast_dense import DenseSpec
from corolla.models.block_base import CorollaBlock
from corolla.models.registry import get_family

FALCON_7B = dict(
    num_attention_heads=71, multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False
)
SHAPES: dict[str, tuple[str, dict]] = {
    "falcon-7b": ("falcon", dict(hidden_size=4544, **FALCON_7B)),
    "bloom-7b1": ("bloom", dict(hidden_size=4096, n_head=32)),
    "tiny-falcon": ("falcon", dict(hidden_size=128, **{**FALCON_7B, "num_attention_heads": 4})),
    "tiny-bloom": ("bloom", dict(hidden_size=128, n_head=4)),
}


def hf_model(shape: str, layers: int, device: torch.device, dtype: torch.dtype):
    """transformers' FalconModel / BloomModel of `layers` layers, random weights built in `dtype` on `device`."""
    import transformers as tf

    family, fields = SHAPES[shape]
    if family == "falcon":
        config = tf.FalconConfig(**fields, num_hidden_layers=layers, vocab_size=32, alibi=False)
        model_cls = tf.FalconModel
    else:
        config = tf.BloomConfig(**fields, n_layer=layers, vocab_size=32)
        model_cls = tf.BloomModel
    with default_dtype(dtype), torch.device(device):
        torch.manual_seed(0)
        model = model_cls(config).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():  # our own init, whatever the transformers version initializes
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.02, generator=gen)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)
    return model


def our_blocks(model, device: torch.device, dtype: torch.dtype) -> list[torch.nn.Module]:
    """Our Falcon/BLOOM blocks holding the transformers layers' weights (BLOOM's and Falcon's qkv rows reordered
    by the blocks' checkpoint layout, as when a server loads a checkpoint)."""
    config = model.config
    family = get_family(config)
    blocks: list[torch.nn.Module] = []
    for i, layer in enumerate(model.h):
        with torch.device(device):
            block = family.build_block(config, i).to(dtype)
        assert isinstance(block, CorollaBlock)
        block.load_hf_state_dict(layer.state_dict())
        blocks.append(block.eval())
    return blocks


def model_input(model, x: torch.Tensor) -> torch.Tensor:
    """What the first layer sees for `inputs_embeds` x (BLOOM normalizes the embeddings first)."""
    norm = getattr(model, "word_embeddings_layernorm", None)
    return x if norm is None else norm(x)


def _hf_decode(model, prompt: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(inputs_embeds=prompt, past_key_values=cache)
    return model(inputs_embeds=token, past_key_values=cache).last_hidden_state


@torch.inference_mode()
def agreement(engine: SpanEngine, model, prefix: int, gen: torch.Generator) -> dict:
    """Relative errors of one decode step after a `prefix`-token prompt (outputs through the model's final
    LayerNorm, which the span does not hold): the engine against transformers in the same dtype and against
    transformers in float32 (a copy of the same weights), and transformers' own dtype against its float32."""
    h, dev, dt = engine.hidden_size, engine.device, engine.dtype
    prompt = torch.randn(1, prefix, h, device=dev, generator=gen).to(dt)
    token = torch.randn(1, 1, h, device=dev, generator=gen).to(dt)
    expected = _hf_decode(model, prompt, token).float()
    with engine.open_session(1, prefix + 8) as session:
        engine.step(session, model_input(model, prompt), 0)
        got = model.ln_f(engine.step(session, model_input(model, token), prefix)).float()
    model32 = copy.deepcopy(model).float()
    exact = _hf_decode(model32, prompt.float(), token.float())
    del model32

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    return {
        "engine_vs_transformers": rel(got, expected),
        "engine_vs_transformers_fp32": rel(got, exact),
        "transformers_vs_transformers_fp32": rel(expected, exact),
    }


def engine_step_ms(engine: SpanEngine, sessions: list, prefix: int, steps: int, gen: torch.Generator) -> dict:
    """Median merged decode step of `sessions` (GPU inputs, CUDA graphs where the device has them), and the
    device time of replaying that step's graph alone."""
    times = merged_decode_ms(engine, sessions, prefix, device_token_inputs(engine, len(sessions), steps, gen))
    result = {"step_ms": sorted(times)[len(times) // 2]}
    if engine.graphs is not None:  # replays rewrite the last step's KV slots with the same values: harmless
        graphs, rows = engine.graphs, len(sessions)
        result["replay_ms"] = event_median_ms(lambda: graphs.run(rows), steps)
    return result


def bench_shape(shape: str, args, dev: torch.device, dtype: torch.dtype, bandwidth: float, lines: list[str]) -> dict:
    gen = torch.Generator(device=dev).manual_seed(1)
    model = hf_model(shape, args.layers, dev, dtype)
    blocks = our_blocks(model, dev, dtype)
    per_token = DenseSpec.from_block(blocks[0]).kv_layout.bytes_per_token(dtype, args.layers)
    pool_tokens = (args.sessions + 1) * (args.prefix_tokens + args.steps + 8 + 64)  # + a page of rounding each
    engine = SpanEngine.from_blocks(
        blocks,
        EngineConfig(
            kv_pool_bytes=max(1 << 30, pool_tokens * per_token),
            max_seq_len_tokens=1024,
            max_batch_rows=args.sessions,
            graph_buckets=tuple(sorted({1, args.sessions})),
        ),
    )
    tuned = engine.warmup()
    result: dict = {
        "layers": args.layers,
        "prefix_tokens": args.prefix_tokens,
        "weight_bytes": engine.model.weight_bytes(),
    }
    result["tuned"] = {str(k): {"best": str(r["best"]), "best_us": r["best_us"]} for k, r in tuned.items()}
    for key, r in tuned.items():
        log(lines, f"{shape} tune {key}: {r['best']} {r['best_us']:.1f} us")
    if not args.skip_transformers:
        rel = agreement(engine, model, args.prefix_tokens, gen)
        result["rel_err"] = rel
        log(lines, f"{shape}: one decode step, relative error: engine vs transformers "
                   f"{rel['engine_vs_transformers']:.4f}, engine vs transformers fp32 "
                   f"{rel['engine_vs_transformers_fp32']:.4f}, transformers vs its fp32 "
                   f"{rel['transformers_vs_transformers_fp32']:.4f}")  # fmt: skip
    kv_per_row = engine.model.spec.kv_layout.bytes_per_token(dtype, args.layers) * args.prefix_tokens
    for batch in sorted({1, args.sessions}):
        sessions = []
        for _ in range(batch):
            s = engine.open_session(1, args.prefix_tokens + args.steps + 8)
            prompt = torch.randn(1, args.prefix_tokens, engine.hidden_size, device=dev, generator=gen).to(dtype)
            engine.step(s, prompt, 0)
            sessions.append(s)
        measured = engine_step_ms(engine, sessions, args.prefix_tokens, args.steps, gen)
        if args.timeline and batch == 1 and dev.type == "cuda":
            measured["timeline"] = step_timeline(engine, sessions, args.prefix_tokens, args.layers)
            log_timeline(lines, f"{shape} batch 1", measured["timeline"])
            tl = measured["timeline"]
            log(
                lines,
                f"  {shape} batch 1 kernels by name (step's first kernel start to last end {tl['step_us']:.0f} us):",
            )
            for name, k in sorted(tl["by_name"].items(), key=lambda kv: -kv[1]["per_step"] * kv[1]["us"]):
                log(
                    lines,
                    f"    {k['per_step']:4d} x {k['us']:7.2f} us = {k['per_step'] * k['us']:8.1f} us  {name[:80]}",
                )
        for s in sessions:
            s.close()
        floor_bytes = result["weight_bytes"] + batch * kv_per_row
        floor_ms = floor_bytes / bandwidth * 1000
        row = {**measured, "floor_ms": floor_ms, "floor_bytes": floor_bytes, "x_floor": measured["step_ms"] / floor_ms}
        hf = ""
        if not args.skip_transformers:
            row["transformers_ms"] = hf_ms = hf_step_ms(model, batch, args.prefix_tokens, args.steps, gen)
            row["speedup_vs_transformers"] = hf_ms / measured["step_ms"]
            hf = f", transformers {hf_ms:.2f} ms (the engine {row['speedup_vs_transformers']:.1f}x faster)"
        if "replay_ms" in measured:
            row["replay_x_floor"] = measured["replay_ms"] / floor_ms
        result[f"batch_{batch}"] = row
        replay = f", graph replay {row['replay_ms']:.3f} ms" if "replay_ms" in row else ""
        log(lines, f"{shape} batch {batch}: engine {row['step_ms']:.3f} ms/step{replay}, floor {floor_ms:.3f} ms "
                   f"({row['x_floor']:.2f}x){hf}")  # fmt: skip
    del engine, blocks, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="falcon-7b,bloom-7b1", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prefix_tokens", type=int, default=512)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cpu only for a dry run of the code paths")
    parser.add_argument("--skip_transformers", action="store_true", help="no transformers timings or agreement")
    parser.add_argument("--timeline", action="store_true", help="the batch-1 step's kernels by position in a layer")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        raise SystemExit(f"unknown shapes {unknown}; choose from {sorted(SHAPES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    bandwidth = copy_bandwidth_bytes_per_s(dev) if dev.type == "cuda" else 1e10
    lines: list[str] = []
    results: dict = {"device": name, "bandwidth_bytes_per_s": bandwidth, "shapes": {}}
    log(lines, f"device {name}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; {args.layers} layers per span")
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    base = args.out / f"dense-{name.lower().replace(' ', '-')}-{args.layers}l-{stamp}"
    for shape in shapes:
        results["shapes"][shape] = bench_shape(shape, args, dev, dtype, bandwidth, lines)
        base.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))  # a cut run keeps its rows
        base.with_suffix(".log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
