"""The quantized fast path on a real GPU: the Triton dequantize-GEMM kernels (NF4, Int8; every tuned config, with
and without split K and residual) equal the reference dequantizer + matmul, each row's output is bit-identical
whether it runs alone or merged with other rows (the fix for the nondeterminism of merged NF4 steps), the NF4
dequantize kernel equals the reference exactly, a quantized engine's CUDA-graph step equals its eager step, two
identical sessions merged in one step get identical rows, the Qwen3 q/k norm kernel equals its reference, and the
attention releases w_o's GEMV at its start only where that is the NF4 tile GEMV.
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


def test_the_attention_releases_w_o_early_only_into_the_nf4_tile_gemv(monkeypatch) -> None:
    # (docs/decisions/0288) the attention lets the GEMV after it start at its own start only where that GEMV's
    # programs each take a multiprocessor (the NF4 tile GEMV): released so into the INT8 row GEMV's smaller
    # programs, the step's later kernels all launched early and an H200's INT8 step took 25% longer
    from corolla.engine.kernels import triton_kernels
    from corolla.engine.kv.kv_pool import KVPool
    from corolla.engine.ops.decode_ops import DecodeOps
    from corolla.engine.quant.quant_tile_gemv import NF4_TILE_CONFIGS
    from corolla.engine.quant.quant_weights import quant_key
    from corolla.engine.spans.fast_llama import FastLlamaSpan, LayerWeights, LlamaSpec

    ws = _weights(512, 512, seed=5)
    ops = DecodeOps(DEV, 64, use_triton=True)
    nf4, int8 = ws["nf4"], ws["int8"]
    assert not ops.on_tile_gemv(nf4, 1)  # untuned: the table GEMV serves it
    ops.quant_small[quant_key(nf4)] = ("tile", NF4_TILE_CONFIGS[0])
    assert ops.on_tile_gemv(nf4, 1) and ops.on_tile_gemv(nf4, 8)
    assert not ops.on_tile_gemv(nf4, 9)  # past the GEMV rows: the matrix-unit kernels, launched plainly
    ops.quant_mid[quant_key(nf4)] = ("mmaf", (16, 64, 2, 4, 3))
    assert ops.on_tile_gemv(nf4, 1) and not ops.on_tile_gemv(nf4, 2)  # 2 rows on the mid kernel
    ops.quant_small[quant_key(int8)] = ("i8mma", (1, 8, 4, 0, 0))
    assert not ops.on_tile_gemv(int8, 1) and not ops.on_tile_gemv(nf4.dequantize(), 1)

    # the span asks for the release per layer as its w_o is served, and the attention's output does not depend on it
    spec = LlamaSpec(
        hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64, intermediate_size=512, rms_norm_eps=1e-5,
    )  # fmt: skip
    gen = torch.Generator(device=DEV).manual_seed(6)

    def vec(n):
        return (1 + 0.1 * torch.randn(n, device=DEV, generator=gen)).to(BF16)

    def layer(w_o):
        big = _weights(768, 512, seed=7)["nf4"], _weights(1024, 512, seed=8)["nf4"], _weights(512, 512, seed=9)["nf4"]
        return LayerWeights(
            ln1=vec(512), w_qkv=big[0], b_qkv=None, w_o=w_o, b_o=None, ln2=vec(512), w_gate_up=big[1],
            b_gate_up=None, w_down=big[2], b_down=None,
        )  # fmt: skip

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    span = FastLlamaSpan(spec, [layer(nf4), layer(int8)], inv_freq, max_positions=256)
    span.ops.quant_small.update(ops.quant_small)
    asked: list[bool] = []
    kernel = triton_kernels.paged_decode_attention

    def recording(*args, release=False, **kwargs):
        asked.append(release)
        return kernel(*args, release=release, **kwargs)

    monkeypatch.setattr(triton_kernels, "paged_decode_attention", recording)
    pool = KVPool(
        num_layers=2, layout=spec.kv_layout, num_pages=4, page_size_tokens=64, max_pages_per_seq=2, dtype=BF16,
        device=DEV,
    )  # fmt: skip
    hidden = torch.randn(1, 512, device=DEV, generator=gen).to(BF16)
    positions, tables = torch.tensor([70], device=DEV), torch.tensor([[1, 2]], device=DEV, dtype=torch.int32)
    out = span.decode(hidden, positions, tables, pool)
    assert asked == [True, False]  # layer 0's w_o on the NF4 tile GEMV, layer 1's on the INT8 row GEMV

    def flipped(*args, release=False, **kwargs):
        return kernel(*args, release=not release, **kwargs)

    monkeypatch.setattr(triton_kernels, "paged_decode_attention", flipped)
    assert torch.equal(span.decode(hidden, positions, tables, pool), out)
