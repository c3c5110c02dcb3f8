"""Short prefill chunks replayed as one CUDA graph over the span's layers (`engine.graphs.prefill_graphs`) on a real GPU:
the turn after a cached prefix equals the eager engine's, one row bucket's graph serves prefixes of different
lengths, padding rows leave other sessions' pages alone, and the graphs' memory is reported; the engine's warm-up
chooses (compiles) every bucket's attention launch, so no chunk does. Skipped without CUDA."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from corolla.engine import EngineConfig, SpanEngine
from corolla.models.registry import get_family
from corolla.protocol.prefix import PrefixKeys, chain_hashes, prefix_root
from helpers.numerics import rel_err

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def make_engines() -> tuple[SpanEngine, SpanEngine]:
    """(graphs, eager) engines over the same bf16 llama blocks (head size 64, grouped K/V heads)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=512, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3, intermediate_size=1024,
        max_position_embeddings=4096, rope_theta=500000.0,
    )  # fmt: skip
    blocks = []
    for i in range(3):
        block = get_family(config).build_block(config, i)
        for p in block.parameters():
            torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.1 if p.ndim == 1 else 0.03)
        blocks.append(block.to(DEV, BF16).eval())
    settings = dict(
        kv_pool_bytes=256 << 20, page_size_tokens=64, max_seq_len_tokens=2048, max_batch_rows=4, tune_gemm=False
    )  # (no GEMM timing at warm-up)
    graphs = SpanEngine.from_blocks(blocks, EngineConfig(**settings, prefill_graph_tokens=256))
    eager = SpanEngine.from_blocks(blocks, EngineConfig(**settings, prefill_graph_tokens=0))
    assert graphs.prefill_graphs is not None and eager.prefill_graphs is None
    return graphs, eager


@torch.inference_mode()
def test_turns_after_cached_prefixes_equal_the_eager_engine() -> None:
    graphs_engine, eager_engine = make_engines()
    graphs = graphs_engine.prefill_graphs
    assert graphs is not None
    prompt = (torch.randn(1, 900, 512, device=DEV) * 0.5).to(BF16)  # [1, T, H]
    tokens = list(range(5, 905))
    root = prefix_root(model="gpu-test")
    with graphs_engine.open_session(1, 1024) as first:  # turn 1, published when it closes
        graphs_engine.attach_prefix(first, "ns", PrefixKeys(0, tuple(chain_hashes(root, tokens[:700]))))
        graphs_engine.step(first, prompt[:, :700], 0)
    bystander = graphs_engine.open_session(1, 1024)
    graphs_engine.step(bystander, prompt[:, :300], 0)
    pages = [int(p) for p in bystander.slots[0].pages]
    kept = graphs_engine.pool.k[:, pages].clone()
    for history, new in ((700, 100), (300, 37), (600, 110)):  # chunks of 160, 81 and 134 rows after 640, 256, 576
        keys = PrefixKeys(0, tuple(chain_hashes(root, tokens[:history])))
        with graphs_engine.open_session(1, 1024) as session:
            hit = graphs_engine.attach_prefix(session, "ns", keys)
            assert hit == history // 64 * 64
            got = graphs_engine.step(session, prompt[:, hit : history + new], hit)  # [1, t, H]
            decoded = graphs_engine.step(session, prompt[:, history + new : history + new + 1], history + new)
        with eager_engine.open_session(1, 1024) as session:
            want = eager_engine.step(session, prompt[:, : history + new], 0)[:, hit:]
            want_decoded = eager_engine.step(session, prompt[:, history + new : history + new + 1], history + new)
        assert rel_err(got, want) < 2e-2, (history, new)
        assert rel_err(decoded, want_decoded) < 2e-2, (history, new)
    assert torch.equal(graphs_engine.pool.k[:, pages], kept)  # padding rows wrote into the trash page only
    bystander.close()
    assert graphs.capture_error is None and graphs.chunks == 3
    assert graphs.graph_count == 2  # 160 and 96 rows; 160 served two prefixes
    assert set(graphs.attention_configs) == {160, 96}
    assert 0 <= graphs.reserved_bytes < 256 << 20


@torch.inference_mode()
def test_warmup_leaves_no_launch_to_choose_to_the_first_chunk() -> None:
    engine, eager_engine = make_engines()
    graphs = engine.prefill_graphs
    assert graphs is not None
    prompt = (torch.randn(1, 400, 512, device=DEV) * 0.5).to(BF16)  # [1, T, H]
    bystander = engine.open_session(1, 1024)
    engine.step(bystander, prompt[:, :300], 0)  # (longer than the graphs take: eager)
    pages = [int(p) for p in bystander.slots[0].pages]
    kept = engine.pool.k[:, pages].clone(), engine.pool.v[:, pages].clone()
    engine.warmup()
    assert set(graphs.attention_configs) == set(graphs.buckets) == {8, 16, *range(32, 257, 32)}
    assert graphs.graph_count == 0 and graphs.capture_error is None and graphs.warmup_s > 0
    assert torch.equal(engine.pool.k[:, pages], kept[0]) and torch.equal(engine.pool.v[:, pages], kept[1])
    chosen = dict(graphs.attention_configs)
    with engine.open_session(1, 1024) as session:  # a chunk of 100 rows (bucket 128) after 300 positions
        engine.step(session, prompt[:, :300], 0)
        got = engine.step(session, prompt[:, 300:], 300)
    with eager_engine.open_session(1, 1024) as session:
        want = eager_engine.step(session, prompt, 0)[:, 300:]
    assert rel_err(got, want) < 2e-2
    assert graphs.attention_configs == chosen and graphs.graph_count == 1 and graphs.chunks == 1
    bystander.close()
