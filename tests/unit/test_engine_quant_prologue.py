"""The RMSNorm prologue of the INT8 tl.dot block kernel (quant_kernels, engine/kernels/quant_splits.py): against a
float32 torch reference and against the separate norm kernel followed by the same kernel, for 1, 3 and 8 rows and 1, 4 and 8 K splits (every split holds
work, so a split whose sum of squares is left out changes the row's 1/rms), repeated calls (the arrival counters
back at zero, the bits repeated), a row's output independent of the other rows, the refusals, and DecodeOps'
dispatch and choice. Runs on CUDA, or on CPU under Triton's interpreter (`TRITON_INTERPRET=1` with Triton
importable); skipped otherwise. The interpreter's tl.dot mishandles bfloat16, so there the block kernel runs in
float16 (bfloat16 on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
quant_gemv = pytest.importorskip("corolla.engine.quant.quant_gemv")  # (Triton importable)


from benchmarks.common.quantize import quantize_int8, quantize_nf4  # noqa: E402
from corolla.engine.kernels import triton_kernels as tk  # noqa: E402
from corolla.engine.ops import decode_ops as ops_module  # noqa: E402
from corolla.engine.quant import quant_choices, quant_kernels  # noqa: E402
from corolla.engine.quant.prologues import PROLOGUES  # noqa: E402
from corolla.engine.quant.quant_weights import Int8Weight, quant_key  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N, K, EPS = 48, 2048, 1e-5
BLOCK = [("block", (16, 128, 1, 4, 3)), ("block", (32, 128, 4, 4, 3)), ("block", (32, 128, 8, 4, 3))]
DTYPE = torch.bfloat16 if DEV.type == "cuda" else torch.float16


def _inputs(dtype: torch.dtype, rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = quantize_int8((torch.randn(N, K, generator=gen) * 0.02).to(DEV), dtype=dtype)
    x = (torch.randn(rows, K, generator=gen) * 3).to(DEV, dtype)
    gain = (torch.rand(K, generator=gen) + 0.5).to(DEV, dtype)
    res = torch.randn(rows, N, generator=gen).to(DEV, dtype)
    return weight, x, gain, res


def _run(choice, x, weight, res, prologue: str = "none", gain=None):
    return quant_choices.quant_kernel(*choice, PROLOGUES[prologue])(x, weight, res, gain, EPS)


def _norm(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    # the separate RMSNorm kernel (CUDA) or its torch version, which rounds alike (the interpreter's bfloat16
    # arithmetic does not)
    return tk.rms_norm(x, gain, EPS) if DEV.type == "cuda" else ops_module.rms_norm_ref(x, gain, EPS)


def _dot_ref(xn: torch.Tensor, weight: Int8Weight, res: torch.Tensor):
    # float32 (xn @ W^T) * scale + res and the bound's scale sum_k |xn_k w_k| * scale
    codes = weight.codes.float()
    out = xn @ codes.T * weight.col_scale + res.float()
    return out, xn.abs() @ codes.abs().T * weight.col_scale


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("choice", BLOCK, ids=str)
def test_rmsnorm_prologue_against_reference_and_unfused(choice, rows: int) -> None:
    weight, x, gain, res = _inputs(DTYPE, rows, seed=rows)
    xf = x.float()
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * gain.float()  # [M, K] not rounded
    ref, scale = _dot_ref(xn, weight, res)
    fused = _run(choice, x, weight, res, "rmsnorm", gain)
    unfused = _run(choice, _norm(x, gain), weight, res)
    ulp = 2.0 ** -(8 if x.dtype == torch.bfloat16 else 11)  # one rounding of the dtype, relative
    # fused: x * gain rounded once, fp32 sums, one output rounding
    assert ((fused.float() - ref).abs() <= ulp * (scale + ref.abs()) + 1e-4).all()
    # unfused: the normed x rounded twice (x / rms, then * gain) before the same kernel: within one more rounding
    assert ((fused.float() - unfused.float()).abs() <= ulp * (2 * scale + 2 * ref.abs()) + 1e-4).all()
    for _ in range(3):  # repeated calls: counters reset, same bits
        assert torch.equal(_run(choice, x, weight, res, "rmsnorm", gain), fused)
        assert int(weight.split_counters().abs().sum()) == 0


@pytest.mark.parametrize("choice", BLOCK[1:], ids=str)
def test_a_rows_output_does_not_depend_on_the_other_rows(choice) -> None:
    weight, x, gain, res = _inputs(DTYPE, 8, seed=3)
    first = _run(choice, x, weight, res, "rmsnorm", gain)
    other = x.clone()
    other[1:] = other[1:] * 7 + 1  # other rows' norms and values change
    second = _run(choice, other, weight, res, "rmsnorm", gain)
    assert torch.equal(first[0], second[0])
    assert not torch.equal(first[1:], second[1:])


def test_prologue_refusals() -> None:
    weight, x, gain, res = _inputs(DTYPE, 1, seed=5)
    with pytest.raises(ValueError, match="contiguous \\[2048\\] gain"):
        quant_kernels.quant_matmul(x, weight, None, BLOCK[0][1], PROLOGUES["rmsnorm"], None, EPS)
    with pytest.raises(ValueError, match="unknown prologue code 7"):
        quant_kernels.quant_matmul(x, weight, None, BLOCK[0][1], 7)
    with pytest.raises(ValueError, match="unknown prologue code 2"):  # SiLU gating's former code: no kernel runs it
        quant_kernels.quant_matmul(x, weight, None, BLOCK[0][1], 2)
    nf4 = quantize_nf4((torch.randn(64, K) * 0.02).to(DEV), dtype=DTYPE)
    with pytest.raises(ValueError, match="INT8 weights only"):
        quant_kernels.quant_matmul(x, nf4, None, BLOCK[0][1], PROLOGUES["rmsnorm"], gain, EPS)
    with pytest.raises(ValueError, match="unknown quantized kernel 'gemv'"):  # NF4's table GEMV has none
        quant_choices.quant_kernel("gemv", quant_gemv.NF4_GEMV_CONFIGS[0], PROLOGUES["rmsnorm"])
    for prologue in ("rmsnorm", "silu"):
        assert not quant_choices.fusable(("nf4", 64, K), ("gemv", quant_gemv.NF4_GEMV_CONFIGS[0]), prologue)
        assert not quant_choices.fusable(("nf4", 64, K), BLOCK[0], prologue)
        assert not quant_choices.fusable(("int8", N, K), ("tile", (16, 2, 1, 1, 0)), prologue)
        assert quant_choices.fusable(("int8", N, K), BLOCK[0], prologue) == (prologue == "rmsnorm")
    # the NF4 tile GEMV: RMSNorm in its x staging, no SiLU gating
    assert quant_choices.fusable(("nf4", 64, K), ("tile", (16, 2, 1, 1, 0)), "rmsnorm")
    assert not quant_choices.fusable(("nf4", 64, K), ("tile", (16, 2, 1, 1, 0)), "silu")
    # the INT8 matrix-unit row GEMV: RMSNorm only (its SiLU gating lost, decision 0063)
    assert quant_choices.fusable(("int8", N, K), ("i8mma", (1, 8, 4, 0, 0)), "rmsnorm")
    assert not quant_choices.fusable(("int8", N, K), ("i8mma", (1, 8, 4, 0, 0)), "silu")


def _triton_ops() -> ops_module.DecodeOps:
    ops = ops_module.DecodeOps(DEV, 64, use_triton=True)
    ops.use_triton = True  # on CPU: the interpreted kernels
    return ops


def test_decode_ops_runs_the_fused_choice_without_the_norm_kernel(monkeypatch) -> None:
    prologue = "rmsnorm"
    weight, x, gain, res = _inputs(DTYPE, 3, seed=7)
    ops = _triton_ops()
    monkeypatch.setattr(ops, "rms_norm", lambda x, w, eps: _norm(x, w))
    key = quant_key(weight)
    ops.quant_small[key] = BLOCK[0]
    unfused = ops.linear(x, weight, None, residual=res, prologue=prologue, norm_weight=gain, eps=EPS)
    pre = _norm(x, gain)
    assert torch.equal(unfused, _run(BLOCK[0], pre, weight, res))
    ops.quant_fused[(*key, prologue)] = BLOCK[1]

    def refuse(*args):
        raise AssertionError("the separate norm kernel ran")

    monkeypatch.setattr(ops, "rms_norm", refuse)
    fused = ops.linear(x, weight, None, residual=res, prologue=prologue, norm_weight=gain, eps=EPS)
    assert torch.equal(fused, _run(BLOCK[1], x, weight, res, prologue, gain))
    assert not torch.equal(fused, unfused)  # the fused kernel served, not the pair
    with pytest.raises(AssertionError, match="separate"):  # more rows than the decode range: the pair
        big = torch.cat([x] * 4)
        ops.linear(big, weight, None, residual=torch.cat([res] * 4), prologue=prologue, norm_weight=gain, eps=EPS)


@pytest.mark.parametrize("fused_ms", [0.5, 2.0])
def test_the_tuner_keeps_the_faster_of_pair_and_fused(fused_ms: float, monkeypatch) -> None:
    weight, *_ = _inputs(DTYPE, 1, seed=9)
    ops = _triton_ops()
    key = quant_key(weight)
    i8mma = ("i8mma", (1, 8, 4, 0, 0))
    timings = {BLOCK[0]: 1.0, ("tile", (16, 2, 1, 1, 0)): 0.9, BLOCK[1]: 1.2, BLOCK[2]: 1.1, i8mma: 1.3}
    monkeypatch.setattr(quant_choices, "graph_median_ms", lambda fn, reps: 1.0)  # the pair
    timed: list = []

    def fake_time(configs, call, items, reps):
        timed.extend(configs)
        return {c: fused_ms + 0.1 * i for i, c in enumerate(configs)}

    monkeypatch.setattr(quant_choices, "time_configs", fake_time)
    ops.quant_fused[(*key, "rmsnorm")] = i8mma  # a stale choice is replaced
    report = quant_choices.tune_prologue(ops, key, [weight], "rmsnorm", BLOCK[0], timings, 3)
    assert timed == [BLOCK[0], BLOCK[2], BLOCK[1]]  # the three fastest that fuse (the NF4 tile GEMV does not)
    expected = BLOCK[0] if fused_ms < 1.0 else None
    assert ops.quant_fused.get((*key, "rmsnorm")) == expected and report["fused"] == expected
    assert report["unfused_us"] == pytest.approx(1000.0)
    assert quant_choices.tune_prologue(ops, key, [weight], "silu", BLOCK[0], timings, 3) == {}  # no kernel fuses it
