"""A/B of the INT8 row GEMV's source on one card: `python -m benchmarks.engine.int8_kernel_ab --base TREE --out DIR`.

One INT8 engine over 32 random Llama-3-8B-shaped layers (benchmarks.engine.quant's, tuned with this tree's kernel),
then, alternated over `--rounds` rounds with graphs captured afresh for each: this tree's `int8_row_mma` against the one
of the checkout at TREE (its engine/quant/quant_int8_gemv.py loaded beside this tree's, compiled on this tree's CUDA
helpers) and any `--variants` sources, all on the same tuner choices. Per round and variant: each projection's one-row
call as the step makes it (the tuner's choice with its fused RMSNorm or gating; 32 layers' calls back to back in one
CUDA graph: us per layer call), and the batch-1 step (host-timed median of `benchmarks.engine.quant.STEPS`) and its
graph replayed alone; outputs checked `torch.equal` to the baseline's. Writes a JSON and a log under --out (the A/B
itself: `benchmarks.engine.kernel_ab`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.engine import kernel_ab
from corolla.engine.quant import quant_int8_gemv
from corolla.engine.quant.prologues import PROLOGUES
from corolla.engine.quant.quant_choices import quant_kernel
from corolla.engine.spans.fast_llama import LayerWeights


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


if __name__ == "__main__":
    kernel_ab.main(__doc__.splitlines()[0], "int8", quant_int8_gemv, "int8_row_mma", step_calls)
