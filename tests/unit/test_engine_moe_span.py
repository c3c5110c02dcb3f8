"""Mixtral and Qwen3-MoE spans on the fast-path engine (CPU, fp32, reference ops): prefill and decode against the
plain corolla blocks' own cached forward, several sessions merged in one decode step equal to each alone, the
server's fast executor over a Mixtral span (deep prompts, beams, rollback) equal to the backend, the layers the
engine refuses (tensor-parallel expert slices), and the serving rule for MoE families."""

from __future__ import annotations

import pytest
import torch

import helpers.tiny_models_fam_a  # noqa: F401  (registers the tiny qwen3_moe config)
from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.serving import SpanTraits, unsupported_reason
from corolla.engine.spans.fast_llama import FastLlamaSpan, LayerWeights
from corolla.models.layers import SparseMoE
from corolla.models.registry import get_family
from corolla.server.backend import SpanBackend
from corolla.server.core.engine_executor import EngineExecutor
from corolla.server.core.executor import SessionSpec, StepInputs
from corolla.server.core.runtime import Runtime
from corolla.server.metrics import ServerMetrics
from helpers.engine_reference import cached_block_steps, check_merged_decode_equals_solo
from helpers.executor_runs import backend_steps
from helpers.tiny_models import HIDDEN_SIZE as H
from helpers.tiny_models import tiny_config

MAX_LEN = 64
FAMILIES = ["mixtral", "qwen3_moe"]


def make_blocks(family: str, num_layers: int = 2, seed: int = 0) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    config = tiny_config(family, num_layers)
    blocks = [get_family(config).build_block(config, i) for i in range(num_layers)]
    for block in blocks:
        for name, p in block.named_parameters():
            if p.ndim > 1:  # the router wider than the experts: clear top-k choices (no near ties to flip)
                torch.nn.init.normal_(p, std=0.6 if "router" in name else 0.15)
            else:
                torch.nn.init.normal_(p, mean=1.0, std=0.2)
        block.eval()
    return blocks


def make_engine(blocks) -> SpanEngine:
    config = EngineConfig(kv_pool_bytes=1 << 20, page_size_tokens=16, max_seq_len_tokens=MAX_LEN, max_batch_rows=8)
    return SpanEngine.from_blocks(blocks, config)


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_span_prefill_and_decode_match_blocks(family: str) -> None:
    blocks = make_blocks(family)
    engine = make_engine(blocks)
    layers = engine.model.layers  # type: ignore[attr-defined]
    assert all(isinstance(b.mlp, SparseMoE) == (layer.moe is not None) for b, layer in zip(blocks, layers, strict=True))
    assert any(layer.moe is not None for layer in layers)
    steps = [(torch.randn(2, 19, H), 0)] + [(torch.randn(2, 1, H), 19 + i) for i in range(3)]
    steps.append((torch.randn(2, 4, H), 22))  # several tokens on top of a cached prefix
    expected = cached_block_steps(blocks, MAX_LEN, steps)
    with engine.open_session(2, MAX_LEN) as session:
        for (x, position), ref in zip(steps, expected, strict=True):
            torch.testing.assert_close(engine.step(session, x, position), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_decode_of_sessions_equals_each_alone(family: str) -> None:
    blocks = make_blocks(family, seed=1)
    solo, merged = make_engine(blocks), make_engine(blocks)
    prompts = [torch.randn(b, n, H) for b, n in ((1, 5), (2, 17), (1, 30))]
    tokens = [[torch.randn(p.shape[0], 1, H) for _ in range(2)] for p in prompts]
    check_merged_decode_equals_solo(solo, merged, prompts, tokens, MAX_LEN)  # 4 rows of 3 sessions in one forward


async def test_fast_executor_over_a_mixtral_span_equals_the_backend() -> None:
    blocks = make_blocks("mixtral", num_layers=3, seed=2)
    config = tiny_config("mixtral", 3)
    backend = SpanBackend(dict(enumerate(blocks)), config=config, dtype=torch.float32, device="cpu")
    span = (0, 1, 2)
    prompts = torch.randn(3, 1, 4, H) * 0.1
    steps = [
        StepInputs(torch.randn(2, 6, H), 0, prompts, None, "", lone_session=False),  # deep prompts touch positions 0..3
        StepInputs(torch.randn(2, 1, H), 6, prompts, torch.tensor([1, 0]), "", lone_session=False),  # beams swap
        StepInputs(torch.randn(2, 1, H), 5, None, None, "", lone_session=False),  # rollback
    ]
    expected = backend_steps(backend, span, steps, 32)
    with Runtime(max_batch_size_tokens=1024) as runtime:
        engine = make_engine(blocks)
        executor = EngineExecutor(backend, engine, runtime, ServerMetrics())
        async with executor.open_session(SessionSpec(span, 2, 32), alloc_timeout_s=0) as cache:
            got = [await executor.step(cache, st) for st in steps]
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_weight_bytes_count_every_expert() -> None:
    blocks = make_blocks("mixtral", num_layers=1)
    model = FastLlamaSpan.from_blocks(blocks, max_positions=MAX_LEN)
    params = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    assert model.weight_bytes() == params
    moe = model.layers[0].moe
    assert moe is not None and moe.shape == (4, H, 96, 2)
    assert moe.active_nbytes(2) == 4 * H * 4 + 2 * 3 * H * 96 * 4  # router + two experts, fp32


def test_refusals() -> None:
    config = tiny_config("mixtral", 1)
    block = get_family(config).build_block(config, 0)
    block.mlp = SparseMoE(H, 96, 4, 2, "silu", expert_ids=[0, 1])  # a tensor-parallel slice of the experts
    with pytest.raises(ValueError, match="every expert of the layer"):
        FastLlamaSpan.from_blocks([block], max_positions=MAX_LEN)
    layer = FastLlamaSpan.from_blocks(make_blocks("mixtral", 1), max_positions=MAX_LEN).layers[0]
    with pytest.raises(ValueError, match="either gate_up/down projections or a routed mixture"):
        LayerWeights(**{**vars(layer), "moe": None})


@pytest.mark.parametrize("family", FAMILIES)
def test_serving_rule_for_moe_families(family: str) -> None:
    for quant_type in ("none", "nf4", "int8"):  # quantized experts: engine.moe.moe_quant
        assert unsupported_reason(SpanTraits("cuda", torch.bfloat16, quant_type, family, 0, 0)) is None
    reason = unsupported_reason(SpanTraits("cuda", torch.bfloat16, "nf4", "deepseek_v3", 0, 0))
    assert reason is not None and "unquantized experts" in reason  # fast_mla reads dense experts only
