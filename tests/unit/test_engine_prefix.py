"""The engine's prefix caching over real blocks, fused and eager: a session that starts with the pages an earlier
session published computes what a session without them computes, a rollback into shared pages leaves the cached
copy intact, and keys of another identity or layer span reuse nothing."""

from __future__ import annotations

import pytest
import torch

import helpers.tiny_models_fam_a as fam_a  # registers deepseek_v3
import helpers.tiny_models_fam_b as fam_b  # registers gemma2
from corolla.engine.config import EngineConfig
from corolla.engine.span_engine import SpanEngine
from corolla.models.registry import get_family
from corolla.protocol.prefix import PrefixKeys, chain_hashes, prefix_root
from helpers.tiny_models import tiny_config

PAGE = 16
H = 64


def make_engine(family: str, fused: bool) -> SpanEngine:
    assert fam_a is not None and fam_b is not None
    torch.manual_seed(0)
    config = tiny_config(family, 2)
    blocks = [get_family(config).build_block(config, i).eval() for i in range(2)]
    engine_config = EngineConfig(kv_pool_bytes=1 << 20, page_size_tokens=PAGE, max_seq_len_tokens=128, max_batch_rows=8)
    engine = SpanEngine.from_blocks(blocks, engine_config, fused=fused)
    assert engine.fused == fused
    return engine


def keys_of(tokens: list[int], first_block: int = 0) -> PrefixKeys:
    hashes = chain_hashes(prefix_root(model="tiny"), tokens)
    return PrefixKeys(first_block, tuple(hashes[first_block:]))


@torch.no_grad()
def run(engine: SpanEngine, session, hidden: torch.Tensor, start: int, decode_from: int | None = None) -> torch.Tensor:
    """Positions [start, end) of `hidden` [1, end, H]: one prefill step up to `decode_from`, then one step per token."""
    end = hidden.shape[1]
    split = end if decode_from is None else decode_from
    outs = [engine.step(session, hidden[:, start:split], start)] if split > start else []
    outs += [engine.step(session, hidden[:, p : p + 1], p) for p in range(split, end)]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize(
    ("family", "fused"),
    [("llama", True), ("llama", False), ("bloom", True), ("mixtral", False), ("deepseek_v3", True), ("gemma2", False)],
)  # llama-family fused and eager, fused dense (ALiBi), MoE eager, MLA fused (latent pages), sliding window eager
def test_a_session_on_cached_pages_computes_what_a_fresh_one_does(family: str, fused: bool) -> None:
    engine = make_engine(family, fused)
    pool = engine.pool
    tokens = list(range(3, 3 + 70))
    hidden = torch.randn(1, 70, H)
    # turn 1: a 40-token prompt and 10 generated tokens, their keys sent as the tokens become known
    with engine.open_session(1, 128) as first:
        assert engine.attach_prefix(first, "alice", keys_of(tokens[:40])) == 0  # nothing cached yet
        run(engine, first, hidden[:, :50], 0, decode_from=40)
        engine.add_prefix_keys(first, "alice", keys_of(tokens[:50], first_block=2))
    assert pool.layer_pages_cached == 3 * 2  # pages ending at 16, 32, 48 (each over both layers)

    # turn 2 reuses 48 positions and computes the rest; a session without the cache computes all 70
    with engine.open_session(1, 128) as second:
        assert engine.attach_prefix(second, "alice", keys_of(tokens)) == 48
        assert second.length_tokens == 48
        reused = run(engine, second, hidden, 48)
    with engine.open_session(1, 128) as plain:
        full = run(engine, plain, hidden, 0)
    torch.testing.assert_close(reused, full[:, 48:], rtol=1e-4, atol=1e-4)
    assert pool.layer_pages_cached == 4 * 2  # the page ending at 64 too

    # a rollback into a shared page (another server of the chain held less) copies it; the cache stays intact
    with engine.open_session(1, 128) as third, engine.open_session(1, 128) as sharer:
        assert engine.attach_prefix(sharer, "alice", keys_of(tokens)) == 64
        assert engine.attach_prefix(third, "alice", keys_of(tokens)) == 64
        rolled = run(engine, third, hidden, 40)
        torch.testing.assert_close(rolled, full[:, 40:], rtol=1e-4, atol=1e-4)
        assert third.slots[0].pages[2] != sharer.slots[0].pages[2]  # the page holding position 40 was copied
        run(engine, third, torch.randn(1, 48, H), 40)  # other tokens from 40 on: only third's own copy changes
        again = run(engine, sharer, hidden, 64)
        torch.testing.assert_close(again, full[:, 64:], rtol=1e-4, atol=1e-4)

    # other identities and other layer spans find nothing
    with engine.open_session(1, 128) as mallory, engine.open_session(1, 128, layers=(0, 1)) as partial:
        assert engine.attach_prefix(mallory, "mallory", keys_of(tokens)) == 0
        assert engine.attach_prefix(partial, "alice", keys_of(tokens)) == 0
    assert pool.layer_pages_taken == 0


def test_only_single_sequence_sessions_reuse_and_keys_stay_bounded() -> None:
    engine = make_engine("llama", True)
    tokens = list(range(64))
    with engine.open_session(2, 64) as beams:  # keys name one sequence: a batch reuses and publishes nothing
        assert engine.attach_prefix(beams, "alice", keys_of(tokens)) == 0
        assert beams.prefix is None
    with engine.open_session(1, 32) as short:
        engine.add_prefix_keys(short, "alice", keys_of(tokens))
        assert short.prefix is not None and len(short.prefix.hashes) == 2  # blocks past max_length are dropped
        with pytest.raises(ValueError, match="identity"):
            engine.add_prefix_keys(short, "mallory", keys_of(tokens))
    with engine.open_session(1, 64) as started:
        engine.step(started, torch.randn(1, 3, H), 0)
        with pytest.raises(ValueError, match="first position"):
            engine.attach_prefix(started, "alice", keys_of(tokens))
