"""Quantized routed experts on CPU (reference ops): `QuantizedExpertWeights` over NF4/Int8 layouts equals the dense
op on the dequantized weights, is validated with the limit in the message, and a Mixtral / Qwen3-MoE span whose
blocks bitsandbytes quantized (every linear but the routers, as `models.quantization` does) runs on the engine
with the plain quantized blocks' outputs (NF4: the same dequantized values; Int8: within bitsandbytes' own
LLM.int8 error against the dequantized weights), reading only packed bytes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import helpers.tiny_models_fam_a  # noqa: F401  (registers the tiny qwen3_moe config)
from benchmarks.common.quantize import quantize_int8, quantize_nf4
from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.moe.moe_quant import QuantizedExpertWeights
from corolla.engine.moe.routed_experts import (
    ExpertWeights,
    RoutedMoE,
    experts_forward,
    experts_forward_ref,
    softmax_topk,
)
from corolla.engine.quant.quant_weights import quantized_weight_of
from corolla.models.layers import SparseMoE
from corolla.models.quantization import KEEP_FULL_PRECISION, QuantType, quantized_linear
from corolla.models.registry import get_family
from helpers.engine_reference import cached_block_steps
from helpers.numerics import rel_err
from helpers.tiny_models import tiny_config

bnb = pytest.importorskip("bitsandbytes")

E, H, INTER = 4, 128, 64
MAX_LEN = 48
QUANTIZERS = {"nf4": quantize_nf4, "int8": quantize_int8}


def random_quantized(kind: str, seed: int = 0) -> QuantizedExpertWeights:
    g = torch.Generator().manual_seed(seed)
    q = QUANTIZERS[kind]
    gate_up = tuple(q(torch.randn(2 * INTER, H, generator=g) / 8) for _ in range(E))
    down = tuple(q(torch.randn(H, INTER, generator=g) / 8) for _ in range(E))
    return QuantizedExpertWeights(gate_up, down)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantized_experts_equal_dense_op_on_dequantized_weights(kind: str) -> None:
    experts = random_quantized(kind)
    dense = ExpertWeights(tuple(w.dequantize() for w in experts.gate_up), tuple(w.dequantize() for w in experts.down))
    x = torch.randn(11, H)
    weights, ids = softmax_topk(torch.randn(11, E), 2, normalize=True)
    ids[3, 1] = E  # outside [0, E): contributes nothing
    expected = experts_forward_ref(x, ids, weights, dense)
    torch.testing.assert_close(experts_forward(x, ids, weights, experts), expected, atol=1e-6, rtol=1e-6)
    # the per-token definition, on the dequantized weights
    gate, up = F.linear(x[0], dense.gate_up[int(ids[0, 0])]).chunk(2)
    first = weights[0, 0] * F.linear(F.silu(gate) * up, dense.down[int(ids[0, 0])])
    gate, up = F.linear(x[0], dense.gate_up[int(ids[0, 1])]).chunk(2)
    second = weights[0, 1] * F.linear(F.silu(gate) * up, dense.down[int(ids[0, 1])])
    torch.testing.assert_close(expected[0], first + second, atol=1e-5, rtol=1e-5)
    assert experts.kind == kind and (experts.num_experts, experts.hidden_size, experts.intermediate_size) == (
        E,
        H,
        INTER,
    )
    assert (experts.dtype, experts.device) == (dense.dtype, dense.device)  # the compute dtype (ExpertSet)
    per_value = 0.5 + 1 / 64 if kind == "nf4" else 1.0  # codes + first-level absmax codes / codes
    assert experts.expert_nbytes() >= 3 * H * INTER * per_value
    assert experts.expert_nbytes() < 3 * H * INTER * per_value * 1.05  # plus the small second-level statistics
    assert experts.nbytes() == E * experts.expert_nbytes()


def test_address_tables_point_at_the_packed_bytes() -> None:
    nf4 = random_quantized("nf4")
    table = nf4.gate_up_tables.addresses
    assert table.shape == (4, E) and table.dtype == torch.int64
    assert table[0].tolist() == [w.packed.data_ptr() for w in nf4.gate_up]  # type: ignore[union-attr]
    assert table[1].tolist() == [w.absmax_codes.data_ptr() for w in nf4.gate_up]  # type: ignore[union-attr]
    assert nf4.down_tables.offsets.tolist() == pytest.approx([w.nested_offset for w in nf4.down])  # type: ignore[union-attr]
    int8 = random_quantized("int8")
    assert int8.down_tables.addresses[1].tolist() == [w.col_scale.data_ptr() for w in int8.down]  # type: ignore[union-attr]


def test_validation() -> None:
    nf4, int8 = random_quantized("nf4"), random_quantized("int8")
    with pytest.raises(ValueError, match="must be a NF4Weight"):
        QuantizedExpertWeights(nf4.gate_up, (*nf4.down[:-1], int8.down[-1]))
    with pytest.raises(ValueError, match="one down per gate_up"):
        QuantizedExpertWeights(nf4.gate_up, nf4.down[:-1])
    with pytest.raises(ValueError, match=r"differ from \(128, 128\)"):
        QuantizedExpertWeights(nf4.gate_up, (quantize_nf4(torch.randn(H, 2 * INTER)),) * E)
    odd = quantize_nf4(torch.randn(2 * INTER, H))
    odd.code = odd.code * 2
    with pytest.raises(ValueError, match="same 16 NF4 levels"):
        QuantizedExpertWeights((*nf4.gate_up[:-1], odd), nf4.down)
    other_table = quantize_nf4(torch.randn(2 * INTER, H))
    other_table.nested_code = other_table.nested_code.flip(0)  # the tile GEMV stages one table for every expert
    with pytest.raises(ValueError, match="absmax code table"):
        QuantizedExpertWeights((*nf4.gate_up[:-1], other_table), nf4.down)
    shifted = quantize_int8(torch.randn(2 * INTER, H))
    shifted.codes = torch.empty(2 * INTER * H + 1, dtype=torch.int8)[1:].view(2 * INTER, H)  # 1 byte off
    with pytest.raises(ValueError, match="16-byte boundaries"):
        QuantizedExpertWeights((*int8.gate_up[:-1], shifted), int8.down)
    bf16 = quantize_int8(torch.randn(2 * INTER, H), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="compute in torch.float32"):
        QuantizedExpertWeights((*int8.gate_up[:-1], bf16), int8.down)


def quantized_model_config(family: str, num_layers: int):
    config = tiny_config(family, num_layers)
    config.hidden_size, config.num_attention_heads = 128, 4  # NF4 rows: multiples of 64 values
    if family == "mixtral":
        config.intermediate_size = 64
    else:
        config.moe_intermediate_size = 64
    return config


def make_blocks(family: str, num_layers: int = 2, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    config = quantized_model_config(family, num_layers)
    blocks = [get_family(config).build_block(config, i) for i in range(num_layers)]
    for block in blocks:
        for name, p in block.named_parameters():
            if p.ndim > 1:  # the router wider than the experts: clear top-k choices (no near ties to flip)
                nn.init.normal_(p, std=0.6 if "router" in name else 0.1)
            else:
                nn.init.normal_(p, mean=1.0, std=0.2)
        block.eval().requires_grad_(False)
    return blocks


def quantize_on_cpu(block: nn.Module, kind: str) -> nn.Module:
    """`models.quantization.quantize_block` without its CUDA check: bitsandbytes' layers quantize on CPU too."""
    for parent in list(block.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and name not in KEEP_FULL_PRECISION:
                setattr(parent, name, quantized_linear(child, QuantType.parse(kind)).to("cpu"))
    return block


def dequantized(block: nn.Module) -> nn.Module:
    """A copy of a quantized block with every bitsandbytes layer replaced by a dense one of its dequantized weight."""
    weights = {}
    for name, module in block.named_modules():
        weight = quantized_weight_of(module, torch.float32)
        if weight is not None:
            weights[name] = weight.dequantize()
    block = copy.deepcopy(block)
    for name, weight in weights.items():
        parent, _, child = name.rpartition(".")
        dense = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        dense.weight.data = weight
        setattr(block.get_submodule(parent), child, dense)
    return block


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_quantized_span_matches_plain_quantized_blocks(family: str, kind: str) -> None:
    blocks = [quantize_on_cpu(b, kind) for b in make_blocks(family)]
    config = EngineConfig(kv_pool_bytes=1 << 20, page_size_tokens=16, max_seq_len_tokens=MAX_LEN, max_batch_rows=4)
    engine = SpanEngine.from_blocks(blocks, config)
    layers = engine.model.layers  # type: ignore[attr-defined]
    assert all(isinstance(b.mlp, SparseMoE) == (layer.moe is not None) for b, layer in zip(blocks, layers, strict=True))
    index = next(i for i, layer in enumerate(layers) if layer.moe is not None)
    moe, first = layers[index].moe, blocks[index].mlp
    assert isinstance(moe, RoutedMoE) and isinstance(moe.experts, QuantizedExpertWeights) and moe.experts.kind == kind
    read = moe.experts.gate_up[1]
    codes = read.packed if kind == "nf4" else read.codes  # type: ignore[union-attr]
    assert codes.data_ptr() == first.experts[1].gate_up.weight.data_ptr()  # read in place, no copy
    dense_bytes = sum(p.numel() * 4 for p in make_blocks(family)[index].mlp.experts.parameters())
    assert moe.experts.nbytes() < dense_bytes / (6 if kind == "nf4" else 3.5)
    h = first.router.in_features
    steps = [(torch.randn(2, 13, h), 0)] + [(torch.randn(2, 1, h), 13 + i) for i in range(3)]
    steps.append((torch.randn(2, 3, h), 16))  # several tokens on top of a cached prefix
    # before the plain forward: bitsandbytes' first Int8 forward moves the row scales (SCB) off the weight
    reference = cached_block_steps([dequantized(b) for b in blocks], MAX_LEN, steps)
    plain = cached_block_steps(blocks, MAX_LEN, steps)
    with engine.open_session(2, MAX_LEN) as session:
        got = [engine.step(session, x, position) for x, position in steps]
    for out, bnb_out, ref in zip(got, plain, reference, strict=True):
        torch.testing.assert_close(out, ref, atol=2e-4, rtol=0)  # the engine computes on the dequantized values
        if kind == "nf4":  # bitsandbytes' 4-bit layers dequantize and multiply: the same numbers
            torch.testing.assert_close(out, bnb_out, atol=2e-4, rtol=0)
        else:  # LLM.int8 also quantizes the activations: the engine is as close to it as the reference is
            assert rel_err(out, bnb_out) <= 1.1 * rel_err(ref, bnb_out) + 1e-5
            assert rel_err(ref, bnb_out) < 0.05
