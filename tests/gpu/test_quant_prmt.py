"""The NF4 register-lookup kernels (engine/quant_prmt_kernels.py: inline-PTX `prmt` decode) on a real GPU, beyond
the config sweeps of test_quant_gemv.py / test_quant_mma.py (which run every register-lookup config against the
reference with poisoned outputs and check batch invariance): one-hot inputs read single weight columns back, so
every decoded value is checked against the reference dequantizer (fp16-rounded level times the block absmax), for
the NF4 table and for a random 16-level table (the table words are kernel arguments, not constants); misaligned
packed bytes are refused. The INT8 word kernel (engine/quant_int8_words.py, byte-permute conversion) reads every
int8 code (-128 included) back exactly; K that is not whole words is refused. Skipped without CUDA (tests/unit/test_engine_quant_prmt.py checks the instruction
sequence itself on CPU)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")


def _weight(n: int, k: int, seed: int, dtype: torch.dtype, random_table: bool):
    from corolla.engine.quant import NF4Weight, quantize_nf4

    gen = torch.Generator(device=DEV).manual_seed(seed)
    w = quantize_nf4((torch.randn(n, k, device=DEV, generator=gen) * 0.03).to(dtype))
    # random bytes: every code in every position, whatever the quantizer produced
    packed = torch.randint(0, 256, w.packed.shape, device=DEV, dtype=torch.uint8, generator=gen)
    code = w.code
    if random_table:
        code = torch.sort(torch.randn(16, device=DEV, generator=gen)).values * 2
    return NF4Weight(packed, w.absmax_codes, w.nested_absmax, w.nested_code, w.nested_offset, code, dtype)


def _fp16_level_reference(weight) -> torch.Tensor:
    # [N, K] fp32: the level rounded to fp16 (as the kernels' table holds it) times the block absmax
    n, k = weight.shape
    levels = weight.code.half().float()
    codes = torch.stack(((weight.packed >> 4).long(), (weight.packed & 15).long()), dim=-1).reshape(n, k)
    return (levels[codes].reshape(-1, 64) * weight.block_absmax()[:, None]).reshape(n, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("random_table", [False, True])
def test_one_hot_rows_read_every_decoded_value(dtype, random_table) -> None:
    from corolla.engine import quant_gemv, quant_prmt_kernels

    n, k = 136, 1216  # 19 blocks per row, a partial row tile
    weight = _weight(n, k, seed=3 + int(random_table), dtype=dtype, random_table=random_table)
    ref = _fp16_level_reference(weight)  # [N, K]
    eye = torch.eye(k, device=DEV, dtype=dtype)
    tol = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # one rounding to the output dtype (+ fma vs mul-add)
    gemv_cfgs = [c for c in quant_gemv.NF4_GEMV_CONFIGS if c[4] == 2]
    for start in range(0, k, 8 * 17):  # columns from every block position, first and last included
        cols = [min(start + j * 17, k - 1) for j in range(quant_gemv.GEMV_MAX_ROWS)]
        x = eye[cols].contiguous()  # [8, K] one-hot rows
        want = ref[:, cols].t()  # [8, N]
        outs = [quant_gemv.quant_gemv(x, weight, None, c) for c in gemv_cfgs]
        outs.append(quant_prmt_kernels.nf4_prmt_gemv(x, weight, None, 128, 3, 4))  # a split count not in the configs
        for out in outs:
            rows = out.shape[0]
            diff = (out.float() - want[:rows]).abs()
            assert bool((diff <= tol * want[:rows].abs() + 1e-30).all()), (start, float(diff.max()))


def test_misaligned_words_are_refused() -> None:
    from corolla.engine import quant_prmt_kernels
    from corolla.engine.quant import NF4Weight

    w = _weight(32, 256, seed=1, dtype=torch.bfloat16, random_table=False)
    buf = torch.zeros(w.packed.numel() + 1, device=DEV, dtype=torch.uint8)
    shifted = buf[1:].view(32, 128)  # rows start one byte off a word boundary
    shifted.copy_(w.packed)
    bad = NF4Weight(shifted, w.absmax_codes, w.nested_absmax, w.nested_code, w.nested_offset, w.code, w.dtype)
    x = torch.randn(1, 256, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="4-byte aligned"):
        quant_prmt_kernels.nf4_prmt_gemv(x, bad, None, 128, 1, 4)
    with pytest.raises(ValueError, match="16-bit"):
        quant_prmt_kernels.nf4_prmt_gemv(x.float(), w, None, 128, 1, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_word_kernel_converts_every_code(dtype) -> None:
    from corolla.engine import quant_gemv, quant_int8_words
    from corolla.engine.quant import Int8Weight

    n, k = 136, 1216
    gen = torch.Generator(device=DEV).manual_seed(9)
    codes = torch.randint(-128, 128, (n, k), device=DEV, dtype=torch.int8, generator=gen)  # every byte, -128 too
    weight = Int8Weight(codes, torch.rand(n, device=DEV, generator=gen) + 0.5, dtype)
    ref = (codes.float() * weight.col_scale[:, None]).to(dtype)  # [N, K]: one fp32 product, rounded once
    eye = torch.eye(k, device=DEV, dtype=dtype)
    configs = [c for c in quant_gemv.INT8_GEMV_CONFIGS if c[4] == 1]
    assert configs
    for start in range(0, k, 8 * 19):
        cols = [min(start + j * 19, k - 1) for j in range(quant_gemv.GEMV_MAX_ROWS)]
        x = eye[cols].contiguous()  # [8, K] one-hot rows read 8 weight columns
        for config in configs:
            out = torch.full((8, n), float("nan"), device=DEV, dtype=dtype)
            out.copy_(quant_gemv.quant_gemv(x, weight, None, config))
            assert torch.equal(out, ref[:, cols].t()), (config, start)
    odd = Int8Weight(codes[:, :1214].contiguous(), weight.row_absmax, dtype)  # K not whole words
    with pytest.raises(ValueError, match="multiples of 4"):
        quant_int8_words.int8_words_gemv(torch.randn(1, 1214, device=DEV, dtype=dtype), odd, None, 128, 64, 1, 4)


def test_split_k_fixup_resets_its_counters_under_graph_replay() -> None:
    from corolla.engine import quant_prmt_kernels

    weight = _weight(520, 2048, seed=12, dtype=torch.bfloat16, random_table=False)
    x = torch.randn(3, 2048, device=DEV, dtype=torch.bfloat16)
    res = torch.randn(3, 520, device=DEV, dtype=torch.bfloat16)
    eager = quant_prmt_kernels.nf4_prmt_gemv(x, weight, res, 64, 5, 4)  # 5 splits of 32 blocks: ragged
    assert int(weight.split_counters().abs().sum()) == 0
    expected = x.float() @ _fp16_level_reference(weight).t() + res.float()
    assert float((eager.float() - expected).norm() / expected.norm()) < 1e-2
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        quant_prmt_kernels.nf4_prmt_gemv(x, weight, res, 64, 5, 4)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quant_prmt_kernels.nf4_prmt_gemv(x, weight, res, 64, 5, 4)
    for _ in range(3):  # fresh inputs each replay, same function
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, quant_prmt_kernels.nf4_prmt_gemv(x, weight, res, 64, 5, 4))
        assert int(weight.split_counters().abs().sum()) == 0
