"""The fast path's quantized weights on CPU: the reference NF4 dequantizer equals bitsandbytes' own on the packed
weights bitsandbytes makes, our quantizer reproduces bitsandbytes' bytes, a quantized projection through
`DecodeOps.linear` matches bitsandbytes' `matmul_4bit`, a whole NF4 span step equals the span on the dequantized
weights, and the Qwen3 layer (q/k norm) matches transformers' own."""

from __future__ import annotations

import types

import pytest
import torch

from benchmarks.common.quantize import NF4_LEVELS, quantize_int8, quantize_nf4
from corolla.engine.config import EngineConfig
from corolla.engine.ops.decode_ops import DecodeOps
from corolla.engine.quant.quant_weights import (
    Int8Weight,
    NF4Weight,
    quantized_weight_of,
)
from corolla.engine.span_engine import SpanEngine
from corolla.engine.spans.fast_llama import FastLlamaSpan, LayerWeights, LlamaSpec
from corolla.models.registry import get_family
from helpers.engine_reference import quantized_tuning_asked

bnb_functional = pytest.importorskip("bitsandbytes.functional")
bnb = pytest.importorskip("bitsandbytes")


def bnb_nf4(weight: torch.Tensor):
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    module = types.SimpleNamespace(weight=types.SimpleNamespace(data=packed, quant_state=state))
    return packed, state, NF4Weight.from_bnb(module, weight.dtype)


@pytest.mark.parametrize("shape", [(128, 256), (96, 320), (300, 64)])
def test_nf4_reference_dequantizer_equals_bitsandbytes(shape) -> None:
    torch.manual_seed(0)
    weight = (torch.randn(shape) * 0.05).to(torch.bfloat16)
    packed, state, ours = bnb_nf4(weight)
    assert torch.equal(ours.code, torch.tensor(NF4_LEVELS))
    expected = bnb_functional.dequantize_4bit(packed, state)
    got = ours.dequantize()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected)
    # the quantizer (given bitsandbytes' absmax code table) produces bitsandbytes' bytes
    mine = quantize_nf4(weight, nested_code=state.state2.code)
    assert torch.equal(mine.packed, ours.packed)
    diff = (mine.absmax_codes.int() - ours.absmax_codes.int()).abs()
    assert diff.max() <= 1 and float((diff > 0).float().mean()) < 0.02  # near-ties of the 8-bit code may round apart
    assert torch.allclose(mine.nested_absmax, ours.nested_absmax)
    assert mine.nested_offset == pytest.approx(ours.nested_offset)


def test_nf4_format_is_validated() -> None:
    good = quantize_nf4(torch.randn(8, 128))
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_nf4(torch.randn(8, 96))
    with pytest.raises(ValueError, match="absmax codes"):
        NF4Weight(
            good.packed, good.absmax_codes[:-1], good.nested_absmax, good.nested_code, 0.0, good.code, torch.float32
        )
    assert good.nbytes() == 8 * 64 + 16 + 4


def test_int8_format_matches_bitsandbytes() -> None:
    torch.manual_seed(1)
    weight = torch.randn(64, 128, dtype=torch.float16)
    codes, row_absmax, _ = bnb_functional.int8_vectorwise_quant(weight)
    ours = quantize_int8(weight)
    assert (ours.codes.int() - codes.int()).abs().max() <= 1  # rounding of exact halves may differ
    assert torch.allclose(ours.row_absmax, row_absmax.float())
    ref = Int8Weight(codes, row_absmax.float(), torch.float16)
    assert torch.allclose(ref.dequantize().float(), weight.float(), atol=float(row_absmax.max()) / 127)


def testquantized_linear_matches_bitsandbytes_layer() -> None:
    torch.manual_seed(2)
    ops = DecodeOps(torch.device("cpu"), 64, use_triton=False)
    weight = (torch.randn(256, 512) * 0.03).to(torch.bfloat16)
    packed, state, ours = bnb_nf4(weight)
    x = torch.randn(5, 512, dtype=torch.bfloat16)
    residual = torch.randn(5, 256, dtype=torch.bfloat16)
    expected = bnb.matmul_4bit(x, packed.t(), quant_state=state)
    got = ops.linear(x, ours, None)
    # both are dequantize-then-bf16-GEMM: equal up to the GEMMs' rounding
    assert torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
    got_res = ops.linear(x, ours, None, residual=residual)
    assert torch.allclose(got_res.float(), (expected + residual).float(), rtol=2e-2, atol=2e-2)
    # the quantization error itself is far larger than the disagreement with bitsandbytes
    dense = x.float() @ weight.float().t()
    assert (got.float() - expected.float()).norm() < 0.1 * (expected.float() - dense).norm()


def _random_layers(spec: LlamaSpec, n: int, *, qk_norm: bool) -> list[LayerWeights]:
    h, i, qkv = spec.hidden_size, spec.intermediate_size, spec.q_size + 2 * spec.kv_size
    layers = []
    for _ in range(n):
        layers.append(
            LayerWeights(
                ln1=1 + 0.1 * torch.randn(h),
                w_qkv=0.05 * torch.randn(qkv, h),
                b_qkv=None,
                w_o=0.05 * torch.randn(h, spec.q_size),
                b_o=None,
                ln2=1 + 0.1 * torch.randn(h),
                w_gate_up=0.05 * torch.randn(2 * i, h),
                b_gate_up=None,
                w_down=0.05 * torch.randn(h, i),
                b_down=None,
                q_norm=1 + 0.1 * torch.randn(spec.head_dim) if qk_norm else None,
                k_norm=1 + 0.1 * torch.randn(spec.head_dim) if qk_norm else None,
            )
        )
    return layers


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantized_span_equals_span_on_dequantized_weights(kind) -> None:
    torch.manual_seed(3)
    spec = LlamaSpec(
        hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256, rms_norm_eps=1e-5
    )
    dense = _random_layers(spec, 2, qk_norm=False)
    quantize = quantize_nf4 if kind == "nf4" else quantize_int8
    quant, deq = [], []
    for layer in dense:
        q = {name: quantize(getattr(layer, name)) for name in ("w_qkv", "w_o", "w_gate_up", "w_down")}
        quant.append(LayerWeights(**{**vars(layer), **q}))
        deq.append(LayerWeights(**{**vars(layer), **{n: w.dequantize() for n, w in q.items()}}))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    config = EngineConfig(kv_pool_bytes=4 << 20, page_size_tokens=16, max_seq_len_tokens=128)
    engines = [
        SpanEngine(FastLlamaSpan(spec, layers, inv_freq, max_positions=128, use_triton=False), config)
        for layers in (quant, deq)
    ]
    assert engines[0].model.weight_bytes() < engines[1].model.weight_bytes() / 3
    prompt = torch.randn(1, 7, 128)
    token = torch.randn(1, 1, 128)
    outs = []
    for engine in engines:
        with engine.open_session(1, 32) as session:
            first = engine.step(session, prompt, 0)
            second = engine.step(session, token, 7)
            outs.append((first, second))
    for a, b in zip(outs[0], outs[1], strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_qwen3_layer_matches_transformers() -> None:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    torch.manual_seed(4)
    config = Qwen3Config(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    config._attn_implementation = "eager"
    layers = [Qwen3DecoderLayer(config, i).eval() for i in range(2)]
    for layer in layers:
        for p in layer.parameters():
            torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.1 if p.ndim == 1 else 0.05)
    spec = LlamaSpec.from_hf_config(config)
    assert spec.qk_norm
    blocks = [get_family(config).build_block(config, i).eval() for i in range(2)]
    for block, layer in zip(blocks, layers, strict=True):
        block.load_hf_state_dict(layer.state_dict())  # the transformers layers' weights in corolla blocks
    span = FastLlamaSpan.from_blocks(blocks, max_positions=256, use_triton=False)
    engine = SpanEngine(span, EngineConfig(kv_pool_bytes=4 << 20, page_size_tokens=16, max_seq_len_tokens=64))
    hidden = torch.randn(1, 6, 128)
    rotary = Qwen3RotaryEmbedding(config)
    positions = torch.arange(6)[None]
    expected = hidden
    with torch.no_grad():
        emb = rotary(hidden, positions)
        mask = torch.full((6, 6), float("-inf")).triu(1)[None, None]
        for layer in layers:
            out = layer(expected, attention_mask=mask, position_ids=positions, position_embeddings=emb)
            expected = out[0] if isinstance(out, tuple) else out
    with engine.open_session(1, 16) as session:
        prefix = engine.step(session, hidden[:, :5], 0)
        last = engine.step(session, hidden[:, 5:], 5)  # the decode step
    assert torch.allclose(prefix, expected[:, :5], atol=1e-4, rtol=1e-4)
    assert torch.allclose(last, expected[:, 5:], atol=1e-4, rtol=1e-4)


def test_int8_weight_is_read_after_a_plain_forward_moved_its_scales() -> None:
    """bitsandbytes moves an Int8 layer's row scales from `weight.SCB` to `module.state.SCB` on its first forward;
    the engine must still read them (a server whose plain path ran once before the engine is built)."""
    from corolla.models.quantization import QuantType, quantized_linear

    torch.manual_seed(3)
    linear = torch.nn.Linear(128, 64, bias=False).to(torch.float16)
    module = quantized_linear(linear, QuantType.parse("int8")).to("cpu")
    before = quantized_weight_of(module, torch.float16)
    module(torch.randn(2, 128, dtype=torch.float16))
    assert getattr(module.weight, "SCB", None) is None  # the move this test is about happened
    after = quantized_weight_of(module, torch.float16)
    assert isinstance(before, Int8Weight) and isinstance(after, Int8Weight)
    assert torch.equal(before.row_absmax, after.row_absmax) and torch.equal(before.codes, after.codes)


def test_warm_up_tunes_only_the_prologues_each_quantized_shape_takes() -> None:
    """The fused norm/SiLU candidates are timed only where a projection takes them: RMSNorm before w_qkv and
    w_gate_up, SiLU x up before w_down, none for w_o (a shape tuned for both cost warm-up time for nothing); the
    gated form (SiLU x up after the kernel, DecodeOps.gate_up) for w_gate_up only."""
    spec = LlamaSpec(
        hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256, rms_norm_eps=1e-5
    )
    layers = [
        LayerWeights(
            **{**vars(layer), **{n: quantize_int8(getattr(layer, n)) for n in ("w_qkv", "w_o", "w_gate_up", "w_down")}}
        )
        for layer in _random_layers(spec, 2, qk_norm=False)
    ]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    span = FastLlamaSpan(spec, layers, inv_freq, max_positions=128, use_triton=False)
    seen = quantized_tuning_asked(span)
    assert set(seen["weights"]) == {("int8", 256, 128), ("int8", 128, 128), ("int8", 512, 128), ("int8", 128, 256)}
    assert seen["prologues"] == {
        ("int8", 256, 128): ("rmsnorm",),  # w_qkv: (4 + 2 + 2) heads x 32
        ("int8", 512, 128): ("gated", "rmsnorm"),  # w_gate_up (INT8: its kernel may gate its own output too)
    }  # w_down: its SiLU gating runs as its own kernel
