"""A/B of the INT8 row GEMV's source on one card: `python -m benchmarks.engine.int8_kernel_ab --base TREE --out DIR`.

One INT8 engine over 32 random Llama-3-8B-shaped layers (benchmarks.engine.quant's, tuned with this tree's kernel),
then, alternated over `--rounds` rounds with graphs captured afresh for each: this tree's `int8_row_mma` against the one
of the checkout at TREE (its engine/quant/quant_int8_gemv.py loaded beside this tree's, compiled on this tree's CUDA
helpers) and any `--variants` sources, all on the same tuner choices. Per round and variant: each projection's one-row
call as the step makes it (the tuner's choice with its fused RMSNorm or gating; 32 layers' calls back to back in one
CUDA graph: us per layer call), and the batch-1 step (host-timed median of `benchmarks.engine.quant.STEPS`) and its
graph replayed alone. Writes a JSON and a log under --out."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common.measure import copy_bandwidth_bytes_per_s, event_median_ms
from benchmarks.common.report import log
from benchmarks.engine.quant import (
    LLAMA3_8B,
    STEPS,
    TINY,
    kv_pool_bytes_for,
    log_kernels,
    make_engine,
    open_prefilled,
    quantized,
    random_layer,
    step_ms,
)
from corolla.engine.kernels.graph_timing import graph_median_ms
from corolla.engine.kernels.quant_splits import PROLOGUES
from corolla.engine.quant import quant_int8_gemv
from corolla.engine.quant.quant_choices import quant_kernel
from corolla.engine.spans.fast_llama import LayerWeights

PREFIX_TOKENS = 512
GRAPH_REPS = 20  # replays of each projection's 32-call graph


def loaded_int8_row_mma(path: Path, name: str) -> Callable[..., torch.Tensor]:
    """`int8_row_mma` of the quant_int8_gemv.py at `path`, loaded as a module of its own (its kernels compiled on this
    tree's nvrtc_kernels.CUDA_HELPERS)."""
    spec = importlib.util.spec_from_file_location(f"{name}_quant_int8_gemv", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.int8_row_mma


def step_calls(engine, layers: list[LayerWeights], gen: torch.Generator) -> dict[str, tuple[str, Callable]]:
    """Per projection: (the tuner's choice, a call of all layers' one-row projections as the step makes them): w_qkv
    and w_gate_up with their RMSNorm fused or gated where the tuner chose it, w_o and w_down adding a residual."""
    ops = engine.model.ops
    dev, dtype, eps = engine.device, engine.dtype, engine.model.spec.rms_norm_eps
    calls = {}
    for name, norm, wanted in (("w_qkv", "ln1", "rmsnorm"), ("w_o", None, None), ("w_gate_up", "ln2", "gated"),
                               ("w_down", None, None)):  # fmt: skip
        n, k = getattr(layers[0], name).shape
        fused = ops.quant_fused.get(("int8", n, k, wanted)) if wanted else None
        choice = fused or ops.quant_small.get(("int8", n, k))
        if choice is None or choice[0] != "i8mma":
            continue  # not the row GEMV: nothing to compare
        prologue = PROLOGUES["rmsnorm"] if fused is not None else 0
        kernel_name, config = choice
        kernel = quant_kernel(kernel_name, config, prologue, gated=fused is not None and wanted == "gated")
        x = torch.randn(1, k, device=dev, dtype=dtype, generator=gen)  # [1, K]
        res = torch.randn(1, n, device=dev, dtype=dtype, generator=gen) if norm is None else None  # [1, N]
        weights = [(getattr(layer, name), getattr(layer, norm) if norm and fused else None) for layer in layers]
        label = f"{choice[1][:3]}" + (f" {wanted}" if fused is not None else "")
        calls[name] = (label, lambda kernel=kernel, x=x, res=res, weights=weights: [
            kernel(x, w, res, nw, eps) for w, nw in weights
        ])  # fmt: skip
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the baseline checkout (its src/corolla)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", nargs="*", default=[], metavar="NAME=FILE",
                        help="more quant_int8_gemv.py sources to alternate with the two (e.g. one knob of this tree's "
                             "off)")  # fmt: skip
    parser.add_argument("--device", default="cuda", help="cpu only for a dry run of the code paths (tiny layers)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    spec = LLAMA3_8B if dev.type == "cuda" else TINY
    lines: list[str] = []
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    bandwidth = copy_bandwidth_bytes_per_s(dev) if dev.type == "cuda" else 1e10
    log(lines, f"device {name}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; base {args.base}")
    gen = torch.Generator(device=dev).manual_seed(0)
    layers = [quantized(random_layer(spec, dev, gen), "int8") for _ in range(args.layers)]
    pool = kv_pool_bytes_for(spec, args.layers, 1, PREFIX_TOKENS + 64)
    engine, report = make_engine(spec, layers, 1, pool)
    floor = engine.model.weight_bytes() / bandwidth * 1000
    kernels = log_kernels(lines, "int8", report, layers[0], bandwidth)  # (this tree's kernel, every candidate)
    one = open_prefilled(engine, 1, PREFIX_TOKENS, gen)
    calls = step_calls(engine, layers, gen)
    base_file = args.base / "src" / "corolla" / "engine" / "quant" / "quant_int8_gemv.py"
    variants: dict[str, Callable[..., torch.Tensor]] = {
        "base": loaded_int8_row_mma(base_file, "base"),
        "this": quant_int8_gemv.int8_row_mma,
    }
    for item in args.variants:
        label, _, path = item.partition("=")
        variants[label] = loaded_int8_row_mma(Path(path), label)
    results: dict = {"device": name, "bandwidth_bytes_per_s": bandwidth, "floor_ms": floor, "kernels": kernels,
                     "rounds": []}  # fmt: skip
    try:
        for r in range(args.rounds):
            for label, fn in variants.items():
                quant_int8_gemv.int8_row_mma = fn  # quant_choices' kernels look it up at each call
                row: dict = {"round": r, "variant": label}
                for proj, (_choice, call) in calls.items():
                    row[f"{proj}_us"] = graph_median_ms(call, GRAPH_REPS) * 1000 / len(layers)
                if engine.graphs is not None:  # (None on the CPU)
                    engine.graphs.clear()  # captured again with this kernel
                    engine.graphs.capture_all()
                row["step_ms"] = step_ms(engine, one, PREFIX_TOKENS)[0]
                graph_run = functools.partial(engine.graphs.run, 1) if engine.graphs is not None else None
                row["replay_ms"] = event_median_ms(graph_run, STEPS) if graph_run is not None else float("nan")
                results["rounds"].append(row)
                projs = ", ".join(f"{p} {calls[p][0]} {row[f'{p}_us']:.2f}" for p in calls)
                log(lines, f"round {r} {label}: step {row['step_ms']:.3f} ms ({row['step_ms'] / floor:.3f}x floor "
                           f"{floor:.3f}), replay {row['replay_ms']:.3f} ms; us per layer call: {projs}")  # fmt: skip
    finally:
        quant_int8_gemv.int8_row_mma = variants["this"]
    for label in variants:
        rows = [row for row in results["rounds"] if row["variant"] == label]
        med = {key: sorted(row[key] for row in rows)[len(rows) // 2] for key in rows[0] if key.endswith(("_ms", "_us"))}
        results[f"median_{label}"] = med
        log(lines, f"median {label}: " + ", ".join(f"{key} {v:.3f}" for key, v in med.items()))
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    base = args.out / f"int8-kernel-ab-{name.lower().replace(' ', '-')}-{stamp}"
    base.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    base.with_suffix(".log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
