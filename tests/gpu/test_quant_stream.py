"""The NF4 streaming GEMV (engine/quant/quant_stream.py) on a real GPU: one-hot rows read single weight columns back, so
every decoded value of every block position is checked against the fp16-level reference (NF4 and a random 16-level
table, both dtypes, with and without a K split, whole and halved steps, a partial row tile);
random inputs stay within the bf16 rounding of x @ the dequantized weight, with a residual, and a row's output is
bit-identical alone and among other rows; the split counters are left at zero under graph replay and replays are
bit-equal; x prescaled to fp16 by the RMSNorm and SiLU kernels gives the bits of bf16 x converted in the kernel;
misaligned x is copied, bad inputs are refused. Skipped without CUDA
(tests/unit/test_engine_quant_pair_table.py checks the dot program on CPU)."""

from __future__ import annotations

import pytest
import torch

from helpers.nf4_weights import fp16_level_reference, random_code_weight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
# (BLOCK_N, NB, splits, warps, stages): with and without a split, 1 to 3 pipeline stages (compiled once for the file)
CONFIGS = [(64, 4, 1, 4, 2), (64, 4, 3, 4, 3), (32, 4, 2, 4, 1), (128, 2, 1, 8, 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("random_table", [False, True])
@pytest.mark.parametrize("k", [2048, 1216])  # 32 blocks per row (whole 4-block steps), 19 (steps of one block)
def test_one_hot_rows_read_every_decoded_value(dtype, random_table, k) -> None:
    from corolla.engine.quant.quant_stream import nf4_stream_gemv

    n = 136  # a partial row tile
    weight = random_code_weight(n, k, seed=3 + int(random_table) + k, dtype=dtype, random_table=random_table)
    ref = fp16_level_reference(weight)  # [N, K]
    eye = torch.eye(k, device=DEV, dtype=dtype)
    tol = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # one rounding to the output dtype
    for start in range(0, k, 8 * 37):  # columns from every block and word position, the last one included
        cols = [min(start + j * 37, k - 1) for j in range(8)]
        x = eye[cols].contiguous()  # [8, K] one-hot rows, each its own program
        want = ref[:, cols].t()  # [8, N]
        for config in CONFIGS:
            out = nf4_stream_gemv(x, weight, None, config)
            diff = (out.float() - want).abs()
            assert bool((diff <= tol * want.abs() + 1e-30).all()), (config, start, float(diff.max()))


def test_random_rows_match_the_reference_and_are_batch_invariant() -> None:
    from corolla.engine.quant.quant_stream import nf4_stream_gemv

    weight = random_code_weight(520, 4096, seed=5, dtype=torch.bfloat16)
    x = torch.randn(3, 4096, device=DEV, dtype=torch.bfloat16) * 4
    res = torch.randn(3, 520, device=DEV, dtype=torch.bfloat16)
    ref = x.float() @ weight.dequantize().float().t() + res.float()  # bitsandbytes' bf16 dequantized weight
    for config in CONFIGS:
        out = nf4_stream_gemv(x, weight, res, config)
        assert bool(torch.isfinite(out).all())
        assert float((out.float() - ref).norm() / ref.norm()) < 5e-3, config
        alone = nf4_stream_gemv(x[1:2].contiguous(), weight, res[1:2].contiguous(), config)
        assert torch.equal(alone, out[1:2]), config  # a row does not depend on the other rows
    shifted = torch.empty(3 * 4096 + 1, device=DEV, dtype=torch.bfloat16)[1:].view(3, 4096)  # not 16-byte aligned
    shifted.copy_(x)
    assert torch.equal(nf4_stream_gemv(shifted, weight, res, CONFIGS[1]), nf4_stream_gemv(x, weight, res, CONFIGS[1]))


@pytest.mark.parametrize("producer", ["rmsnorm", "silu"])
def test_prescaled_x_from_the_norm_and_silu_kernels_gives_the_same_bits(producer) -> None:
    from corolla.engine.kernels import triton_kernels
    from corolla.engine.quant.quant_stream import X_SCALE, nf4_stream_gemv

    k = 2048
    weight = random_code_weight(136, k, seed=31, dtype=torch.bfloat16)
    gen = torch.Generator(device=DEV).manual_seed(32)
    if producer == "rmsnorm":
        h = (torch.randn(1, k, device=DEV, generator=gen) * 3).to(torch.bfloat16)
        gain = (1 + 0.5 * torch.randn(k, device=DEV, generator=gen)).to(torch.bfloat16)
        x = triton_kernels.rms_norm(h, gain, 1e-5)
        x16 = triton_kernels.rms_norm(h, gain, 1e-5, X_SCALE)
    else:  # products from about 2^-20 to 2^16: x * X_SCALE in fp16's normal and subnormal ranges and below (zero)
        gate_up = torch.randn(1, 2 * k, device=DEV, generator=gen) * 2.0 ** torch.randint(-6, 7, (1, 2 * k), device=DEV)
        x = triton_kernels.silu_mul(gate_up.to(torch.bfloat16))
        x16 = triton_kernels.silu_mul(gate_up.to(torch.bfloat16), X_SCALE)
    assert x16.dtype == torch.float16
    assert torch.equal(x16, (x.float() * X_SCALE).half())  # the conversion every GEMV program makes of bf16 x
    res = torch.randn(1, 136, device=DEV, dtype=torch.bfloat16, generator=gen)
    for config in CONFIGS:
        want = nf4_stream_gemv(x, weight, res, config)
        assert torch.equal(nf4_stream_gemv(x16, weight, res, config, prescaled=True), want), config


def test_split_counters_reset_under_graph_replay() -> None:
    from corolla.engine.quant.quant_stream import nf4_stream_gemv

    weight = random_code_weight(520, 2048, seed=12, dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device=DEV, dtype=torch.bfloat16)
    res = torch.randn(1, 520, device=DEV, dtype=torch.bfloat16)
    config = (64, 2, 5, 4, 2)  # 5 splits of 16 steps: ragged
    eager = nf4_stream_gemv(x, weight, res, config)
    assert int(weight.split_counters().abs().sum()) == 0
    expected = x.float() @ fp16_level_reference(weight).t() + res.float()
    assert float((eager.float() - expected).norm() / expected.norm()) < 1e-2
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        nf4_stream_gemv(x, weight, res, config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nf4_stream_gemv(x, weight, res, config)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, nf4_stream_gemv(x, weight, res, config))
        assert int(weight.split_counters().abs().sum()) == 0


def test_bad_inputs_are_refused() -> None:
    from corolla.engine.quant.quant_stream import nf4_stream_gemv
    from corolla.engine.quant.quant_weights import NF4Weight, quantize_nf4

    w = random_code_weight(32, 256, seed=1, dtype=torch.bfloat16)
    x = torch.randn(1, 256, device=DEV, dtype=torch.bfloat16)
    buf = torch.zeros(w.packed.numel() + 4, device=DEV, dtype=torch.uint8)
    shifted = buf[4:].view(32, 128)  # word-aligned, not 16-byte aligned
    shifted.copy_(w.packed)
    bad = NF4Weight(shifted, w.absmax_codes, w.nested_absmax, w.nested_code, w.nested_offset, w.code, w.dtype)
    with pytest.raises(ValueError, match="16-byte aligned"):
        nf4_stream_gemv(x, bad, None, CONFIGS[0])
    with pytest.raises(ValueError, match="16-bit"):
        nf4_stream_gemv(x.float(), w, None, CONFIGS[0])
    with pytest.raises(ValueError, match="16-bit"):
        nf4_stream_gemv(
            x.float(), quantize_nf4(torch.randn(32, 256, device=DEV), dtype=torch.float32), None, CONFIGS[0]
        )
    with pytest.raises(ValueError, match="config"):
        nf4_stream_gemv(x, w, None, (48, 4, 1, 4, 2))
    with pytest.raises(ValueError, match="pair table"):
        nf4_stream_gemv(x, w, None, (64, 4, 1, 2, 2))  # the table's copy is written for 4 or 8 warps
    with pytest.raises(ValueError, match="float16"):
        nf4_stream_gemv(x, w, None, CONFIGS[0], prescaled=True)  # prescaled x is fp16
    with pytest.raises(ValueError, match="residual"):
        nf4_stream_gemv(x, w, torch.zeros(1, 31, device=DEV, dtype=torch.bfloat16), CONFIGS[0])
