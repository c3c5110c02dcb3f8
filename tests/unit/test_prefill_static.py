"""The static-shape prefill chunk that `prefill_graphs` captures on CUDA, run eagerly on the CPU: padded rows and
keys gathered past the sequence change nothing; the chunk's outputs and the keys/values it writes equal the
eager chunk's, and padding rows write only into the trash page."""

from __future__ import annotations

import pytest
import torch

from corolla.engine.config import EngineConfig
from corolla.engine.fast_llama import FastLlamaSpan
from corolla.engine.kv_pool import TRASH_PAGE
from corolla.engine.prefill_graphs import chunk_bucket, key_bucket
from corolla.engine.span_engine import SpanEngine
from corolla.engine.step_request import StepRequest
from corolla.models.registry import get_family
from helpers.tiny_models import tiny_config

PAGE = 16


def make_engine() -> SpanEngine:
    torch.manual_seed(0)
    config = tiny_config("llama", 2)
    blocks = [get_family(config).build_block(config, i).eval() for i in range(2)]
    engine_config = EngineConfig(kv_pool_bytes=1 << 20, page_size_tokens=PAGE, max_seq_len_tokens=128, max_batch_rows=4)
    engine = SpanEngine.from_blocks(blocks, engine_config)
    assert isinstance(engine.model, FastLlamaSpan)
    return engine


def test_buckets() -> None:
    assert [chunk_bucket(t) for t in (1, 8, 9, 16, 17, 32, 33, 132, 256)] == [8, 8, 16, 16, 32, 32, 64, 160, 256]
    assert [key_bucket(n) for n in (1, 1024, 1025, 4100)] == [1024, 1024, 2048, 5120]


@pytest.mark.parametrize(
    ("start", "tokens", "rows", "key_tokens"), [(0, 5, 8, 16), (40, 13, 16, 64), (37, 16, 32, 96), (122, 5, 8, 128)]
)
@torch.inference_mode()
def test_static_chunk_equals_the_eager_chunk(start: int, tokens: int, rows: int, key_tokens: int) -> None:
    engine = make_engine()
    model, pool = engine.model, engine.pool
    assert isinstance(model, FastLlamaSpan)
    hidden = torch.randn(1, start + tokens, engine.hidden_size)
    eager = engine.open_session(1, 128)
    static = engine.open_session(1, 128)
    want = engine.step(eager, hidden, 0)[0, start:]  # [t, H]
    if start:
        engine.step(static, hidden[:, :start], 0)
    slot = static.slots[0]
    engine.validate(StepRequest(static, hidden[:, start:], start))  # the chunk's pages taken
    before = [(k.clone(), v.clone()) for k, v in zip(pool.k, pool.v, strict=True)]
    padded = torch.randn(rows, engine.hidden_size)  # rows past `tokens` hold anything
    padded[:tokens] = hidden[0, start:]
    cu_q = torch.tensor([0, tokens], dtype=torch.int32)
    cu_k = torch.tensor([0, start + tokens], dtype=torch.int32)
    got = model.prefill_static(padded, slot.table, cu_q, cu_k, key_tokens, pool, (0, model.num_layers))
    torch.testing.assert_close(got[:tokens], want, rtol=1e-4, atol=1e-4)

    written = {int(slot.table[p // PAGE]) for p in range(start, start + tokens)}
    for layer, (k_before, _) in enumerate(before):
        changed = {int(p) for p in (pool.k[layer] != k_before).flatten(1).any(1).nonzero().flatten()}
        assert changed <= written | {TRASH_PAGE}, (layer, changed, written)
        eager_slot = eager.slots[0]
        for p in range(start + tokens):  # the keys and values the chunk wrote equal the eager session's
            a, b = int(slot.table[p // PAGE]), int(eager_slot.table[p // PAGE])
            torch.testing.assert_close(pool.k[layer][a, p % PAGE], pool.k[layer][b, p % PAGE], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(pool.v[layer][a, p % PAGE], pool.v[layer][b, p % PAGE], rtol=1e-4, atol=1e-4)
    eager.close()
    static.close()
