"""Does stretch verification's tolerance ever ban an honest server? (issue 37, `client.verification.stretches`):
`python -m benchmarks.field.verify_tolerance --out DIR` on a GPU (`--tiny` dry-runs the code on the CPU in seconds).

An honest server answers a session step by step: prefill, then single-token decode steps through the engine's fused
kernels (Triton on CUDA) over its paged KV pool, many sessions merged per step. A replica checking a stretch
recomputes the span's inputs for positions [0, b) in ONE forward with other kernels (here: the same weights on the
engine's torch kernels, `use_triton=False`, a fresh session). Stretch verification compares every position's output
by its relative L2 error (`stretches.position_errors`) against `output_checks.verify_rtol(dtype, quantized=)`; one
position over it, outvoted by a second replica, bans the server. For each of bf16 and NF4 weights (corolla's own NF4
kernels: `benchmarks.common.quantize.quantize_nf4`), `--sessions` sessions of `--prompt` + `--steps` tokens (64 x 160 = 10,240
decode positions: more than 10,000 verified steps), random Llama-3-8B-shaped layers (`--layers`), random inputs:
the largest per-position error, its 99.9th percentile, the tolerance, and whether an honest server would be banned."""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import LlamaConfig

from benchmarks.engine.quant import LLAMA3_8B, TINY, kv_pool_bytes_for, quantized, random_layer
from corolla.client.calls.output_checks import verify_rtol
from corolla.client.verification.stretches import position_errors
from corolla.engine.config import EngineConfig
from corolla.engine.span_engine import SpanEngine, StepRequest
from corolla.engine.spans.fast_llama import FastLlamaSpan, LayerWeights, LlamaSpec


def engine_over(
    spec: LlamaSpec,
    layers: list[LayerWeights],
    *,
    triton: bool,
    rows: int,
    tokens: int,
    graphs: bool = False,
    buckets: tuple[int, ...] = (),
) -> SpanEngine:
    """An engine over `layers` whose pool holds `rows` sessions of `tokens` tokens (no kernel tuning: the default
    kernels; a server's tuner picks among kernels computing the same sums; `graphs`: decode steps of `rows` rows, or
    of each of `buckets` rows, replay a CUDA graph, as a server's do); a merged forward holds `rows` rows, or the
    largest bucket's."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float32) / spec.head_dim))
    model = FastLlamaSpan(spec, layers, inv_freq, max_positions=tokens + 64, use_triton=triton)
    config = EngineConfig(
        kv_pool_bytes=kv_pool_bytes_for(spec, len(layers), rows, tokens), max_seq_len_tokens=tokens + 64,
        max_batch_rows=max((rows, *buckets)), graph_buckets=buckets or (rows,), use_cuda_graphs=graphs, tune_gemm=False,
    )  # fmt: skip
    return SpanEngine(model, config)


def standin_backend(spec: LlamaSpec, layers: int, device: torch.device) -> SimpleNamespace:
    """What `EngineExecutor` reads of a `SpanBackend` beside the engine (its training batcher's sizing): block indices
    and (no) blocks, device, the model's config. No training runs here."""
    config = LlamaConfig(
        hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, num_hidden_layers=layers,
    )  # fmt: skip
    return SimpleNamespace(
        block_indices=tuple(range(layers)), blocks={}, device=device, config=config, dtype=torch.bfloat16
    )


@torch.inference_mode()
def measure(spec: LlamaSpec, layers: list[LayerWeights], args: argparse.Namespace, quantized_weights: bool) -> dict:
    device = layers[0].ln1.device
    total = args.prompt + args.steps
    gen = torch.Generator(device=device).manual_seed(11)
    inputs = torch.randn(args.sessions, total, spec.hidden_size, device=device, generator=gen).to(torch.bfloat16)
    started = time.perf_counter()
    server = engine_over(spec, layers, triton=device.type == "cuda", rows=args.sessions, tokens=total)
    sessions = [server.open_session(1, total) for _ in range(args.sessions)]
    claimed = torch.empty(args.sessions, args.steps, spec.hidden_size, dtype=torch.bfloat16, device=device)
    for i, session in enumerate(sessions):  # the prompt: one prefill per session
        server.step(session, inputs[i : i + 1, : args.prompt], 0)
    for t in range(args.steps):  # then one merged single-token step of every session per position
        position = args.prompt + t
        reqs = [StepRequest(s, inputs[i : i + 1, position : position + 1], position) for i, s in enumerate(sessions)]
        for i, out in enumerate(server.decode_many(reqs)):
            claimed[i, t] = out[0, 0]
    for session in sessions:
        session.close()
    del server
    replica = engine_over(spec, layers, triton=False, rows=1, tokens=total)
    errors = []
    for i in range(args.sessions):  # the replica's one forward over [0, b) per stretch (a fresh session each)
        with replica.open_session(1, total) as session:
            recomputed = replica.step(session, inputs[i : i + 1], 0)[:, args.prompt :]  # [1, steps, H]
        errors.append(position_errors(claimed[i : i + 1], recomputed)[0])  # [steps]
    if device.type == "cuda":
        torch.cuda.synchronize()
    error = torch.cat(errors).float().cpu()  # [sessions * steps]
    rtol = verify_rtol(torch.bfloat16, quantized=quantized_weights)
    return {
        "weights": "nf4" if quantized_weights else "bf16",
        "positions_compared": int(error.numel()),
        "max_error": float(error.max()),
        "p999_error": float(error.quantile(0.999)),
        "median_error": float(error.median()),
        "tolerance": rtol,
        "margin_x": rtol / max(float(error.max()), 1e-12),
        "honest_server_banned": bool((error > rtol).any()),
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (dry run)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--kinds", default="bf16,nf4")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    spec = TINY if args.tiny else LLAMA3_8B
    gen = torch.Generator(device=device).manual_seed(0)
    base = [random_layer(spec, device, gen) for _ in range(args.layers)]
    name = platform.processor() or "cpu" if args.tiny else torch.cuda.get_device_name(device)
    print(f"{args.layers} layers of {'tiny' if args.tiny else 'Llama-3-8B'} shape on {name}", flush=True)
    results = []
    for kind in args.kinds.split(","):
        layers = base if kind == "bf16" else [quantized(layer, "nf4") for layer in base]
        result = {"device": name, "layers": args.layers, **measure(spec, layers, args, kind == "nf4")}
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "verify_tolerance.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
