"""The work `prefill_graphs` captures on CUDA, run eagerly on the CPU (`capture=False`): chunks padded to a row
bucket compute what the eager engine computes, for prefixes of any length and layer ranges; padding rows write
only into the trash page, also after a longer chunk filled the static buffers."""

from __future__ import annotations

import torch

from corolla.engine.config import EngineConfig
from corolla.engine.graphs.prefill_graphs import PrefillGraphs, chunk_bucket
from corolla.engine.kv.kv_pool import TRASH_PAGE
from corolla.engine.span_engine import SpanEngine
from corolla.engine.spans.fast_llama import FastLlamaSpan
from corolla.engine.spans.span_model import table_slots
from corolla.engine.step_request import StepRequest
from corolla.models.registry import get_family
from helpers.tiny_models import tiny_config

PAGE = 16


def make_engine() -> SpanEngine:
    torch.manual_seed(0)
    config = tiny_config("llama", 3)
    blocks = [get_family(config).build_block(config, i).eval() for i in range(3)]
    engine_config = EngineConfig(kv_pool_bytes=1 << 20, page_size_tokens=PAGE, max_seq_len_tokens=128, max_batch_rows=4)
    return SpanEngine.from_blocks(blocks, engine_config)


def test_buckets() -> None:
    assert [chunk_bucket(t) for t in (1, 8, 9, 16, 17, 32, 33, 132, 256)] == [8, 8, 16, 16, 32, 32, 64, 160, 256]


@torch.inference_mode()
def test_padded_chunks_compute_what_the_eager_engine_does_and_write_only_their_own_pages() -> None:
    engine = make_engine()
    model, pool = engine.model, engine.pool
    assert isinstance(model, FastLlamaSpan) and engine.prefill_graphs is None  # the CPU engine runs chunks eagerly
    graphs = PrefillGraphs(model, pool, 64, capture=False)
    hidden = torch.randn(1, 128, engine.hidden_size)
    bystander = engine.open_session(1, 128)
    engine.step(bystander, hidden[:, :100], 0)
    # (start, tokens, layers): 30 rows then 20 in the same 32-row bucket (the second's padding rows find the first's
    # slots in the static buffers), a prefix of 122 up to the sequence's last position, a span's middle layer
    for start, tokens, layers in (
        (40, 30, (0, 3)),
        (37, 20, (0, 3)),
        (0, 5, (0, 3)),
        (122, 6, (0, 3)),
        (16, 9, (1, 2)),
    ):
        want_session = engine.open_session(1, 128, layers=layers)
        want = engine.step(want_session, hidden[:, : start + tokens], 0)[0, start:]  # [t, H]
        session = engine.open_session(1, 128, layers=layers)
        if start:
            engine.step(session, hidden[:, :start], 0)
        engine.validate(StepRequest(session, hidden[:, start : start + tokens], start))  # the chunk's pages taken
        slot = session.slots[0]
        before = pool.k.clone(), pool.v.clone()
        got = graphs.run(hidden[0, start : start + tokens], start, slot, layers)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        written = {int(slot.table[p // PAGE]) for p in range(start, start + tokens)}
        for cache, old in zip((pool.k, pool.v), before, strict=True):
            changed = {int(p) for p in (cache != old).transpose(0, 1).flatten(1).any(1).nonzero().flatten()}
            assert changed <= written | {TRASH_PAGE}, (start, tokens, changed, written)
        positions = torch.arange(start + tokens)
        ours, theirs = (table_slots(s.table, positions, PAGE) for s in (slot, want_session.slots[0]))  # [L] each
        for cache in (pool.k, pool.v):  # the keys and values the chunk wrote equal the eager session's
            flat = cache[layers[0] : layers[1]].flatten(1, 2)  # [layers, pages * page, heads, D]
            torch.testing.assert_close(flat[:, ours], flat[:, theirs], rtol=1e-4, atol=1e-4)
        session.close()
        want_session.close()
    assert graphs.chunks == 5 and graphs.graph_count == 0  # nothing captured on the CPU
    bystander.close()


@torch.inference_mode()
def test_warmup_runs_every_bucket_on_the_trash_page_only() -> None:
    engine = make_engine()
    model, pool = engine.model, engine.pool
    assert isinstance(model, FastLlamaSpan)
    session = engine.open_session(1, 128)
    engine.step(session, torch.randn(1, 100, engine.hidden_size), 0)
    before = pool.k.clone(), pool.v.clone()
    graphs = PrefillGraphs(model, pool, 64, capture=False)
    assert graphs.buckets == [8, 16, 32, 64]
    graphs.h.normal_()  # (zeros would write zero keys over the zero trash page: no trace of the work)
    graphs.warmup((0, 3))
    for cache, old in zip((pool.k, pool.v), before, strict=True):
        changed = {int(p) for p in (cache != old).transpose(0, 1).flatten(1).any(1).nonzero().flatten()}
        assert changed == {TRASH_PAGE}  # every bucket's work ran (its keys written), into the trash page only
    assert graphs.chunks == 0 and graphs.graph_count == 0 and graphs.warmup_s > 0
    session.close()
