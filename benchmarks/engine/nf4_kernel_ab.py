"""A/B of the NF4 tile GEMV's source on one card: `python -m benchmarks.engine.nf4_kernel_ab --base TREE --out DIR`.

One NF4 engine over 32 random Llama-3-8B-shaped layers (benchmarks.engine.quant's, tuned with this tree's kernel),
then, alternated over `--rounds` rounds: this tree's `nf4_tile_gemv` against the one of the checkout at TREE (its
engine/quant/quant_tile_gemv.py loaded beside this tree's, compiled on this tree's CUDA helpers), both on the same
tuner choices. Per round and variant: each projection as the step calls it (DecodeOps.linear / gate_up: the tuner's
fused RMSNorm or gating, or the norm / SiLU kernel before it, w_o and w_down adding a residual; 32 layers' calls back
to back in one CUDA graph: us per layer call), the four as a chain (each layer's w_qkv, w_o, w_gate_up, w_down), and
the batch-1 step (host-timed median of `benchmarks.engine.quant.STEPS`) and its graph replayed alone (graphs
captured afresh for each variant); `--variants` adds more sources to the rounds. Every variant's outputs of every projection and layer are checked
`torch.equal` to the baseline's. Writes a JSON and a log under --out (the A/B itself: `benchmarks.engine.kernel_ab`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.engine import kernel_ab
from corolla.engine.quant import quant_tile_gemv
from corolla.engine.spans.fast_llama import LayerWeights


def step_calls(engine, layers: list[LayerWeights], gen: torch.Generator) -> dict[str, tuple[str, Callable[[], list]]]:
    """Per projection (and "chain", the four of each layer in order): a call of all layers' one-row projections as
    the step makes them (DecodeOps.linear / gate_up), returning their outputs."""
    ops = engine.model.ops
    spec = engine.model.spec
    dev, dtype, eps, hidden, inter = (
        engine.device,
        engine.dtype,
        spec.rms_norm_eps,
        spec.hidden_size,
        spec.intermediate_size,
    )
    h = torch.randn(1, hidden, device=dev, dtype=dtype, generator=gen)  # [1, H]
    attn = torch.randn(1, hidden, device=dev, dtype=dtype, generator=gen)  # [1, H]
    _, owed = ops.gate_up(h, layers[0].w_gate_up, None, layers[0].ln2, eps)
    act = torch.randn(1, inter * (2 if owed == "silu" else 1), device=dev, dtype=dtype, generator=gen)  # [1, I or 2I]

    def qkv(w: LayerWeights) -> torch.Tensor:
        return ops.linear(h, w.w_qkv, None, prologue="rmsnorm", norm_weight=w.ln1, eps=eps)

    def o(w: LayerWeights) -> torch.Tensor:
        return ops.linear(attn, w.w_o, None, residual=h)

    def gate_up(w: LayerWeights) -> torch.Tensor:
        return ops.gate_up(h, w.w_gate_up, None, w.ln2, eps)[0]

    def down(w: LayerWeights) -> torch.Tensor:
        return ops.linear(act, w.w_down, None, residual=h, prologue=owed)

    def chain(w: LayerWeights) -> torch.Tensor:
        qkv(w)
        x = ops.linear(attn, w.w_o, None, residual=h)  # [1, H]
        a, due = ops.gate_up(x, w.w_gate_up, None, w.ln2, eps)
        return ops.linear(a, w.w_down, None, residual=x, prologue=due)  # [1, H]

    projections = {"w_qkv": qkv, "w_o": o, "w_gate_up": gate_up, "w_down": down, "chain": chain}

    def every_layer(f: Callable[[LayerWeights], torch.Tensor]) -> Callable[[], list]:
        return lambda: [f(w) for w in layers]

    return {name: ("", every_layer(f)) for name, f in projections.items()}


if __name__ == "__main__":
    kernel_ab.main(__doc__.splitlines()[0], "nf4", quant_tile_gemv, "nf4_tile_gemv", step_calls)
