"""The INT8 row GEMV on the matrix units (engine/quant/quant_int8_gemv.py) on a real GPU: every config, bf16 and
fp16, with and without residual, N not a multiple of a program's rows, equals the reference dequantizer + fp32
matmul (outputs poisoned first: every element written); its RMSNorm prologue equals the separate kernel + the same
GEMV within one rounding of x and a float32 reference; a row's output is bit-identical alone, among other rows
and on a repeat, and a CUDA graph replays it on new inputs; the gated form (w_gate_up writing silu(gate) * up) has
the bits of the same kernel + silu_mul, and the tuner's gated choice is what DecodeOps.gate_up and the engine's
graph step serve; kernels launched back to back (programmatic launch: each may start before the one ahead ends)
give the bits of launches separated by a synchronization; bad calls (a tiling past the shared memory among them)
are refused. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from helpers.rmsnorm_prologue import check_rmsnorm_prologue

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def _weight(n: int, k: int, seed: int, dtype: torch.dtype = BF16):
    from benchmarks.common.quantize import quantize_int8

    gen = torch.Generator(device=DEV).manual_seed(seed)
    return quantize_int8((torch.randn(n, k, device=DEV, generator=gen) * 0.03).to(dtype))


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("shape", [(203, 1152), (96, 4608), (40, 192)])  # (40, 192): most warps own no chunk
def test_row_mma_matches_reference(dtype, shape) -> None:
    from corolla.engine.quant.quant_int8_gemv import INT8_MMA_CONFIGS, int8_row_mma

    n, k = shape
    weight = _weight(n, k, seed=n + k, dtype=dtype)
    dense = weight.dequantize().float()  # [N, K]
    for m in (1, 3):
        x = torch.randn(m, k, device=DEV, dtype=dtype)
        res = torch.randn(m, n, device=DEV, dtype=dtype)
        expected = x.float() @ dense.t()  # [M, N]
        for config in INT8_MMA_CONFIGS:
            out = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)
            out.copy_(int8_row_mma(x, weight, None, config))
            assert torch.isfinite(out).all(), (m, config)
            err = float((out.float() - expected).norm() / expected.norm())
            assert err < 1e-2, (m, config, err)
            with_res = int8_row_mma(x, weight, res, config)
            err = float((with_res.float() - expected - res.float()).norm() / expected.norm())
            assert err < 1.5e-2, (m, config, err)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_row_mma_rmsnorm_prologue_matches_the_separate_kernel(dtype) -> None:
    from corolla.engine.quant.prologues import PROLOGUES
    from corolla.engine.quant.quant_int8_gemv import INT8_MMA_CONFIGS, int8_row_mma

    weight = _weight(203, 1152, seed=11, dtype=dtype)

    def run(x, res, config, gain=None, eps=0.0):
        return int8_row_mma(x, weight, res, config, PROLOGUES["rmsnorm"] if gain is not None else 0, gain, eps)

    check_rmsnorm_prologue(run, weight.dequantize().float(), INT8_MMA_CONFIGS, dtype)


def test_rows_are_batch_invariant_deterministic_and_replayed_by_graphs() -> None:
    from corolla.engine.quant.quant_int8_gemv import INT8_MMA_CONFIGS, int8_row_mma

    weight = _weight(520, 14336, seed=7)
    rows = torch.randn(5, 14336, device=DEV, dtype=BF16)
    res = torch.randn(5, 520, device=DEV, dtype=BF16)
    for config in INT8_MMA_CONFIGS:
        merged = int8_row_mma(rows, weight, res, config)
        assert torch.equal(int8_row_mma(rows, weight, res, config), merged), config
        for r in (0, 4):
            alone = int8_row_mma(rows[r : r + 1].contiguous(), weight, res[r : r + 1].contiguous(), config)
            assert torch.equal(alone[0], merged[r]), (config, r)
    config = INT8_MMA_CONFIGS[-1]
    x = torch.zeros(1, 14336, device=DEV, dtype=BF16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        int8_row_mma(x, weight, None, config)  # compiled before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = int8_row_mma(x, weight, None, config)
    for r in (1, 3):
        x.copy_(rows[r : r + 1])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, int8_row_mma(rows[r : r + 1].contiguous(), weight, None, config)), r


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_gated_form_has_the_bits_of_the_kernel_then_silu_mul(dtype) -> None:
    from corolla.engine.kernels import triton_kernels
    from corolla.engine.ops.decode_ops import silu_mul_ref
    from corolla.engine.quant.prologues import PROLOGUES
    from corolla.engine.quant.quant_int8_gemv import GATED_CONFIGS, int8_row_mma

    inter, k, eps, m = 203, 1152, 1e-5, 3  # I = 203: the last program's rows ragged in both halves
    weight = _weight(2 * inter, k, seed=21, dtype=dtype)
    gen = torch.Generator(device=DEV).manual_seed(22)
    x = (torch.randn(m, k, device=DEV, generator=gen) * 3).to(dtype)
    gain = (torch.rand(k, device=DEV, generator=gen) + 0.5).to(dtype)
    rms = PROLOGUES["rmsnorm"]
    expected = silu_mul_ref((x.float() @ weight.dequantize().float().t()).to(dtype)).float()  # [M, I]
    configs = GATED_CONFIGS if dtype == BF16 else GATED_CONFIGS[:1]
    for config in configs:
        for prologue, nw in ((0, None), (rms, gain)) if dtype == BF16 else ((0, None),):
            out = torch.full((m, inter), float("nan"), device=DEV, dtype=dtype)
            out.copy_(int8_row_mma(x, weight, None, config, prologue, nw, eps, gated=True))
            plain = int8_row_mma(x, weight, None, config, prologue, nw, eps)  # [M, 2I]
            assert torch.equal(out, triton_kernels.silu_mul(plain)), (config, prologue)
            if prologue == 0:
                err = float((out.float() - expected).norm() / expected.norm())
                assert err < 1e-2, (config, err)
            for r in (0, m - 1):
                alone = int8_row_mma(x[r : r + 1].clone(), weight, None, config, prologue, nw, eps, gated=True)
                assert torch.equal(alone[0], out[r]), (config, prologue, r)


def test_back_to_back_launches_have_the_bits_of_synchronized_ones() -> None:
    # each kernel reads the one before's output: a launch that read it before that kernel ended would differ
    from corolla.engine.quant.prologues import PROLOGUES
    from corolla.engine.quant.quant_int8_gemv import GATED_CONFIGS, INT8_MMA_CONFIGS, int8_row_mma

    h, inter, eps = 1024, 1536, 1e-5
    w_o, w_up, w_down = _weight(h, h, seed=31), _weight(2 * inter, h, seed=32), _weight(h, inter, seed=33)
    gain = (torch.rand(h, device=DEV) + 0.5).to(BF16)
    rms = PROLOGUES["rmsnorm"]

    def chain(x: torch.Tensor, sync: bool) -> torch.Tensor:
        outs = [x]
        for _ in range(3):
            y = int8_row_mma(outs[-1], w_o, outs[-1], INT8_MMA_CONFIGS[1])  # [1, H] + residual
            outs.append(y)
            if sync:
                torch.cuda.synchronize()
            act = int8_row_mma(y, w_up, None, GATED_CONFIGS[0], rms, gain, eps, gated=True)  # [1, I]
            if sync:
                torch.cuda.synchronize()
            outs.append(int8_row_mma(act, w_down, y, INT8_MMA_CONFIGS[0]))  # [1, H]
            if sync:
                torch.cuda.synchronize()
        return outs[-1]

    gen = torch.Generator(device=DEV).manual_seed(34)
    inputs = [torch.randn(1, h, device=DEV, generator=gen).to(BF16) for _ in range(3)]
    expected = [chain(x, sync=True) for x in inputs]
    assert torch.equal(chain(inputs[0], sync=False), expected[0])
    static_x = inputs[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = chain(static_x, sync=False)
    for x, want in zip(inputs[1:], expected[1:], strict=True):
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def test_tuner_gated_choice_is_served_by_decode_ops_and_the_engine_step() -> None:
    from benchmarks.common.quantize import quantize_int8
    from corolla.engine.config import EngineConfig
    from corolla.engine.ops.decode_ops import DecodeOps
    from corolla.engine.quant import quant_choices
    from corolla.engine.quant.quant_int8_gemv import GATED_CONFIGS, INT8_MMA_CONFIGS, int8_row_mma
    from corolla.engine.quant.quant_weights import quant_key
    from corolla.engine.span_engine import SpanEngine, StepRequest
    from corolla.engine.spans.fast_llama import FastLlamaSpan, LayerWeights, LlamaSpec

    weight, eps = _weight(2 * 1536, 1024, seed=41), 1e-5
    key = quant_key(weight)
    gain = (torch.rand(1024, device=DEV) + 0.5).to(BF16)
    x = torch.randn(1, 1024, device=DEV, dtype=BF16)
    ops = DecodeOps(DEV, 128, use_triton=True)
    ops.quant_small[key] = ("i8mma", INT8_MMA_CONFIGS[0])  # (what tune_quantized keeps before it tunes "gated")
    r = quant_choices.tune_gated(ops, key, [weight, weight], reps=3)
    assert r["unfused_us"] > 0 and len(r["all_us"]) == len(GATED_CONFIGS)
    assert ops.quant_fused.get((*key, "gated")) == r["fused"]
    config = GATED_CONFIGS[0]
    ops.quant_fused[(*key, "gated")] = ("i8mma", config)
    act, owed = ops.gate_up(x, weight, None, gain, eps)
    assert owed == "none" and torch.equal(act, int8_row_mma(x, weight, None, config, 1, gain, eps, gated=True))
    del ops.quant_fused[(*key, "gated")]
    gate_up, owed = ops.gate_up(x, weight, None, gain, eps)
    assert owed == "silu" and gate_up.shape == (1, 2 * 1536)

    # the engine's graph step, gated or not, with the same tiling for w_gate_up (its RMSNorm fused in both; w_down
    # on its default kernel after silu_mul or on the gated output): the same bits
    torch.manual_seed(5)
    spec = LlamaSpec(
        hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64, intermediate_size=1024, rms_norm_eps=eps,
    )  # fmt: skip

    def mat(n, k):
        return quantize_int8((torch.randn(n, k, device=DEV) * 0.03).to(BF16))

    def vec(n):
        return (1 + 0.1 * torch.randn(n, device=DEV)).to(BF16)

    layers = [
        LayerWeights(
            ln1=vec(512), w_qkv=mat(512 + 2 * 128, 512), b_qkv=None, w_o=mat(512, 512), b_o=None, ln2=vec(512),
            w_gate_up=mat(2048, 512), b_gate_up=None, w_down=mat(512, 1024), b_down=None,
        )
        for _ in range(2)
    ]  # fmt: skip
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    model = FastLlamaSpan(spec, layers, inv_freq, max_positions=256)
    engine = SpanEngine(
        model, EngineConfig(kv_pool_bytes=32 << 20, max_seq_len_tokens=128, max_batch_rows=1, tune_gemm=False)
    )
    up_key = quant_key(layers[0].w_gate_up)
    fused = model.ops.quant_fused
    fused[(*up_key, "rmsnorm")] = ("i8mma", config)
    session = engine.open_session(1, 64)
    engine.step(session, torch.randn(1, 9, 512, device=DEV).to(BF16), 0)
    h = torch.randn(1, 1, 512, device=DEV).to(BF16)
    outs = {}
    for gated in (True, False):
        fused.pop((*up_key, "gated"), None)
        if gated:
            fused[(*up_key, "gated")] = ("i8mma", config)
        assert engine.graphs is not None
        engine.graphs.clear()  # captured again with this choice
        outs[gated] = engine.decode_many([StepRequest(session, h, 9)])[0].clone()
    assert torch.isfinite(outs[True]).all() and torch.equal(outs[True], outs[False])


def test_row_mma_refuses_bad_calls() -> None:
    from benchmarks.common.quantize import quantize_int8
    from corolla.engine.quant.quant_int8_gemv import INT8_MMA_CONFIGS, int8_row_mma

    config = INT8_MMA_CONFIGS[0]
    weight = _weight(64, 256, seed=1)
    x = torch.randn(1, 256, device=DEV, dtype=BF16)
    with pytest.raises(ValueError, match="rows"):
        int8_row_mma(x.half(), weight, None, config)
    with pytest.raises(ValueError, match="rows"):
        int8_row_mma(torch.randn(1, 128, device=DEV, dtype=BF16), weight, None, config)
    with pytest.raises(ValueError, match="residual"):
        int8_row_mma(x, weight, torch.randn(2, 64, device=DEV, dtype=BF16), config)
    with pytest.raises(ValueError, match="config"):
        int8_row_mma(x, weight, None, (0, 8, 2, 0, 0))
    with pytest.raises(ValueError, match="config"):  # 64 output rows, 32 threads: a thread per row
        int8_row_mma(x, weight, None, (4, 1, 2, 0, 0))
    not_64 = quantize_int8(torch.randn(64, 208, device=DEV, dtype=BF16))
    with pytest.raises(ValueError, match="K % 64"):
        int8_row_mma(torch.randn(1, 208, device=DEV, dtype=BF16), not_64, None, config)
    with pytest.raises(ValueError, match="gain"):
        int8_row_mma(x, weight, None, config, 1)  # RMSNorm without its gain
    with pytest.raises(ValueError, match="gain must be"):
        int8_row_mma(x, weight, None, config, 1, torch.ones(256, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="unknown prologue code 2"):  # SiLU gating: no kernel has it (0242)
        int8_row_mma(x, weight, None, config, 2)
    with pytest.raises(ValueError, match="gated"):
        int8_row_mma(x, weight, None, (1, 8, 4, 0, 0), gated=True)  # an odd row-tile count
    with pytest.raises(ValueError, match="gated"):
        int8_row_mma(x, weight, torch.randn(1, 32, device=DEV, dtype=BF16), (2, 8, 4, 0, 0), gated=True)
    fp32 = quantize_int8(torch.randn(64, 256, device=DEV))
    with pytest.raises(ValueError, match="bf16/fp16"):
        int8_row_mma(x.float(), fp32, None, config)
    # a tiling the checks accept whose cp.async ring (4 x 8 tiles x 16 warps: 512 KiB) no device's shared memory holds:
    # refused before any CUDA call, and the kernel runs as before after it (nothing left failed on the context)
    with pytest.raises(ValueError, match="shared memory"):
        int8_row_mma(x, weight, None, (8, 16, 4, 0, 0))
    torch.cuda.synchronize()
    assert torch.isfinite(int8_row_mma(x, weight, None, config)).all()
