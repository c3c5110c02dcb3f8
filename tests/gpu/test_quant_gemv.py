"""The NF4 table GEMV (engine/quant/quant_gemv.py) and the split-K sums of the quantized kernels on a real GPU: every
table-GEMV config, with and without residual and split K, equals the reference dequantizer + fp32 matmul on fresh random weights and inputs (outputs
poisoned first: every element written), each row's output is bit-identical alone and merged with other rows
(1, 2 and 4 rows per program), split-K sums made in the kernel leave their counters at zero (eager and
CUDA-graph replays) and give bit-equal repeats, DecodeOps' tuner times every candidate and serves each row range (up to
GEMV_MAX_ROWS rows, more) with the kernel and config it picked, and bad calls are refused. Skipped without CUDA (tests/unit/test_engine_quant.py ties the reference
dequantizer to bitsandbytes on CPU)."""

from __future__ import annotations

import pytest
import torch

from helpers.cuda_capture import capture

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def _weight(kind: str, n: int, k: int, seed: int, dtype: torch.dtype = BF16):
    from benchmarks.common.quantize import quantize_int8, quantize_nf4

    gen = torch.Generator(device=DEV).manual_seed(seed)
    dense = (torch.randn(n, k, device=DEV, generator=gen) * 0.03).to(dtype)
    return quantize_nf4(dense) if kind == "nf4" else quantize_int8(dense)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("shape", [(200, 1088), (96, 4160)])
def test_gemv_matches_reference(dtype, shape) -> None:
    from corolla.engine.quant import quant_gemv

    n, k = shape
    kind = "nf4"
    weight = _weight(kind, n, k, seed=n + k, dtype=dtype)
    dense = weight.dequantize().float()  # [N, K]
    for m in (1, 3, quant_gemv.GEMV_MAX_ROWS):
        x = torch.randn(m, k, device=DEV, dtype=dtype)
        res = torch.randn(m, n, device=DEV, dtype=dtype)
        expected = x.float() @ dense.t()  # [M, N]
        for config in quant_gemv.NF4_GEMV_CONFIGS:
            out = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)
            out.copy_(quant_gemv.quant_gemv(x, weight, None, config))
            assert torch.isfinite(out).all(), (kind, m, config)
            err = float((out.float() - expected).norm() / expected.norm())
            assert err < 1e-2, (kind, m, config, err)
            with_res = quant_gemv.quant_gemv(x, weight, res, config)
            err = float((with_res.float() - expected - res.float()).norm() / expected.norm())
            assert err < 1.5e-2, (kind, m, config, err)


def test_gemv_rows_are_batch_invariant() -> None:
    from corolla.engine.quant import quant_gemv

    kind = "nf4"
    weight = _weight(kind, 512, 2048, seed=11)
    rows = torch.randn(quant_gemv.GEMV_MAX_ROWS, 2048, device=DEV, dtype=BF16)
    res = torch.randn(quant_gemv.GEMV_MAX_ROWS, 512, device=DEV, dtype=BF16)
    for config in quant_gemv.NF4_GEMV_CONFIGS:
        merged = quant_gemv.quant_gemv(rows, weight, res, config)  # 4 rows per program
        for r in (0, 3, 5, quant_gemv.GEMV_MAX_ROWS - 1):
            alone = quant_gemv.quant_gemv(rows[r : r + 1].contiguous(), weight, res[r : r + 1], config)
            assert torch.equal(alone[0], merged[r]), (kind, config, r)
        pair = quant_gemv.quant_gemv(rows[2:4].contiguous(), weight, res[2:4].contiguous(), config)  # 2 per program
        assert torch.equal(pair, merged[2:4]), (kind, config)
        three = quant_gemv.quant_gemv(rows[:3].contiguous(), weight, res[:3].contiguous(), config)
        assert torch.equal(three, merged[:3]), (kind, config)


def test_gemv_refuses_bad_calls() -> None:
    from benchmarks.common.quantize import quantize_nf4
    from corolla.engine.quant import quant_gemv

    nf4 = _weight("nf4", 64, 256, seed=1)
    int8 = _weight("int8", 64, 256, seed=1)
    x = torch.randn(1, 256, device=DEV, dtype=BF16)
    with pytest.raises(ValueError, match="rows"):
        quant_gemv.quant_gemv(torch.randn(quant_gemv.GEMV_MAX_ROWS + 1, 256, device=DEV, dtype=BF16), nf4, None,
                              quant_gemv.DEFAULT_NF4_CONFIG)  # fmt: skip
    with pytest.raises(ValueError, match="rows"):
        quant_gemv.quant_gemv(x.float(), nf4, None, quant_gemv.DEFAULT_NF4_CONFIG)
    with pytest.raises(ValueError, match="NF4 GEMV config"):
        quant_gemv.quant_gemv(x, nf4, None, (8, 256, 2, 4, 0))
    with pytest.raises(ValueError, match="takes NF4 weights"):
        quant_gemv.quant_gemv(x, int8, None, quant_gemv.DEFAULT_NF4_CONFIG)
    with pytest.raises(ValueError, match="residual"):
        quant_gemv.quant_gemv(x, nf4, torch.randn(2, 64, device=DEV, dtype=BF16), quant_gemv.DEFAULT_NF4_CONFIG)
    fp32 = quantize_nf4(torch.randn(64, 256, device=DEV) * 0.03, dtype=torch.float32)
    lut0 = next(c for c in quant_gemv.NF4_GEMV_CONFIGS if c[4] == 0)
    out = quant_gemv.quant_gemv(x.float(), fp32, None, lut0)
    expected = x.float() @ fp32.dequantize().t()
    assert float((out - expected).norm() / expected.norm()) < 1e-4


_SPLIT_CASES = [
    ("nf4", "gemv", (32, 2, 8, 4, 0)),  # the table GEMV
    ("int8", "block", (32, 128, 8, 4, 3)),
    ("nf4", "block", (16, 256, 4, 4, 3)),
]


@pytest.mark.parametrize(("kind", "kernel", "config"), _SPLIT_CASES)
def test_split_k_sums_in_kernel_are_deterministic_and_replay_safe(kind, kernel, config) -> None:
    # the last program of each output tile sums the splits (quant_splits): counters back at zero after every call
    # and every graph replay, repeated calls bit-equal, replays equal eager calls on fresh inputs
    from corolla.engine.quant import quant_gemv, quant_kernels

    # K = 1600: 25 NF4 blocks in steps of 2 over 8 splits: some programs get no K
    weight = _weight(kind, 520, 1600, seed=31)
    served = quant_gemv.NF4_GEMV_CONFIGS if kernel == "gemv" else quant_kernels.QUANT_CONFIGS
    assert config in served
    assert config[2] > 1
    x = torch.randn(3, 1600, device=DEV, dtype=BF16)
    res = torch.randn(3, 520, device=DEV, dtype=BF16)
    first = _run(kernel, config, x, weight, res)
    assert int(weight.split_counters().abs().sum()) == 0
    expected = x.float() @ weight.dequantize().float().t() + res.float()
    assert float((first.float() - expected).norm() / expected.norm()) < 1.5e-2
    for _ in range(3):
        assert torch.equal(_run(kernel, config, x, weight, res), first)
    graph, out = capture(_run, kernel, config, x, weight, res)
    for _ in range(3):  # fresh inputs each replay, same function
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _run(kernel, config, x, weight, res)), (kind, kernel, config)
        assert int(weight.split_counters().abs().sum()) == 0


def _run(kernel: str, config, x, weight, res):
    from corolla.engine.quant import quant_gemv, quant_int8_gemv, quant_kernels, quant_mma, quant_tile_gemv

    if kernel == "mmaf":
        return quant_mma.nf4_mma_matmul(x, weight, res, config, fold=True)
    fn = {"gemv": quant_gemv.quant_gemv, "block": quant_kernels.quant_matmul, "mma": quant_mma.nf4_mma_matmul,
          "tile": quant_tile_gemv.nf4_tile_gemv, "i8mma": quant_int8_gemv.int8_row_mma}  # fmt: skip
    return fn[kernel](x, weight, res, config)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_decode_ops_routes_rows_to_the_tuned_kernels(kind) -> None:
    from corolla.engine.ops.decode_ops import DecodeOps
    from corolla.engine.quant import quant_gemv, quant_int8_gemv, quant_kernels, quant_mma, quant_tile_gemv
    from corolla.engine.quant.quant_choices import mma_candidates

    weights = [_weight(kind, 256, 1024, seed=20 + i) for i in range(2)]
    ops = DecodeOps(DEV, 64, use_triton=True)
    report = ops.tune_quantized({(kind, 256, 1024): weights}, reps=3)
    entry = report[(kind, 256, 1024)]
    small, gemm, mid = entry["best"], entry["gemm_best"], entry["mid_best"]
    # NF4: the tile GEMV for one row, the matrix-unit kernel's 16-row tiles up to MMA_MID_MAX_ROWS
    # rows and its 64-row tiles above; INT8: the tl.dot block kernel or row GEMV up to GEMV_MAX_ROWS rows (the
    # row GEMV: one row, then the block kernel's 16-row tiles up to MMA_MID_MAX_ROWS rows), the block kernel above
    mma = mma_candidates()
    blocks = [] if kind == "nf4" else [("block", c) for c in quant_kernels.QUANT_CONFIGS]
    streams = [("tile", c) for c in quant_tile_gemv.NF4_TILE_CONFIGS] if kind == "nf4" else []
    rows = [] if kind == "nf4" else [("i8mma", c) for c in quant_int8_gemv.INT8_MMA_CONFIGS]
    assert small in blocks + streams + rows
    assert gemm in (blocks or [c for c in mma if c[1][1] > quant_mma.MMA_MID_MAX_ROWS])
    if kind == "nf4":
        assert mid in [c for c in mma if c[1][1] <= quant_mma.MMA_MID_MAX_ROWS]
    else:
        assert mid in blocks if small[0] == "i8mma" else mid is None
    assert len(entry["all_us"]) == len(blocks) + len(streams) + len(rows)  # every candidate ran
    assert entry["best_us"] > 0 and entry["gemm_best_us"] > 0
    assert ops.quant_small[(kind, 256, 1024)] == small and ops.quant_gemm[(kind, 256, 1024)] == gemm
    for m in (1, 2, quant_gemv.GEMV_MAX_ROWS, quant_gemv.GEMV_MAX_ROWS + 1, quant_mma.MMA_MID_MAX_ROWS + 1, 40):
        x = torch.randn(m, 1024, device=DEV, dtype=BF16)
        res = torch.randn(m, 256, device=DEV, dtype=BF16)
        got = ops.linear(x, weights[1], None, residual=res)
        if m == 1 or mid is None and m <= quant_gemv.GEMV_MAX_ROWS:
            choice = small
        elif mid is not None and m <= quant_mma.MMA_MID_MAX_ROWS:
            choice = mid
        else:
            choice = gemm
        want = _run(*choice, x, weights[1], res)
        assert torch.equal(got, want), (kind, m)
        expected = x.float() @ weights[1].dequantize().float().t() + res.float()
        assert float((got.float() - expected).norm() / expected.norm()) < 1.5e-2


def test_tuned_choices_come_back_from_disk_without_timing(tmp_path, monkeypatch) -> None:
    # a second DecodeOps over the same directory, card and versions takes the first one's choices (quantized shapes
    # and single-row dense projections) and times nothing; another scope (card or versions) misses
    from corolla.engine.kernels import graph_timing
    from corolla.engine.kernels.kernel_choices import KernelChoices, device_scope
    from corolla.engine.ops import decode_ops as ops_module
    from corolla.engine.ops.decode_ops import DecodeOps
    from corolla.engine.quant import quant_choices

    weights = {("nf4", 256, 1024): [_weight("nf4", 256, 1024, seed=50)],
               ("int8", 256, 1024): [_weight("int8", 256, 1024, seed=51)]}  # fmt: skip
    dense = {(256, 1024, "rmsnorm", False): [(torch.randn(256, 1024, device=DEV, dtype=BF16) * 0.03,
                                              torch.ones(1024, device=DEV, dtype=BF16))]}  # fmt: skip
    first = DecodeOps(DEV, 64, use_triton=True)
    first.kernel_choices = KernelChoices(tmp_path, device_scope(DEV))
    tuned = {**first.tune_quantized(weights, reps=3), **first.tune_linear(dense, 1e-5, reps=3)}
    assert not any(r.get("cached") for r in tuned.values())
    timed = []

    def counted(timer):
        return lambda *a, **k: timed.append(a) or timer(*a, **k)

    monkeypatch.setattr(quant_choices, "time_configs", counted(graph_timing.time_configs))
    monkeypatch.setattr(ops_module, "graph_median_ms", counted(graph_timing.graph_median_ms))
    second = DecodeOps(DEV, 64, use_triton=True)
    second.kernel_choices = KernelChoices(tmp_path, device_scope(DEV))
    again = {**second.tune_quantized(weights, reps=3), **second.tune_linear(dense, 1e-5, reps=3)}
    assert all(r["cached"] for r in again.values()) and not timed
    for table in ("quant_small", "quant_mid", "quant_gemm", "quant_fused", "single_row_gemm"):
        assert getattr(second, table) == getattr(first, table), table
    x = torch.randn(1, 1024, device=DEV, dtype=BF16)
    for key, (w,) in weights.items():
        assert torch.equal(second.linear(x, w, None), first.linear(x, w, None)), key
    elsewhere = DecodeOps(DEV, 64, use_triton=True)
    elsewhere.kernel_choices = KernelChoices(tmp_path, device_scope(DEV) + " (another card)")
    elsewhere.tune_quantized(weights, reps=3)
    assert timed  # a miss: timed again
