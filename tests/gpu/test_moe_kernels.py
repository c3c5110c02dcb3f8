"""The routed-experts kernels on a real GPU: the grouped Triton kernels equal the torch reference in bf16 (every
tuning config, several token counts and top-k, ids outside the expert range, stacked and per-expert tensors), a
CUDA graph replayed with new tokens and routes equals the eager reference, and a Mixtral span on the engine (CUDA
graphs, merged sessions) agrees with its own blocks. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig

from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.moe.routed_experts import ExpertWeights, experts_forward, experts_forward_ref, softmax_topk
from corolla.models.registry import get_family
from helpers.cuda_capture import capture
from helpers.engine_reference import cached_block_steps, decode_after_prompts
from helpers.numerics import rel_err

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def random_experts(num_experts: int, hidden: int, inter: int, *, stacked: bool, seed: int = 0) -> ExpertWeights:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device=DEV, generator=gen).mul_(hidden**-0.5).to(BF16)
    down = torch.randn(num_experts, hidden, inter, device=DEV, generator=gen).mul_(inter**-0.5).to(BF16)
    if stacked:
        return ExpertWeights.from_stacked(gate_up, down)
    return ExpertWeights(tuple(t.clone() for t in gate_up), tuple(t.clone() for t in down))


def routes(n: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return softmax_topk(torch.randn(n, num_experts, device=DEV, generator=gen), top_k, normalize=True)


@pytest.mark.parametrize(
    ("num_experts", "hidden", "inter", "top_k", "stacked"),
    [(8, 512, 768, 2, True), (16, 384, 320, 4, False), (4, 1000, 200, 1, True)],
)
def test_grouped_kernel_matches_reference(num_experts, hidden, inter, top_k, stacked) -> None:
    experts = random_experts(num_experts, hidden, inter, stacked=stacked)
    for n in (1, 3, 8, 64, 200):
        x = torch.randn(n, hidden, device=DEV, dtype=BF16)
        weights, ids = routes(n, num_experts, top_k, seed=n)
        out = experts_forward(x, ids, weights, experts)
        assert rel_err(out, experts_forward_ref(x, ids, weights, experts)) < 1e-2, n


@pytest.mark.parametrize("config_index", range(6))
def test_every_tuning_config_is_correct(config_index: int) -> None:
    from corolla.engine.moe import moe_kernels

    config = moe_kernels.EXPERT_CONFIGS[config_index]
    experts = random_experts(8, 1024, 1408, stacked=True, seed=2)
    x = torch.randn(24, 1024, device=DEV, dtype=BF16)
    weights, ids = routes(24, 8, 2, seed=3)
    out = experts_forward(x, ids, weights, experts, config=config)
    assert rel_err(out, experts_forward_ref(x, ids, weights, experts)) < 1e-2


def test_ids_outside_the_experts_contribute_nothing_on_gpu() -> None:
    experts = random_experts(6, 256, 128, stacked=True, seed=4)
    x = torch.randn(5, 256, device=DEV, dtype=BF16)
    weights, ids = routes(5, 6, 2, seed=5)
    ids[0, 1], ids[3, 0] = 6, -2
    out = experts_forward(x, ids, weights, experts)
    assert rel_err(out, experts_forward_ref(x, ids, weights, experts)) < 1e-2


def test_graph_replay_with_new_routes_matches_reference() -> None:
    experts = random_experts(8, 512, 768, stacked=False, seed=6)
    n, top_k = 8, 2
    x = torch.randn(n, 512, device=DEV, dtype=BF16)
    weights, ids = routes(n, 8, top_k, seed=7)
    graph, out = capture(experts_forward, x, ids, weights, experts)
    for seed in range(3):
        new_w, new_ids = routes(n, 8, top_k, seed=100 + seed)
        x.copy_(torch.randn_like(x))
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, experts_forward_ref(x, ids, weights, experts)) < 1e-2, seed


@torch.no_grad()
def test_mixtral_span_on_the_engine_matches_blocks() -> None:
    torch.manual_seed(8)
    config = MixtralConfig(
        hidden_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=768,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        max_position_embeddings=4096,
    )
    blocks = []
    for i in range(2):
        block = get_family(config).build_block(config, i)
        for name, p in block.named_parameters():
            std = 0.1 if p.ndim == 1 else (0.2 if "router" in name else 0.03)
            torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=std)
        blocks.append(block.to(DEV, BF16).eval())
    engine = SpanEngine.from_blocks(
        blocks,
        EngineConfig(
            kv_pool_bytes=64 << 20, max_seq_len_tokens=512, max_batch_rows=8, graph_buckets=(1, 4, 8), tune_gemm=False
        ),
    )
    engine.warmup()
    prompts = [torch.randn(1, n, 512, dtype=BF16) for n in (70, 5, 130)]
    tokens = [torch.randn(1, 1, 512, dtype=BF16) for _ in prompts]
    outs = decode_after_prompts(engine, prompts, tokens, 200)
    for prompt, token, out in zip(prompts, tokens, outs, strict=True):
        _, h = cached_block_steps(blocks, 200, [(prompt.to(DEV), 0), (token.to(DEV), prompt.shape[1])])
        assert rel_err(out, h.cpu()) < 2e-2
