"""The INT8 block kernel's RMSNorm prologue on a real GPU at Llama-3-8B's projection shapes (w_qkv and w_gate_up):
fused against the separate kernel + the same kernel for 1, 3 and 8 rows and 1/4/8 K splits, captured in a CUDA graph and replayed with new inputs (bits equal to eager calls, the
arrival counters back at zero), and the tuner's choice served by DecodeOps (the NF4 tile GEMV's RMSNorm:
tests/gpu/test_quant_tile_gemv.py). tests/unit/test_engine_quant_prologue.py covers the same on small shapes (and on
CPU under the interpreter). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

DEV = torch.device("cuda")
BF16 = torch.bfloat16
EPS = 1e-5
CHOICES = {
    "int8": [("block", (16, 128, 1, 4, 3)), ("block", (32, 128, 4, 4, 3)), ("block", (32, 128, 8, 4, 3))],
}
SHAPES = {"w_qkv": (6144, 4096, "rmsnorm"), "w_gate_up": (28672, 4096, "rmsnorm")}


def _case(name: str, rows: int, seed: int, kind: str = "int8"):
    from benchmarks.common.quantize import quantize_int8, quantize_nf4

    n, k, prologue = SHAPES[name]
    gen = torch.Generator(device=DEV).manual_seed(seed)
    dense = (torch.randn(n, k, device=DEV, generator=gen) * 0.02).to(BF16)
    weight = quantize_int8(dense) if kind == "int8" else quantize_nf4(dense)
    x = (torch.randn(rows, k, device=DEV, generator=gen) * 3).to(BF16)
    gain = (torch.rand(k, device=DEV, generator=gen) + 0.5).to(BF16)
    res = torch.randn(rows, n, device=DEV, generator=gen).to(BF16)
    return weight, x, gain, res, prologue


@pytest.mark.parametrize("kind", ["int8"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_fused_prologue_against_the_separate_kernel_eager_and_in_a_graph(name: str, kind: str) -> None:
    from corolla.engine.kernels import triton_kernels
    from corolla.engine.quant import quant_choices
    from corolla.engine.quant.prologues import PROLOGUES

    for rows in (1, 3, 8):
        weight, x, gain, res, prologue = _case(name, rows, seed=rows, kind=kind)
        pre = triton_kernels.rms_norm(x, gain, EPS)
        scale = pre.float().abs() @ weight.dequantize().float().abs().T  # [M, N] sum_k |x_k w_k|
        for choice in CHOICES[kind]:
            fused_fn = quant_choices.quant_kernel(*choice, PROLOGUES[prologue])
            fused = fused_fn(x, weight, res, gain, EPS)
            unfused = quant_choices.quant_kernel(*choice)(pre, weight, res)
            # the separate norm rounds x twice to bf16, the fused one not at all
            bound = 2.0**-7 * (scale + unfused.float().abs()) + 1e-3
            assert ((fused.float() - unfused.float()).abs() <= bound).all(), (name, rows, choice)
            # a CUDA graph replayed with new inputs: the eager bits, counters back at zero
            static_x, static_res = x.clone(), res.clone()
            fused_fn(static_x, weight, static_res, gain, EPS)  # compiled outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fused_fn(static_x, weight, static_res, gain, EPS)
            for seed in (11, 12):
                _, x2, _, res2, _ = _case(name, rows, seed=seed, kind=kind)
                static_x.copy_(x2)
                static_res.copy_(res2)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, fused_fn(x2, weight, res2, gain, EPS)), (name, rows, choice)
                assert int(weight.split_counters().abs().sum()) == 0


def test_tuner_choice_is_served_by_decode_ops() -> None:
    from corolla.engine.ops import decode_ops as ops_module
    from corolla.engine.quant import quant_choices
    from corolla.engine.quant.quant_weights import quant_key

    weight, x, gain, res, _ = _case("w_qkv", 1, seed=3)
    ops = ops_module.DecodeOps(DEV, 128, use_triton=True)
    key = quant_key(weight)
    report = ops.tune_quantized({key: [weight, weight]}, reps=3, prologues={key: ("rmsnorm",)})
    r = report[key]["prologues"]["rmsnorm"]
    assert r["unfused_us"] > 0 and len(r["all_us"]) == 3
    chosen = ops.quant_fused.get((*key, "rmsnorm"))
    assert chosen == r["fused"]
    out = ops.linear(x, weight, None, residual=res, prologue="rmsnorm", norm_weight=gain, eps=EPS)
    if chosen is not None:
        assert torch.equal(out, quant_choices.quant_kernel(*chosen, 1)(x, weight, res, gain, EPS))
        assert min(float(us) for us in r["all_us"].values()) < r["unfused_us"]
    else:
        normed = ops.rms_norm(x, gain, EPS)
        assert torch.equal(out, quant_choices.quant_kernel(*ops.quant_small[key])(normed, weight, res))
