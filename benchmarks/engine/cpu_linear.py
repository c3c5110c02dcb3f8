"""The projections of one decode forward on the CPU, per formulation and number of rows: what `engine.kernels.cpu_linear`
chooses from, and what its choice costs.

`python -m benchmarks.engine.cpu_linear --rows 1,4,16,32` builds the CPU bench span's projection weights (random,
float32, the `benchmarks.users --cpu` shape: 8 layers of qkv, o with its residual, gate_up, down with its residual), runs
the chooser as the engine's warm-up does, then times one forward's projections (every layer, every projection) per
formulation (each candidate for all of them, and "tuned": the chooser's pick per shape and bucket), candidates
alternated, `--reps` passes each, the fastest kept (other processes share the cores). Prints a markdown table of
milliseconds per forward and the chooser's warm-up seconds.
"""

from __future__ import annotations

import argparse
import time

import torch

from corolla.engine.kernels.cpu_linear import (
    KERNELS,
    CpuLinearChoices,
    CpuLinearConfig,
    Kernel,
    SlotKey,
    available,
    tune,
)

Layer = list[tuple[SlotKey, torch.Tensor]]  # one layer's projections: (shape key, weight [N, K])


def cpu_span_weights(hidden: int, intermediate: int, kv_size: int, num_layers: int, seed: int = 0) -> list[Layer]:
    """Random float32 projection weights of a llama-shaped span (no biases), as the fast path reads them."""
    g = torch.Generator().manual_seed(seed)
    shapes: list[SlotKey] = [
        (hidden + 2 * kv_size, hidden, False, False),  # qkv
        (hidden, hidden, False, True),  # o, residual
        (2 * intermediate, hidden, False, False),  # gate_up
        (hidden, intermediate, False, True),  # down, residual
    ]
    return [[(key, torch.randn(key[0], key[1], generator=g) * 0.02) for key in shapes] for _ in range(num_layers)]


@torch.inference_mode()
def forward_ms(layers: list[Layer], rows: int, kernel_of, *, reps: int) -> dict[str, float]:
    """{formulation: fastest of `reps` passes, ms} of one forward's projections at `rows` rows; `kernel_of[name]`
    maps a shape key to the kernel that formulation runs for it."""
    inputs = {key: torch.randn(rows, key[1]) for key, _ in layers[0]}  # [M, K]
    residuals = {key: torch.randn(rows, key[0]) if key[3] else None for key, _ in layers[0]}  # [M, N]
    best = {name: float("inf") for name in kernel_of}
    for rep in range(1 + reps):
        for name, pick in kernel_of.items():
            start = time.perf_counter()
            for layer in layers:
                for key, w in layer:
                    pick(key)(inputs[key], w, None, residuals[key])
            if rep > 0:
                best[name] = min(best[name], (time.perf_counter() - start) * 1000)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.cpu_linear", description=__doc__)
    p.add_argument("--rows", default="1,4,16,32")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=5120)
    p.add_argument("--kv_size", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    layers = cpu_span_weights(args.hidden, args.intermediate, args.kv_size, args.layers)
    slots: dict[SlotKey, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
    for layer in layers:
        for key, w in layer:
            slots.setdefault(key, []).append((w, None))
    started = time.perf_counter()
    choices, _ = tune(slots, CpuLinearConfig())
    tune_s = time.perf_counter() - started
    names = [n for n in KERNELS if available(n)]
    rows = [int(r) for r in args.rows.split(",")]
    print(f"chooser warm-up {tune_s:.2f} s; load {open('/proc/loadavg').read().split()[0]}; torch threads "
          f"{torch.get_num_threads()}")  # fmt: skip
    print("| formulation | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    table: dict[str, list[float]] = {n: [] for n in [*names, "tuned"]}
    for m in rows:
        kernel_of = {n: (lambda key, k=KERNELS[n]: k) for n in names}
        kernel_of["tuned"] = lambda key, m=m: _tuned(choices, key, m)
        for name, ms in forward_ms(layers, m, kernel_of, reps=args.reps).items():
            table[name].append(ms)
    for name, values in table.items():
        print(f"| {name} | " + " | ".join(f"{v:.0f}" for v in values) + " |")
    return 0


def _tuned(choices: CpuLinearChoices, key: SlotKey, rows: int) -> Kernel:
    return choices.kernel(rows, *key) or KERNELS["linear"]


if __name__ == "__main__":
    raise SystemExit(main())
