"""The A/B of one quantized kernel's source file on one card, shared by `nf4_kernel_ab` (the NF4 tile GEMV) and
`int8_kernel_ab` (the INT8 row GEMV): one engine of `kind` over random Llama-3-8B-shaped layers (benchmarks.engine.quant's,
tuned with this tree's kernel), then, alternated over `--rounds` rounds with graphs captured afresh for each, this
tree's kernel function against the one of the checkout at `--base` (its source file loaded beside this tree's,
compiled on this tree's CUDA helpers) and any `--variants` sources, all on the same tuner choices. Per round and
variant: each call of the kind's `step_calls` (32 layers' calls back to back in one CUDA graph: us per layer call),
the batch-1 step (host-timed median of `benchmarks.engine.quant.STEPS`) and its graph replayed alone; every variant's
outputs are checked `torch.equal` to the baseline's. Writes a JSON and a log under `--out`; `--device cpu` dry-runs the
code paths on tiny layers."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from benchmarks.common.measure import event_median_ms
from benchmarks.common.report import log
from benchmarks.engine.quant import STEPS, log_kernels, open_prefilled, random_quantized_engine, step_ms
from corolla.engine.kernels.graph_timing import graph_median_ms
from corolla.engine.spans.fast_llama import LayerWeights

PREFIX_TOKENS = 512
GRAPH_REPS = 20  # replays of each projection's 32-call graph

# per projection: (a label for the log, "" for none; a call of all layers' one-row projections returning their outputs)
StepCalls = Callable[[Any, list[LayerWeights], torch.Generator], dict[str, tuple[str, Callable[[], list]]]]


def loaded_kernel(path: Path, name: str, function: str) -> Callable[..., torch.Tensor]:
    """`function` of the kernel source at `path`, loaded as a module of its own named after `name` (its kernels
    compiled on this tree's nvrtc_kernels.CUDA_HELPERS)."""
    spec = importlib.util.spec_from_file_location(f"{name}_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, function)


def call_ms(call: Callable[[], list], device: torch.device) -> float:
    """Median milliseconds of `call`: a CUDA graph's replays on a card, host-timed on the CPU (a dry run)."""
    if device.type == "cuda":
        return graph_median_ms(call, GRAPH_REPS)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[1]


def main(description: str, kind: str, module: ModuleType, function: str, step_calls: StepCalls) -> None:
    """The A/B of `module`'s `function` (this tree's `kind` kernel, looked up by the engine at each call) against the
    same file of `--base` and `--variants`."""
    source = Path(module.__file__ or "").name
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--base", type=Path, required=True, help="the baseline checkout (its src/corolla)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", nargs="*", default=[], metavar="NAME=FILE",
                        help=f"more {source} sources to alternate with the two")  # fmt: skip
    parser.add_argument("--device", default="cuda", help="cpu only for a dry run of the code paths (tiny layers)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    lines: list[str] = []
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    engine, report, layers, bandwidth = random_quantized_engine(kind, dev, args.layers, 1, PREFIX_TOKENS, gen)
    log(lines, f"device {name}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; base {args.base}")
    floor = engine.model.weight_bytes() / bandwidth * 1000
    kernels = log_kernels(lines, kind, report, layers[0], bandwidth)  # (this tree's kernel, every candidate)
    one = open_prefilled(engine, 1, PREFIX_TOKENS, gen)
    calls = step_calls(engine, layers, gen)
    base_file = args.base / "src" / Path(*module.__name__.split(".")).with_suffix(".py")
    this = getattr(module, function)
    variants: dict[str, Callable[..., torch.Tensor]] = {
        "base": loaded_kernel(base_file, "base", function),
        "this": this,
    }
    for item in args.variants:
        label, _, path = item.partition("=")
        variants[label] = loaded_kernel(Path(path), label, function)
    results: dict = {"device": name, "bandwidth_bytes_per_s": bandwidth, "floor_ms": floor, "kernels": kernels,
                     "rounds": [], "equal": {}}  # fmt: skip
    expected: dict[str, list[torch.Tensor]] = {}
    try:
        for r in range(args.rounds):
            for label, fn in variants.items():
                setattr(module, function, fn)  # the engine's ops and quant_choices look it up at each call
                row: dict = {"round": r, "variant": label}
                for proj, (_, call) in calls.items():
                    outs = [t.clone() for t in call()]
                    if proj not in expected:
                        expected[proj] = outs  # the first variant's (the baseline's)
                    same = all(torch.equal(a, b) for a, b in zip(expected[proj], outs, strict=True))
                    results["equal"][f"{label} {proj}"] = results["equal"].get(f"{label} {proj}", True) and same
                    row[f"{proj}_us"] = call_ms(call, dev) * 1000 / len(layers)
                if engine.graphs is not None:  # (None on the CPU)
                    engine.graphs.clear()  # captured again with this kernel
                    engine.graphs.capture_all()
                row["step_ms"] = step_ms(engine, one, PREFIX_TOKENS)[0]
                graph_run = functools.partial(engine.graphs.run, 1) if engine.graphs is not None else None
                row["replay_ms"] = event_median_ms(graph_run, STEPS) if graph_run is not None else float("nan")
                results["rounds"].append(row)
                projs = ", ".join(f"{p}{' ' + calls[p][0] if calls[p][0] else ''} {row[f'{p}_us']:.2f}" for p in calls)
                log(lines, f"round {r} {label}: step {row['step_ms']:.3f} ms ({row['step_ms'] / floor:.3f}x floor "
                           f"{floor:.3f}), replay {row['replay_ms']:.3f} ms; us per layer call: {projs}")  # fmt: skip
    finally:
        setattr(module, function, this)
    for label in variants:
        rows = [row for row in results["rounds"] if row["variant"] == label]
        keys = [key for key in rows[0] if key.endswith(("_ms", "_us"))]
        low = {key: min(row[key] for row in rows) for key in keys}
        med = {key: sorted(row[key] for row in rows)[len(rows) // 2] for key in keys}
        results[f"min_{label}"], results[f"median_{label}"] = low, med
        log(lines, f"min / median {label}: " + ", ".join(f"{key} {low[key]:.3f} / {med[key]:.3f}" for key in keys))
    keys = [k for k in results["rounds"][0] if k.endswith(("_ms", "_us"))]
    for label in list(variants)[1:]:
        pairs = [(a, b) for a in results["rounds"] for b in results["rounds"]
                 if a["variant"] == "base" and b["variant"] == label and a["round"] == b["round"]]  # fmt: skip
        log(lines, f"{label} lower than base, rounds of {len(pairs)}: "
                   + ", ".join(f"{key} {sum(b[key] < a[key] for a, b in pairs)}" for key in keys))  # fmt: skip
    log(lines, "outputs torch.equal to the baseline's: " + ", ".join(f"{k} {v}" for k, v in results["equal"].items()))
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    base = args.out / f"{kind}-kernel-ab-{name.lower().replace(' ', '-')}-{stamp}"
    base.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    base.with_suffix(".log").write_text("\n".join(lines) + "\n")
