"""A block split over several (CPU) devices computes what the unsplit block computes, with the same forward and
KV-cache contract; head splits that cannot be even are refused."""

from __future__ import annotations

import copy

import pytest
import torch

from corolla.engine import EngineConfig, SpanEngine
from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from corolla.models.tensor_parallel import make_tensor_parallel
from helpers.tiny_models import FAMILIES, make_tiny_model

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _block(family, tmp_path):
    model_dir = make_tiny_model(family, tmp_path)
    return load_pretrained_block(model_dir, 1, config=load_config(model_dir), torch_dtype=torch.float32)


@pytest.mark.parametrize("family", FAMILIES)
def test_split_block_equals_unsplit(family, tmp_path):
    block = _block(family, tmp_path)
    split = make_tensor_parallel(copy.deepcopy(block), ["cpu", "cpu"])
    assert len(split.attn.shards) == 2
    total_kv = sum(d.shape[1] for d in split.cache_descriptors(1, 8)) // 2
    assert total_kv >= sum(d.shape[1] for d in block.cache_descriptors(1, 8)) // 2  # MQA replicates its KV head
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        torch.testing.assert_close(split(x), block(x), atol=1e-5, rtol=0)
        block_cache = [d.make_zeros() for d in block.cache_descriptors(2, 16)]
        split_cache = [d.make_zeros() for d in split.cache_descriptors(2, 16)]
        position = 0
        for n in (6, 1, 2):
            chunk = x[:, position : position + n]
            torch.testing.assert_close(
                split(chunk, cache=split_cache, position=position),
                block(chunk, cache=block_cache, position=position),
                atol=1e-5,
                rtol=0,
            )
            position += n
        torch.testing.assert_close(  # rollback
            split(x[:, 3:5], cache=split_cache, position=3),
            block(x[:, 3:5], cache=block_cache, position=3),
            atol=1e-5,
            rtol=0,
        )

    # autograd flows through the shards: input gradients match
    grads = []
    for b in (block, split):
        inp = x.clone().requires_grad_(True)
        b(inp).square().sum().backward()
        grads.append(inp.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "falcon_mq", "bloom"])
def test_split_block_runs_eagerly_over_the_engine_pool(family, tmp_path):
    """A tensor-parallel span's shards read and write their heads of the engine's one pool: steps (prefill,
    decode, rollback) equal the unsplit block on its own contiguous cache."""
    block = _block(family, tmp_path)
    split = make_tensor_parallel(copy.deepcopy(block), ["cpu", "cpu"])
    engine = SpanEngine.from_blocks([split], EngineConfig(kv_pool_bytes=1 << 20, page_size_tokens=16,
                                                          max_seq_len_tokens=64), fused=False)  # fmt: skip
    heads = sum(d.shape[1] for d in split.cache_descriptors(1, 8)) // 2
    assert engine.pool.layout.k_token_shape[0] == heads
    x = torch.randn(2, 20, 64)
    block_cache = [d.make_zeros() for d in block.cache_descriptors(2, 32)]
    with torch.no_grad(), engine.open_session(2, 32) as session:
        for start, end in ((0, 17), (17, 18), (18, 20), (15, 17)):  # prefill over two pages, decode, rollback
            torch.testing.assert_close(
                engine.step(session, x[:, start:end], start),
                block(x[:, start:end], cache=block_cache, position=start),
                atol=1e-5,
                rtol=0,
            )


def test_four_way_split_and_uneven_split_refused(tmp_path):
    block = _block("llama", tmp_path)  # 4 heads, 2 KV heads
    split = make_tensor_parallel(copy.deepcopy(block), ["cpu"] * 4)  # each shard: 1 query head + a KV head copy
    assert [s.num_heads for s in split.attn.shards] == [1, 1, 1, 1]
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(split(x), block(x), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="Cannot split 4 attention heads with 2 KV heads over 3 devices"):
        make_tensor_parallel(copy.deepcopy(block), ["cpu"] * 3)
