"""The fast-path engine on CPU computes what the span's blocks compute: prefill and decode against the blocks'
own cached forward, batched ragged decode equal to each session alone, rollback, beam reordering, validation,
and the paged KV pool's accounting."""

from __future__ import annotations

import pytest
import torch

from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.span_engine import StepRequest, fused_model
from corolla.engine.spans.fast_llama import FastLlamaSpan
from corolla.models.registry import get_family
from corolla.utils.errors import AllocationFailed
from helpers.engine_reference import (
    cached_block_steps,
    check_hypo_reorder,
    check_merged_decode_equals_solo,
    check_rollback,
)
from helpers.tiny_models import tiny_config

H = 64  # tiny_config hidden size
MAX_LEN = 96


def make_blocks(family: str = "llama", num_layers: int = 3, seed: int = 0, **config_fields) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    config = tiny_config(family, num_layers)
    for name, value in config_fields.items():  # set after the config's own defaults
        setattr(config, name, value)
    blocks = [get_family(config).build_block(config, i) for i in range(num_layers)]
    for block in blocks:
        for p in block.parameters():  # norms away from 1 and biases away from 0, so every tensor matters
            if p.ndim > 1:
                torch.nn.init.normal_(p, std=0.15)
            else:
                torch.nn.init.normal_(p, mean=1.0 if p.shape[0] == H else 0.0, std=0.2)
        block.eval()
    return blocks


def make_engine(blocks, **overrides) -> SpanEngine:
    settings = dict(kv_pool_bytes=2 << 20, page_size_tokens=16, max_seq_len_tokens=128, max_batch_rows=8)
    settings.update(overrides)
    return SpanEngine.from_blocks(blocks, EngineConfig(**settings))


def run_steps(engine, session, steps):
    return [engine.step(session, x, position) for x, position in steps]


def assert_decode_matches_blocks(blocks, *, batch: int, prefix_tokens: int) -> None:
    """A prefill of `prefix_tokens` then 3 one-token steps of `batch` rows through the engine equal the blocks' own
    cached steps (atol 1e-4)."""
    engine = make_engine(blocks)
    steps = [(torch.randn(batch, prefix_tokens, H), 0)]
    steps += [(torch.randn(batch, 1, H), prefix_tokens + i) for i in range(3)]
    expected = cached_block_steps(blocks, MAX_LEN, steps)
    with engine.open_session(batch, MAX_LEN) as session:
        got = run_steps(engine, session, steps)
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prefill_then_decode_matches_blocks(family: str) -> None:
    blocks = make_blocks(family)
    engine = make_engine(blocks)
    steps = [(torch.randn(2, 21, H), 0)] + [(torch.randn(2, 1, H), 21 + i) for i in range(4)]
    steps.append((torch.randn(2, 5, H), 25))  # multi-token step on top of a cached prefix (spans pages)
    expected = cached_block_steps(blocks, MAX_LEN, steps)
    with engine.open_session(2, MAX_LEN) as session:
        got = run_steps(engine, session, steps)
        assert session.length_tokens == 30
    for out, ref in zip(got, expected, strict=True):
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_yarn_rope_steps_match_blocks(family: str) -> None:
    """YaRN (Qwen's long-context rope) multiplies cos and sin by its attention factor (1.14 at factor 4): the fused
    span (not an eager fallback) carries it in its rotary tables, so its steps are the blocks' own (without the
    factor they were 1.3 off)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32}
    blocks = make_blocks(family, rope_parameters=yarn)
    assert blocks[0].attn.rotary.attention_scaling > 1.1
    model, _ = fused_model(blocks, EngineConfig(kv_pool_bytes=1 << 20), max_positions=MAX_LEN)
    assert isinstance(model, FastLlamaSpan)
    assert_decode_matches_blocks(blocks, batch=2, prefix_tokens=21)


def test_a_rope_whose_frequencies_change_inside_the_span_refuses_the_fused_path() -> None:
    """Dynamic NTK rescales its frequencies past the trained length: fixed tables longer than that would serve later
    positions with the short frequencies, so the fused span refuses tables past it."""
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    blocks = make_blocks("llama", max_position_embeddings=32, rope_parameters=dynamic)
    with pytest.raises(ValueError, match="past 32 positions"):
        fused_model(blocks, EngineConfig(kv_pool_bytes=1 << 20), max_positions=MAX_LEN)
    model, _ = fused_model(blocks, EngineConfig(kv_pool_bytes=1 << 20), max_positions=32)  # the trained length
    assert isinstance(model, FastLlamaSpan)


def test_qwen2_sliding_window_steps_match_blocks() -> None:
    """Qwen2 with `use_sliding_window` slides its layers (`layer_types`) and the fused span has no window for them:
    a span serving positions past the window is refused for its blocks' own eager code, whose steps past the window
    are the blocks' (a fused span attending to every key was 5.6 off)."""
    sliding = dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"] * 2)
    blocks = make_blocks("qwen2", num_layers=2, **sliding)
    assert [block.attn.sliding_window for block in blocks] == [8, 8]
    engine = SpanEngine.from_blocks(blocks, EngineConfig(kv_pool_bytes=1 << 20, max_seq_len_tokens=MAX_LEN))
    assert not isinstance(engine.model, FastLlamaSpan)
    assert_decode_matches_blocks(blocks, batch=1, prefix_tokens=20)


def test_qwen2_sliding_window_past_the_served_positions_runs_fused() -> None:
    """A window no shorter than the positions a span serves never slides there: the fused span serves it (capped
    at the window), its steps the blocks' own."""
    sliding = dict(use_sliding_window=True, sliding_window=MAX_LEN, layer_types=["sliding_attention"] * 2)
    blocks = make_blocks("qwen2", num_layers=2, **sliding)
    model, _ = fused_model(blocks, EngineConfig(kv_pool_bytes=1 << 20), max_positions=MAX_LEN)
    assert isinstance(model, FastLlamaSpan) and model.spec.sliding_window_tokens == MAX_LEN
    assert_decode_matches_blocks(blocks, batch=2, prefix_tokens=21)


def test_batched_ragged_decode_equals_each_session_alone() -> None:
    blocks = make_blocks()
    solo, merged = make_engine(blocks), make_engine(blocks)
    prefixes = [3, 17, 40, 1, 33]  # different lengths: rows sit at different positions and pages
    batch_sizes = [1, 2, 1, 3, 1]
    prompts = [torch.randn(b, n, H) for b, n in zip(batch_sizes, prefixes, strict=True)]
    tokens = [[torch.randn(b, 1, H) for _ in range(3)] for b in batch_sizes]
    check_merged_decode_equals_solo(solo, merged, prompts, tokens, MAX_LEN)  # 8 rows = max_batch_rows: one forward


def test_decode_many_splits_batches_above_max_rows() -> None:
    blocks = make_blocks(num_layers=1)
    engine = make_engine(blocks, max_batch_rows=2)
    sessions = [engine.open_session(1, MAX_LEN) for _ in range(5)]
    xs = [torch.randn(1, 1, H) for _ in sessions]
    outs = engine.decode_many([StepRequest(s, x, 0) for s, x in zip(sessions, xs, strict=True)])
    ref = [cached_block_steps(blocks, MAX_LEN, [(x, 0)])[0] for x in xs]
    for out, r in zip(outs, ref, strict=True):
        torch.testing.assert_close(out, r, atol=1e-5, rtol=0)


def test_rollback_overwrites_from_the_given_position() -> None:
    blocks = make_blocks()
    check_rollback(make_engine(blocks), blocks, H, MAX_LEN)


def test_hypo_ids_reorder_rows() -> None:
    blocks = make_blocks()
    check_hypo_reorder(make_engine(blocks), blocks, H, MAX_LEN)


def test_invalid_steps_raise_value_error_naming_the_limit() -> None:
    engine = make_engine(make_blocks(num_layers=1))
    with engine.open_session(2, 10) as session:
        with pytest.raises(ValueError, match="Maximum length exceeded"):
            engine.step(session, torch.randn(2, 11, H), 0)
        with pytest.raises(ValueError, match=r"must lie in \[0, 0\]"):
            engine.step(session, torch.randn(2, 1, H), 3)  # skipping ahead would read unwritten keys
        with pytest.raises(ValueError, match="hidden states must be"):
            engine.step(session, torch.randn(1, 1, H), 0)
        with pytest.raises(ValueError, match="hypo_ids"):
            engine.step(session, torch.randn(2, 1, H), 0, hypo_ids=torch.tensor([0, 5]))
        assert engine.step(session, torch.randn(2, 0, H), 0).shape == (2, 0, H)
    with pytest.raises(ValueError, match="closed"):
        engine.step(session, torch.randn(2, 1, H), 0)
    with pytest.raises(ValueError, match="max = 128"):
        engine.open_session(1, 129)


def test_pool_reserves_all_or_nothing_and_frees_on_exit() -> None:
    page_bytes = 2 * 1 * 16 * 2 * 16 * 4  # K and V x 1 layer x 16 tokens x 2 kv heads x 16 dims x fp32
    engine = make_engine(make_blocks(num_layers=1), kv_pool_bytes=9 * page_bytes)  # + the trash page
    pool = engine.pool
    assert pool.num_pages == 10 and pool.pages_free == 9  # page 0 is the trash page
    with engine.open_session(2, 64) as s:  # 4 pages each
        assert pool.pages_free == 1
        assert 0 not in {p for slot in s.slots for p in slot.pages}
        with pytest.raises(AllocationFailed):
            engine.open_session(1, 32)
        assert pool.pages_free == 1  # nothing taken by the failed attempt
    assert pool.pages_free == 9
    s.close()  # idempotent
    assert pool.pages_free == 9


def test_fused_span_refuses_unsupported_blocks_which_then_run_eagerly() -> None:
    config = tiny_config("falcon", 1)
    config.activation = "relu"  # the Falcon/BLOOM span implements GELU MLPs only
    block = get_family(config).build_block(config, 0)
    with pytest.raises(ValueError, match="GELU"):
        fused_model([block], EngineConfig(kv_pool_bytes=1 << 20), max_positions=64)
    assert not SpanEngine.from_blocks([block], EngineConfig(kv_pool_bytes=1 << 20)).fused


def test_sliding_window_limits_the_fused_session_length_so_the_blocks_run_eagerly() -> None:
    blocks = make_blocks("mistral", num_layers=1)  # tiny mistral: window of 12 tokens
    config = EngineConfig(kv_pool_bytes=1 << 20)
    model, adapters = fused_model(blocks, config, max_positions=64)
    fused = SpanEngine(model, config, adapters=adapters)
    assert fused.max_seq_len_tokens == 12
    with pytest.raises(ValueError, match="max = 12"):
        fused.open_session(1, 13)
    engine = make_engine(blocks)  # longer sessions than the window: the blocks slide it themselves
    assert not engine.fused and engine.max_seq_len_tokens > 12
    engine.open_session(1, 13).close()
