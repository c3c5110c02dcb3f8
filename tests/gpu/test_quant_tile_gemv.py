"""The NF4 tile GEMV (engine/quant/quant_tile_gemv.py, compiled by NVRTC, reading bitsandbytes' bytes) on a real GPU:
one-hot rows read single weight columns back, so every decoded value of every position of a unit is checked against
the fp16-level reference (NF4 and a random 16-level table, both dtypes, a partial row tile, a unit short of blocks);
random rows stay within the bf16 rounding of x @ bitsandbytes' dequantized weight with a residual, a row's output is
bit-identical alone and among other rows, prescaled fp16 x gives the bits of bf16 x converted in the kernel, the
RMSNorm prologue stays within one x rounding of the separate norm kernel + the GEMV, the gated output of [gate | up]
is silu_mul of the GEMV's (bit-equal where a program sums its rows in one warp), graph replays are bit-equal, the
grid of a GEMV the attention releases (fewer programs) reads the same weight, bad inputs are refused. Skipped
without CUDA (tests/unit/test_engine_quant_tile_layout.py checks the kernel's data movement on CPU)."""

from __future__ import annotations

import functools

import pytest
import torch

from helpers.cuda_capture import capture
from helpers.nf4_weights import fp16_level_reference, random_code_weight
from helpers.rmsnorm_prologue import check_rmsnorm_prologue

DEV = torch.device("cuda")
# aligned and plain tables, 1 to 3 units in flight, a warp count that cuts row tiles unevenly
CONFIGS = [(32, 1, 1, 1, 0), (8, 2, 0, 2, 0), (5, 3, 1, 1, 0)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("random_table", [False, True])
def test_one_hot_rows_read_every_decoded_value(dtype, random_table) -> None:
    from corolla.engine.quant.quant_tile_gemv import nf4_tile_gemv

    n, k = 136, 1216  # a partial row tile; 19 blocks per row: the last unit has 3
    weight = random_code_weight(n, k, seed=3 + int(random_table), dtype=dtype, random_table=random_table)
    ref = fp16_level_reference(weight)  # [N, K]
    eye = torch.eye(k, device=DEV, dtype=dtype)
    tol = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # one rounding to the output dtype
    # every position of the first unit's four blocks and of the last unit's three, rows of every tile
    for start in [*range(0, 256, 8), *range(1024, k, 8)]:
        cols = [start + j for j in range(8)]
        x = eye[cols].contiguous()  # one-hot rows, each its own program row
        want = ref[:, cols].t()
        for config in CONFIGS:
            out = nf4_tile_gemv(x, weight, None, config)
            diff = (out.float() - want).abs()
            assert bool((diff <= tol * want.abs() + 1e-30).all()), (config, start, float(diff.max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_hot_rows_at_w_down_k_read_x_staged_in_batches(dtype) -> None:
    # K = 14336: x staged X_BATCH words a thread at a time (x_batch_for; 1792 words over 512 / 256 / 160 threads:
    # the first word of each batch, a thread's later words, the last batch partial); each one-hot row reads its
    # column back, so a word staged in the wrong place or not at all fails
    from corolla.engine.quant.quant_tile_gemv import X_BATCH, nf4_tile_gemv, x_batch_for

    n, k = 136, 14336
    weight = random_code_weight(n, k, seed=13, dtype=dtype)
    ref = fp16_level_reference(weight)  # [N, K]
    tol = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    cols = [0, 8 * 159 + 7, 8 * 160, 8 * 255 + 1, 8 * 256 + 2, 8 * 511 + 3, 8 * 512 + 4, 8 * 1024 + 5, 8 * 1536 + 6,
            k - 1]  # fmt: skip
    x = torch.eye(k, device=DEV, dtype=dtype)[cols].contiguous()
    want = ref[:, cols].t()
    for config in [(16, 2, 1, 1, 0), *CONFIGS[1:]]:
        assert x_batch_for(config, k) == X_BATCH > 1, config
        out = nf4_tile_gemv(x, weight, None, config)
        diff = (out.float() - want).abs()
        assert bool((diff <= tol * want.abs() + 1e-30).all()), (config, float(diff.max()))
    assert x_batch_for((16, 2, 1, 1, 0), 4096) == 1  # one word a thread: the one-word loop


def test_random_rows_match_the_reference_and_are_batch_invariant() -> None:
    from corolla.engine.kernels import triton_kernels
    from corolla.engine.quant.quant_tile_gemv import X_SCALE, nf4_tile_gemv

    weight = random_code_weight(520, 4096, seed=5, dtype=torch.bfloat16)
    x = torch.randn(3, 4096, device=DEV, dtype=torch.bfloat16) * 4
    res = torch.randn(3, 520, device=DEV, dtype=torch.bfloat16)
    ref = x.float() @ weight.dequantize().float().t() + res.float()  # bitsandbytes' bf16 dequantized weight
    x16 = triton_kernels.rms_norm(x, torch.ones(4096, device=DEV, dtype=torch.bfloat16), 1e-5, X_SCALE)
    for config in CONFIGS:
        out = nf4_tile_gemv(x, weight, res, config)
        assert bool(torch.isfinite(out).all())
        assert float((out.float() - ref).norm() / ref.norm()) < 5e-3, config
        alone = nf4_tile_gemv(x[1:2].contiguous(), weight, res[1:2].contiguous(), config)
        assert torch.equal(alone, out[1:2]), config  # a row does not depend on the other rows
        normed = triton_kernels.rms_norm(x, torch.ones(4096, device=DEV, dtype=torch.bfloat16), 1e-5)
        want = nf4_tile_gemv(normed, weight, res, config)
        assert torch.equal(nf4_tile_gemv(x16, weight, res, config, prescaled=True), want), config


def test_a_released_gemv_on_fewer_programs_reads_the_same_weight() -> None:
    # w_o's shape on a grid capped for a GEMV the attention releases (docs/decisions/0289): each program takes more
    # row tiles, so a row's slots may be added in another warp order; within the reference's rounding, rows still
    # independent of one another, and its graph replays bit-equal
    from corolla.engine.quant.quant_tile_gemv import nf4_tile_gemv

    weight = random_code_weight(4096, 4096, seed=21, dtype=torch.bfloat16)
    x = torch.randn(3, 4096, device=DEV, dtype=torch.bfloat16)
    res = torch.randn(3, 4096, device=DEV, dtype=torch.bfloat16)
    ref = x.float() @ weight.dequantize().float().t() + res.float()
    for config in CONFIGS:
        plain = nf4_tile_gemv(x, weight, res, config)
        out = nf4_tile_gemv(x, weight, res, config, released=True)
        assert float((out.float() - ref).norm() / ref.norm()) < 5e-3, config
        assert float((out.float() - plain.float()).abs().max()) <= 2.0**-6 * float(ref.abs().max()), config
        alone = nf4_tile_gemv(x[2:3].contiguous(), weight, res[2:3].contiguous(), config, released=True)
        assert torch.equal(alone, out[2:3]), config
        graph, replayed = capture(functools.partial(nf4_tile_gemv, released=True), x, weight, res, config)
        replayed.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out), config


def test_graph_replays_are_bit_equal() -> None:
    from corolla.engine.quant.quant_tile_gemv import nf4_tile_gemv

    weight = random_code_weight(4096, 14336, seed=12, dtype=torch.bfloat16)  # Llama-3-8B's w_down
    x = torch.randn(1, 14336, device=DEV, dtype=torch.bfloat16)
    res = torch.randn(1, 4096, device=DEV, dtype=torch.bfloat16)
    dense = fp16_level_reference(weight).t()
    for config in CONFIGS:
        expected = x.float() @ dense + res.float()  # (x changes below)
        eager = nf4_tile_gemv(x, weight, res, config)
        assert float((eager.float() - expected).norm() / expected.norm()) < 1e-2
        graph, out = capture(nf4_tile_gemv, x, weight, res, config)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, nf4_tile_gemv(x, weight, res, config))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_prologue_matches_the_separate_kernel(dtype) -> None:
    from corolla.engine.quant.prologues import PROLOGUES
    from corolla.engine.quant.quant_tile_gemv import RMSNORM, nf4_tile_gemv

    assert RMSNORM == PROLOGUES["rmsnorm"]
    weight = random_code_weight(203, 1152, seed=11, dtype=dtype)  # 18 blocks: the last unit has 2

    def run(x, res, config, gain=None, eps=0.0):
        pro = RMSNORM if gain is not None else 0
        return nf4_tile_gemv(x, weight, res, config, prologue=pro, norm_weight=gain, eps=eps)

    check_rmsnorm_prologue(run, weight.dequantize().float(), CONFIGS, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_output_is_the_gemv_then_silu_mul(dtype) -> None:
    from corolla.engine.kernels import triton_kernels
    from corolla.engine.quant.quant_tile_gemv import RMSNORM, nf4_tile_gemv

    n, k, eps, m = 416, 1152, 1e-5, 3  # [gate | up] of 208 rows each: 13 row tiles a half
    weight = random_code_weight(n, k, seed=21, dtype=dtype)
    gen = torch.Generator(device=DEV).manual_seed(22)
    x = (torch.randn(m, k, device=DEV, generator=gen) * 3).to(dtype)
    gain = (torch.rand(k, device=DEV, generator=gen) + 0.5).to(dtype)
    dense = weight.dequantize().double()  # [N, K]
    for prologue in (0, RMSNORM):
        xs = triton_kernels.rms_norm(x, gain, eps) if prologue else x
        gate_up = xs.double() @ dense.t()
        ref = torch.nn.functional.silu(gate_up[:, : n // 2]) * gate_up[:, n // 2 :]  # [M, I]
        # one warp a program (bf16 with the norm: its 256-word table load takes seconds to compile): every row summed
        # in the same order gated or not, so the bits of GEMV + silu_mul
        one_warp = [(1, 2, 1, 1, 0)] if prologue and dtype == torch.bfloat16 else []
        for config in [*one_warp, *CONFIGS]:
            kw = {"prologue": prologue, "norm_weight": gain, "eps": eps}
            gated = nf4_tile_gemv(x, weight, None, config, gated=True, **kw)
            assert gated.shape == (m, n // 2)
            want = triton_kernels.silu_mul(nf4_tile_gemv(x, weight, None, config, **kw))
            if config[0] == 1:
                assert torch.equal(gated, want), (prologue, config)
            assert float((gated.double() - ref).norm() / ref.norm()) < 1e-2, (prologue, config)
            alone = nf4_tile_gemv(x[1:2].clone(), weight, None, config, gated=True, **kw)
            assert torch.equal(alone[0], gated[1]), (prologue, config)  # a row does not depend on the other rows


def test_tuner_offers_the_gated_form_and_decode_ops_serves_it() -> None:
    from corolla.engine.ops import decode_ops as ops_module
    from corolla.engine.quant import quant_choices
    from corolla.engine.quant.quant_tile_gemv import NF4_TILE_CONFIGS, RMSNORM, nf4_tile_gemv
    from corolla.engine.quant.quant_weights import quant_key

    weight = random_code_weight(416, 512, seed=31, dtype=torch.bfloat16)
    key = quant_key(weight)
    assert quant_choices.gating_candidates(key, torch.bfloat16) == [("tile", c) for c in NF4_TILE_CONFIGS]
    assert quant_choices.gating_candidates(("nf4", 48, 512), torch.bfloat16) == []  # halves of 24 rows
    assert quant_choices.gating_candidates(key, torch.float32) == []
    ops = ops_module.DecodeOps(DEV, 128, use_triton=True)
    report = ops.tune_quantized({key: [weight, weight]}, reps=3, prologues={key: ("rmsnorm", "gated")})
    r = report[key]["prologues"]["gated"]
    assert r["unfused_us"] > 0 and len(r["all_us"]) == len(NF4_TILE_CONFIGS)
    x = torch.randn(1, 512, device=DEV, dtype=torch.bfloat16)
    gain = (torch.rand(512, device=DEV) + 0.5).to(torch.bfloat16)
    ops.quant_fused[(*key, "gated")] = ("tile", NF4_TILE_CONFIGS[0])  # as if it had won
    out, owed = ops.gate_up(x, weight, None, gain, 1e-5)
    want = nf4_tile_gemv(x, weight, None, NF4_TILE_CONFIGS[0], prologue=RMSNORM, norm_weight=gain, eps=1e-5, gated=True)
    assert owed == "none" and torch.equal(out, want)
    del ops.quant_fused[(*key, "gated")]
    out, owed = ops.gate_up(x, weight, None, gain, 1e-5)
    assert owed == "silu" and out.shape == (1, 416)  # the pair: [gate | up], SiLU owed to the down projection


def test_bad_inputs_are_refused() -> None:
    from corolla.engine.quant.quant_tile_gemv import nf4_tile_gemv

    w = random_code_weight(32, 512, seed=1, dtype=torch.bfloat16)
    x = torch.randn(1, 512, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-bit"):
        nf4_tile_gemv(x.float(), w, None, CONFIGS[0])
    with pytest.raises(ValueError, match="config"):
        nf4_tile_gemv(x, w, None, (0, 1, 1, 1, 0))
    with pytest.raises(ValueError, match="config"):
        nf4_tile_gemv(x, w, None, (8, 5, 1, 1, 0))  # at most 4 units in flight
    with pytest.raises(ValueError, match="residual"):
        nf4_tile_gemv(x, w, torch.zeros(1, 31, device=DEV, dtype=torch.bfloat16), CONFIGS[0])
    gain = torch.ones(512, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="runs no prologue 2"):  # SiLU gating: none here
        nf4_tile_gemv(x, w, None, CONFIGS[0], prologue=2, norm_weight=gain)
    with pytest.raises(ValueError, match="runs no prologue 1"):  # a prescaled x is already normalized
        nf4_tile_gemv(x.half(), w, None, CONFIGS[0], prescaled=True, prologue=1, norm_weight=gain)
    with pytest.raises(ValueError, match="gain"):
        nf4_tile_gemv(x, w, None, CONFIGS[0], prologue=1, norm_weight=gain[:256])
    with pytest.raises(ValueError, match="gated"):  # a gated output takes no residual
        nf4_tile_gemv(x, w, torch.zeros(1, 32, device=DEV, dtype=torch.bfloat16), CONFIGS[0], gated=True)
    with pytest.raises(ValueError, match="gated"):  # N = 48: halves of 24 rows, not whole row tiles
        nf4_tile_gemv(x, random_code_weight(48, 512, seed=2, dtype=torch.bfloat16), None, CONFIGS[0], gated=True)
