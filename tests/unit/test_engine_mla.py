"""The DeepSeek-V3 fast path (`engine.spans.fast_mla`) on CPU computes what the plain corolla blocks compute: prefill and
absorbed-form decode against the blocks' own latent-cached forward (with and without q_lora, interleaved or
rotate-half rope, biases), several sessions merged into one ragged batch, rollback, beam reordering; the pool's
pages hold the latent + rotary key only (bytes per token = the MLA formula); the graph-safe router equals the
block's router."""

from __future__ import annotations

import pytest
import torch

from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.kv.kv_pool import KVLayout
from corolla.engine.span_engine import fused_model
from corolla.engine.spans.fast_mla import FastMlaSpan
from corolla.models.deepseek_v3.moe import group_limited_route
from corolla.models.registry import get_family
from corolla.models.sizing import kv_cache_bytes_per_token
from helpers.engine_reference import (
    cached_block_steps,
    check_hypo_reorder,
    check_merged_decode_equals_solo,
    check_rollback,
)
from helpers.executor_runs import randomize_
from helpers.tiny_models_fam_a import tiny_config_of

MAX_LEN = 96
VARIANTS = {
    "q_lora_interleaved": {},
    "q_proj_rotate_half_bias": {"q_lora_rank": None, "rope_interleave": False, "attention_bias": True},
    "yarn": {  # DeepSeek-V3's own rope: YaRN with mscale (the softmax scale grows by mscale^2)
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    },
}


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def make_config(num_layers: int = 3, **changes):
    config = tiny_config_of("deepseek_v3", num_layers)  # layer 0 dense, then MoE layers
    for name, value in changes.items():
        setattr(config, name, value)
    return config


def make_blocks(num_layers: int = 3, seed: int = 0, **changes) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    config = make_config(num_layers, **changes)
    return [randomize_(get_family(config).build_block(config, i)) for i in range(num_layers)]


def make_engine(blocks, **overrides) -> SpanEngine:
    settings = dict(kv_pool_bytes=1 << 20, page_size_tokens=16, max_seq_len_tokens=128, max_batch_rows=8)
    settings.update(overrides)
    return SpanEngine.from_blocks(blocks, EngineConfig(**settings))


def hidden_size(blocks) -> int:
    return int(blocks[0].config.hidden_size)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_then_decode_matches_blocks(variant: str) -> None:
    blocks = make_blocks(**VARIANTS[variant])
    engine = make_engine(blocks)
    assert isinstance(engine.model, FastMlaSpan)
    h = hidden_size(blocks)
    steps = [(torch.randn(2, 21, h), 0)] + [(torch.randn(2, 1, h), 21 + i) for i in range(4)]
    steps.append((torch.randn(2, 5, h), 25))  # multi-token step on top of a cached prefix (spans pages)
    steps.append((torch.randn(2, 1, h), 30))
    expected = cached_block_steps(blocks, MAX_LEN, steps)
    with engine.open_session(2, MAX_LEN) as session:
        got = [engine.step(session, x, position) for x, position in steps]
        assert session.length_tokens == 31
    for out, ref in zip(got, expected, strict=True):
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_pool_pages_hold_the_latent_and_rope_key_only() -> None:
    blocks = make_blocks(num_layers=2)
    config = blocks[0].config
    engine = make_engine(blocks)
    pool = engine.pool
    c, r = int(config.kv_lora_rank), int(config.qk_rope_head_dim)
    assert pool.layout == KVLayout((1, c), (1, r))
    assert tuple(pool.k.shape[2:]) == (16, 1, c) and tuple(pool.v.shape[2:]) == (16, 1, r)
    per_token = (c + r) * 4 * 2  # fp32, two layers
    assert pool.page_bytes == 16 * per_token == 16 * kv_cache_bytes_per_token(config, torch.float32) * 2
    assert pool.num_pages == (1 << 20) // pool.page_bytes + 1  # + the trash page
    per_head_kv = 2 * int(config.num_attention_heads) * (int(config.qk_nope_head_dim) + r)
    assert c + r < per_head_kv  # the point of the latent cache (even at these tiny shapes)


def test_batched_ragged_decode_equals_each_session_alone() -> None:
    blocks = make_blocks()
    h = hidden_size(blocks)
    solo, merged = make_engine(blocks), make_engine(blocks)
    prefixes, batch_sizes = [3, 17, 40, 1], [1, 2, 1, 3]  # rows at different positions and pages; 7 rows
    prompts = [torch.randn(b, n, h) for b, n in zip(batch_sizes, prefixes, strict=True)]
    tokens = [[torch.randn(b, 1, h) for _ in range(2)] for b in batch_sizes]
    check_merged_decode_equals_solo(solo, merged, prompts, tokens, MAX_LEN)  # one forward of 7 rows a step


def test_rollback_and_beam_reordering() -> None:
    blocks = make_blocks()
    h = hidden_size(blocks)
    engine = make_engine(blocks)
    check_rollback(engine, blocks, h, MAX_LEN)
    check_hypo_reorder(engine, blocks, h, MAX_LEN)  # latent pages copied between rows


def test_sub_span_sessions_and_deep_prompts() -> None:
    blocks = make_blocks()
    h = hidden_size(blocks)
    engine = make_engine(blocks)
    x, tok = torch.randn(1, 6, h), torch.randn(1, 1, h)
    prompts = torch.randn(2, 1, 4, h) * 0.1  # [layers of the session, 1, P, H]
    sub = blocks[1:]  # the MoE layers only

    def with_prompt(j: int, hidden: torch.Tensor, position: int) -> torch.Tensor:
        out = hidden.clone()
        overlap = max(0, min(4 - position, hidden.shape[1]))
        out[:, :overlap] += prompts[j, :, position : position + overlap]
        return out

    caches = [[d.make_zeros() for d in blk.cache_descriptors(1, MAX_LEN)] for blk in sub]
    expected = []
    with torch.no_grad():
        for hidden, position in ((x, 0), (tok, 6)):
            for j, (blk, cache) in enumerate(zip(sub, caches, strict=True)):
                hidden = blk(with_prompt(j, hidden, position), cache=cache, position=position)
            expected.append(hidden)
    with engine.open_session(1, MAX_LEN, layers=(1, 3)) as session:
        got = [engine.step(session, x, 0, prompts=prompts), engine.step(session, tok, 6, prompts=prompts)]
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_group_limited_route_equals_the_blocks_router() -> None:
    blocks = make_blocks(num_layers=2, seed=3)
    moe = blocks[1].mlp
    x = torch.randn(64, hidden_size(blocks))
    ref_w, ref_i = moe.route(x)
    w, i = group_limited_route(
        x, moe.router.weight, moe.e_score_correction_bias, top_k=moe.top_k, num_groups=moe.n_group,
        topk_groups=moe.topk_group, normalize=moe.norm_topk_prob, scaling=moe.routed_scaling_factor,
    )  # fmt: skip
    order, ref_order = i.argsort(dim=1), ref_i.argsort(dim=1)  # the same set of experts per token, any order
    assert torch.equal(i.gather(1, order), ref_i.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order))
    assert len(torch.unique(i)) > 2  # the inputs exercise several experts and groups


def test_active_bytes_count_the_chosen_experts_only() -> None:
    blocks = make_blocks(num_layers=2)
    span = FastMlaSpan.from_blocks(blocks, max_positions=64)
    config = blocks[0].config
    expert = 3 * int(config.hidden_size) * int(config.moe_intermediate_size) * 4
    unused = (int(config.n_routed_experts) - int(config.num_experts_per_tok)) * expert
    assert span.weight_bytes() == sum(p.numel() * 4 for b in blocks for p in b.parameters())
    assert span.active_weight_bytes() == span.weight_bytes() - unused


def test_unsupported_deepseek_blocks_are_refused_by_the_fused_span_and_run_eagerly() -> None:
    blocks = make_blocks(num_layers=1, hidden_act="gelu")
    with pytest.raises(ValueError, match="silu"):
        fused_model(blocks, EngineConfig(kv_pool_bytes=1 << 20), max_positions=64)
    assert not make_engine(blocks).fused


def test_kv_layout_refuses_empty_or_non_positive_token_shapes() -> None:
    for shapes in [((), (1, 8)), ((1, 0), (1, 8)), ((1, 16), (-1, 8))]:
        with pytest.raises(ValueError, match="KVLayout"):
            KVLayout(*shapes)
    assert KVLayout.latent(512, 64).bytes_per_token(torch.bfloat16, 61) == 61 * 576 * 2  # DeepSeek-V3's 61 layers
    assert KVLayout.heads(8, 128).values_per_token == 2 * 8 * 128


def test_reference_attention_reads_only_up_to_the_longest_row() -> None:
    """The torch decode attention outside graph capture is bounded by the real lengths: table entries past the
    longest row name pages that do not exist (gathering them would raise), and a NaN page inside the gathered
    width but past a row's length never reaches the output."""
    from corolla.engine.kernels.mla_kernels import paged_latent_attention

    torch.manual_seed(5)
    page, c, r = 16, 24, 8
    latent, rope = torch.randn(4, page, 1, c), torch.randn(4, page, 1, r)
    latent[3], rope[3] = float("nan"), float("nan")
    tables = torch.tensor([[0, 3], [1, 2]], dtype=torch.int32)  # row 0 (3 tokens) must not read page 3
    wide = torch.cat([tables, torch.full((2, 998), 10**6, dtype=torch.int32)], dim=1)  # [B, 1000]
    q_lat, q_rope = torch.randn(2, 4, c), torch.randn(2, 4, r)
    lens = torch.tensor([3, 20], dtype=torch.int32)
    got = paged_latent_attention(q_lat, q_rope, latent, rope, wide, lens, 0.5)  # [B, n, c]
    assert torch.isfinite(got).all()
    for i in range(2):  # each row alone over its own pages, computed directly
        n = int(lens[i])
        lat = latent[tables[i].long()].reshape(-1, c)[:n]  # [n, c]
        key = rope[tables[i].long()].reshape(-1, r)[:n]
        probs = ((q_lat[i] @ lat.T + q_rope[i] @ key.T) * 0.5).softmax(-1)  # [heads, n]
        torch.testing.assert_close(got[i], probs @ lat)
