"""The quantized fast path on a real GPU: the Triton dequantize-GEMM kernels (NF4, Int8; every tuned config, with
and without split K and residual) equal the reference dequantizer + matmul, each row's output is bit-identical
whether it runs alone or merged with other rows (the fix for the nondeterminism of merged NF4 steps), the NF4
dequantize kernel equals the reference exactly, a quantized engine's CUDA-graph step equals its eager step, two
identical sessions merged in one step get identical rows, and the Qwen3 q/k norm kernel equals its reference.
Skipped without CUDA (bitsandbytes is not needed: tests/unit/test_engine_quant.py ties the reference
dequantizer to bitsandbytes on CPU)."""

from __future__ import annotations

import pytest
import torch

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def _weights(n: int, k: int, seed: int = 0):
    from benchmarks.common.quantize import quantize_int8, quantize_nf4

    gen = torch.Generator(device=DEV).manual_seed(seed)
    dense = (torch.randn(n, k, device=DEV, generator=gen) * 0.03).to(BF16)
    return {"nf4": quantize_nf4(dense), "int8": quantize_int8(dense)}


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("shape", [(384, 512), (200, 1088)])
def test_quant_matmul_matches_reference(kind, shape) -> None:
    from corolla.engine.quant import quant_kernels

    n, k = shape
    weight = _weights(n, k)[kind]
    dense = weight.dequantize().float()  # [N, K]
    for m in (1, 3, 16, 33, 64):
        x = torch.randn(m, k, device=DEV, dtype=BF16)
        res = torch.randn(m, n, device=DEV, dtype=BF16)
        expected = x.float() @ dense.t()
        for config in quant_kernels.QUANT_CONFIGS:
            out = torch.full((m, n), float("nan"), device=DEV, dtype=BF16)
            out.copy_(quant_kernels.quant_matmul(x, weight, None, config))
            err = float((out.float() - expected).norm() / expected.norm())
            assert err < 1e-2, (kind, m, config, err)
            with_res = quant_kernels.quant_matmul(x, weight, res, config)
            err = float((with_res.float() - expected - res.float()).norm() / expected.norm())
            assert err < 1.5e-2, (kind, m, config, err)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_rows_are_batch_invariant(kind) -> None:
    from corolla.engine.quant import quant_kernels

    weight = _weights(512, 1024, seed=1)[kind]
    rows = torch.randn(40, 1024, device=DEV, dtype=BF16)
    for config in quant_kernels.QUANT_CONFIGS:
        merged = quant_kernels.quant_matmul(rows, weight, None, config)
        for r in (0, 5, 17, 39):
            alone = quant_kernels.quant_matmul(rows[r : r + 1].contiguous(), weight, None, config)
            assert torch.equal(alone[0], merged[r]), (kind, config, r)
        assert torch.equal(merged[:7], quant_kernels.quant_matmul(rows[:7].contiguous(), weight, None, config))


def test_nf4_dequantize_kernel_equals_reference() -> None:
    from corolla.engine.quant import quant_kernels

    weight = _weights(320, 1536, seed=2)["nf4"]
    assert torch.equal(quant_kernels.nf4_dequantize(weight), weight.dequantize())


def test_qk_norm_kernel_matches_reference() -> None:
    from corolla.engine.kernels.qk_norm import qk_norm_ref, qk_norm_triton

    qkv = torch.randn(5, (8 + 2 * 2) * 128, device=DEV, dtype=BF16) * 3
    qw = torch.rand(128, device=DEV, dtype=BF16) + 0.5
    kw = torch.rand(128, device=DEV, dtype=BF16) + 0.5
    expected = qk_norm_ref(qkv, qw, kw, 8, 2, 1e-6)
    got = qk_norm_triton(qkv.clone(), qw, kw, 8, 2, 1e-6)
    assert (got.float() - expected.float()).abs().max() <= 0.02 * expected.float().abs().max()
    assert torch.equal(got[:, 10 * 128 :], qkv[:, 10 * 128 :])  # values untouched


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantized_engine_graph_step_and_identical_sessions(kind) -> None:
    from benchmarks.common.quantize import quantize_int8, quantize_nf4
    from corolla.engine.config import EngineConfig
    from corolla.engine.span_engine import SpanEngine, StepRequest
    from corolla.engine.spans.fast_llama import FastLlamaSpan, LayerWeights, LlamaSpec

    torch.manual_seed(3)
    spec = LlamaSpec(
        hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64, intermediate_size=1024, rms_norm_eps=1e-5,
        qk_norm=True,
    )  # fmt: skip
    quantize = quantize_nf4 if kind == "nf4" else quantize_int8

    def mat(n, k):
        return quantize((torch.randn(n, k, device=DEV) * 0.03).to(BF16))

    def vec(n):
        return (1 + 0.1 * torch.randn(n, device=DEV)).to(BF16)

    layers = [
        LayerWeights(
            ln1=vec(512), w_qkv=mat(512 + 2 * 128, 512), b_qkv=None, w_o=mat(512, 512), b_o=None, ln2=vec(512),
            w_gate_up=mat(2048, 512), b_gate_up=None, w_down=mat(512, 1024), b_down=None, q_norm=vec(64),
            k_norm=vec(64),
        )
        for _ in range(3)
    ]  # fmt: skip
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    results = {}
    for graphs in (True, False):
        model = FastLlamaSpan(spec, layers, inv_freq, max_positions=1024)
        config = EngineConfig(
            kv_pool_bytes=64 << 20, max_seq_len_tokens=512, max_batch_rows=16, use_cuda_graphs=graphs,
        )  # fmt: skip
        engine = SpanEngine(model, config)
        engine.warmup()
        gen = torch.Generator(device=DEV).manual_seed(4)
        prompt = torch.randn(1, 20, 512, device=DEV, generator=gen).to(BF16)
        sessions = [engine.open_session(1, 64) for _ in range(4)]
        for s in sessions[:2]:
            engine.step(s, prompt, 0)
        for s in sessions[2:]:
            engine.step(s, torch.randn(1, 30, 512, device=DEV, generator=gen).to(BF16), 0)
        x = torch.randn(1, 1, 512, device=DEV, generator=gen).to(BF16)
        others = [torch.randn(1, 1, 512, device=DEV, generator=gen).to(BF16) for _ in range(2)]
        reqs = [StepRequest(sessions[0], x, 20), StepRequest(sessions[1], x, 20)]
        reqs += [StepRequest(s, o, 30) for s, o in zip(sessions[2:], others, strict=True)]
        outs = engine.decode_many(reqs)
        assert torch.equal(outs[0], outs[1])  # identical sessions merged in one step: identical rows
        alone = engine.step(sessions[0], torch.randn(1, 1, 512, device=DEV, generator=gen).to(BF16), 21)
        results[graphs] = (outs, alone)
        for s in sessions:
            s.close()
    for a, b in zip(results[True][0] + [results[True][1]], results[False][0] + [results[False][1]], strict=True):
        assert torch.isfinite(a).all()
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)
