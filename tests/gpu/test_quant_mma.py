"""The NF4 matrix-unit kernel (engine/quant/quant_mma.py) on a real GPU: one-hot rows read single weight columns back,
so every decoded value is checked: the levels path against the fp16-level reference, within one rounding to the
output dtype (bf16 weights decode bf16 levels: their rounding fits in that), the folded path bit for bit against
bitsandbytes' dequantized weight (NF4 and a random 16-level table, both dtypes, with and without a K split, x loaded
in 1 and in 3 pipeline stages, 64- and 128-row weight tiles); random inputs stay within the bf16 rounding of x @ the
dequantized weight, with a residual; a row's output is bit-identical alone and among other rows of its row tile; the
split counters are left at zero under graph replay; bad inputs are refused. Small shapes: each kernel compiles once
per tiling."""

from __future__ import annotations

import pytest
import torch

from helpers.cuda_capture import capture
from helpers.nf4_weights import fp16_level_reference

DEV = torch.device("cuda")
# one tiling per row range, each with and without a split; the 64-row tiles also with x in 3 pipeline stages, as
# NF4_MMA_CONFIGS runs them (compiled once for the whole file)
CONFIGS = [(64, 16, 1, 4, 1), (64, 16, 3, 4, 1), (64, 64, 1, 4, 1), (64, 64, 2, 4, 3)]
# the folded path: both row ranges with a split, and the 128-row weight tiles of two warpgroups without one
FOLD_CONFIGS = [(64, 16, 3, 4, 1), (64, 64, 2, 4, 3), (128, 64, 1, 8, 3)]
CASES = [(c, False) for c in CONFIGS] + [(c, True) for c in FOLD_CONFIGS]


def _weight(n: int, k: int, seed: int, dtype: torch.dtype, random_table: bool = False):
    from benchmarks.common.quantize import quantize_nf4
    from corolla.engine.quant.quant_weights import NF4Weight

    gen = torch.Generator(device=DEV).manual_seed(seed)
    w = quantize_nf4((torch.randn(n, k, device=DEV, generator=gen) * 0.03).to(dtype))
    packed = torch.randint(0, 256, w.packed.shape, device=DEV, dtype=torch.uint8, generator=gen)  # every code
    code = torch.sort(torch.randn(16, device=DEV, generator=gen)).values * 2 if random_table else w.code
    return NF4Weight(packed, w.absmax_codes, w.nested_absmax, w.nested_code, w.nested_offset, code, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("random_table", [False, True])
def test_one_hot_rows_read_every_decoded_value(dtype, random_table) -> None:
    from corolla.engine.quant.quant_mma import nf4_mma_matmul

    n, k = 136, 1216  # 19 blocks per row, a partial row tile
    weight = _weight(n, k, seed=3 + int(random_table), dtype=dtype, random_table=random_table)
    ref = fp16_level_reference(weight)
    exact = weight.dequantize()  # [N, K] bitsandbytes' values in the dtype
    tol = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # one rounding to the output dtype
    cols = torch.arange(0, k, 3, device=DEV)[:64]  # 64 columns in every word position
    cols = torch.cat([cols, torch.arange(k - 64, k, device=DEV)])  # and the last block
    for config, fold in CASES:
        rows = config[1]
        for start in range(0, cols.numel(), rows):
            sel = cols[start : start + rows]
            x = torch.zeros(sel.numel(), k, device=DEV, dtype=dtype)
            x[torch.arange(sel.numel(), device=DEV), sel] = 1.0
            out = nf4_mma_matmul(x, weight, None, config, fold)
            if fold:  # the weight itself: one exact product summed with zeros
                assert torch.equal(out, exact[:, sel].t()), (config, start)
                continue
            want = ref[:, sel].t()
            diff = (out.float() - want).abs()
            assert bool((diff <= tol * want.abs() + 1e-30).all()), (config, start, float(diff.max()))


def test_random_rows_match_the_dequantized_reference_and_are_batch_invariant() -> None:
    from benchmarks.common.quantize import quantize_nf4
    from corolla.engine.quant.quant_mma import nf4_mma_matmul

    n, k = 200, 2048
    gen = torch.Generator(device=DEV).manual_seed(7)
    weight = quantize_nf4((torch.randn(n, k, device=DEV, generator=gen) * 0.02).to(torch.bfloat16))
    dense = weight.dequantize().float()  # bitsandbytes' values, bf16-rounded
    for config, fold in CASES:
        for m in (1, 5, 16) if config[1] == 16 else (17, 40, 64):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen) * 3
            res = torch.randn(m, n, device=DEV, dtype=torch.bfloat16, generator=gen)
            out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
            out.copy_(nf4_mma_matmul(x, weight, res, config, fold))
            ref = x.float() @ dense.t() + res.float()
            assert float((out.float() - ref).norm() / ref.norm()) < 4e-3, (config, fold, m)
            alone = nf4_mma_matmul(x[1:2] if m > 1 else x, weight, res[1:2] if m > 1 else res, config, fold)
            assert torch.equal(alone, out[1:2] if m > 1 else out), (config, fold, m)  # other rows change nothing


def test_split_counters_reset_under_graph_replay() -> None:
    from corolla.engine.quant.quant_mma import nf4_mma_matmul

    weight = _weight(520, 2048, seed=12, dtype=torch.bfloat16)
    x = torch.randn(3, 2048, device=DEV, dtype=torch.bfloat16)
    res = torch.randn(3, 520, device=DEV, dtype=torch.bfloat16)
    config = (64, 16, 5, 4, 1)  # 5 splits of 32 blocks: ragged
    eager = nf4_mma_matmul(x, weight, res, config)
    assert int(weight.split_counters().abs().sum()) == 0
    expected = x.float() @ fp16_level_reference(weight).t() + res.float()
    assert float((eager.float() - expected).norm() / expected.norm()) < 1e-2
    graph, out = capture(nf4_mma_matmul, x, weight, res, config)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, nf4_mma_matmul(x, weight, res, config))
        assert int(weight.split_counters().abs().sum()) == 0


def test_bad_inputs_are_refused() -> None:
    from corolla.engine.quant.quant_mma import nf4_mma_matmul
    from corolla.engine.quant.quant_weights import NF4Weight

    w = _weight(32, 256, seed=1, dtype=torch.bfloat16)
    x = torch.randn(1, 256, device=DEV, dtype=torch.bfloat16)
    buf = torch.zeros(w.packed.numel() + 1, device=DEV, dtype=torch.uint8)
    shifted = buf[1:].view(32, 128)
    shifted.copy_(w.packed)
    bad = NF4Weight(shifted, w.absmax_codes, w.nested_absmax, w.nested_code, w.nested_offset, w.code, w.dtype)
    with pytest.raises(ValueError, match="4-byte aligned"):
        nf4_mma_matmul(x, bad, None, CONFIGS[0])
    with pytest.raises(ValueError, match="rows"):
        nf4_mma_matmul(x.float(), w, None, CONFIGS[0])
    with pytest.raises(ValueError, match="rows"):
        nf4_mma_matmul(torch.randn(65, 256, device=DEV, dtype=torch.bfloat16), w, None, CONFIGS[0])
    with pytest.raises(ValueError, match="config"):
        nf4_mma_matmul(x, w, None, (64, 48, 1, 4, 1))
