"""The fast path behind the server's interfaces, on CPU: `EngineSpanBackend` + `EngineMemoryCache` give the same
inference results as the plain `SpanBackend` + `MemoryCache` (whole span, sub-span, deep prompts, beam
reordering), account pool bytes, fail allocations in time, and merge steps of many sessions through the Runtime."""

from __future__ import annotations

import asyncio

import pytest
import torch

from corolla.models.registry import get_family
from corolla.server.backend import SpanBackend
from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.serving import EngineMemoryCache, EngineSpanBackend, build_fast_path
from corolla.server.memory_cache import MemoryCache
from corolla.server.runtime import Runtime
from corolla.utils.errors import AllocationFailed
from helpers.tiny_models import tiny_config

H, FIRST, N_BLOCKS = 64, 3, 4  # the server holds blocks 3..6


def make_backends(**engine_overrides):
    torch.manual_seed(0)
    config = tiny_config("llama", FIRST + N_BLOCKS)
    blocks = {}
    for i in range(FIRST, FIRST + N_BLOCKS):
        block = get_family(config).build_block(config, i)
        for p in block.parameters():
            torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.15)
        blocks[i] = block
    plain = SpanBackend(blocks, config=config, dtype=torch.float32, device="cpu")
    settings = dict(kv_pool_bytes=1 << 20, page_size_tokens=16, max_seq_len_tokens=64, max_batch_rows=8)
    settings.update(engine_overrides)
    engine = SpanEngine.from_blocks([blocks[i] for i in sorted(blocks)], EngineConfig(**settings))
    return plain, EngineSpanBackend(plain, engine)


async def run_session(backend, cache, block_indices, steps, *, batch=2, max_length=40):
    """Drives a session as the handler does; steps are (hidden, position, hypo_ids, prompts)."""
    descriptors = [d for per_block in backend.cache_descriptors(block_indices, batch, max_length) for d in per_block]
    nested = backend.cache_descriptors(block_indices, batch, max_length)
    outs = []
    async with cache.allocate_cache(*descriptors, timeout_s=0) as handles:
        offsets, handle_groups = 0, []
        for per_block in nested:
            handle_groups.append(handles[offsets : offsets + len(per_block)])
            offsets += len(per_block)
        for hidden, position, hypo_ids, prompts in steps:
            tensors = [cache.use_cache(*group) for group in handle_groups]
            outs.append(
                backend.inference_step(
                    block_indices, hidden, tensors, prefix_length=position, max_length=max_length,
                    hypo_ids=hypo_ids, prompts=prompts,
                )
            )  # fmt: skip
    return outs


@pytest.mark.parametrize("block_indices", [[3, 4, 5, 6], [4, 5]])
async def test_engine_backend_matches_span_backend(block_indices) -> None:
    plain, fast = make_backends()
    n = len(block_indices)
    torch.manual_seed(1)
    prompts = torch.randn(n, 1, 5, H) * 0.1
    steps = [
        (torch.randn(2, 7, H), 0, None, prompts),  # deep prompts touch positions 0..4
        (torch.randn(2, 1, H), 7, torch.tensor([1, 1]), prompts),  # beam reorder, past the prompts
        (torch.randn(2, 3, H), 8, None, None),
        (torch.randn(2, 1, H), 5, None, None),  # rollback
    ]
    expected = await run_session(plain, MemoryCache(1 << 24), block_indices, steps)
    cache = EngineMemoryCache(fast.engine)
    got = await run_session(fast, cache, block_indices, steps)
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    assert cache.current_size_bytes == 0 and cache.num_handles == 0


async def test_engine_memory_cache_accounts_and_times_out() -> None:
    _, fast = make_backends()
    cache = EngineMemoryCache(fast.engine)
    total = cache.max_size_bytes
    d = fast.cache_descriptors([3, 4, 5, 6], 1, 64)[0]
    async with cache.allocate_cache(*d, timeout_s=0):
        assert 0 < cache.current_size_bytes < total
        assert cache.bytes_left == total - cache.current_size_bytes
    assert cache.bytes_left == total
    big = fast.cache_descriptors([3, 4, 5, 6], 64, 64)[0]  # far more than the pool holds
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(AllocationFailed):
        async with cache.allocate_cache(*big, timeout_s=0.2):
            pass
    assert 0.15 < loop.time() - start < 5


async def test_submit_inference_step_merges_sessions_through_the_runtime() -> None:
    plain, fast = make_backends()
    cache = EngineMemoryCache(fast.engine)
    blocks = [3, 4, 5, 6]
    torch.manual_seed(2)
    prompts_in = [torch.randn(1, 4 + i, H) for i in range(4)]
    tokens = [torch.randn(1, 1, H) for _ in range(4)]
    expected = []
    for p, t in zip(prompts_in, tokens, strict=True):
        expected.append(
            (
                await run_session(
                    plain, MemoryCache(1 << 24), blocks, [(p, 0, None, None), (t, p.shape[1], None, None)], batch=1
                )
            )[1]
        )
    batch_sizes = []
    with Runtime(max_batch_size_tokens=1024) as runtime:
        async with contextlib_exit_stack() as stack:
            handles = [
                await stack.enter_async_context(cache.allocate_cache(*fast.cache_descriptors(blocks, 1, 40)[0]))
                for _ in range(4)
            ]
            for h, p in zip(handles, prompts_in, strict=True):
                await fast.submit_inference_step(
                    runtime,
                    cache,
                    blocks,
                    p,
                    cache_handles=[h, (), (), ()],
                    prefix_length=0,
                    max_length=40,
                    prompts=None,
                    hypo_ids=None,
                    active_adapter="",
                )
            executor = runtime._batch_executors["engine_inference"]
            runtime.register_batch_executor(
                "engine_inference", lambda tasks: (batch_sizes.append(len(tasks)), executor(tasks))[1]
            )
            gate = asyncio.Event()
            blocker = runtime.submit(
                lambda: asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(10), priority=0, size_tokens=1
            )
            loop = asyncio.get_running_loop()
            outs = [
                asyncio.ensure_future(
                    fast.submit_inference_step(
                        runtime,
                        cache,
                        blocks,
                        t,
                        cache_handles=[h, (), (), ()],
                        prefix_length=p.shape[1],
                        max_length=40,
                        prompts=None,
                        hypo_ids=None,
                        active_adapter="",
                    )
                )
                for h, t, p in zip(handles, tokens, prompts_in, strict=True)
            ]
            await asyncio.sleep(0.05)
            gate.set()
            await blocker
            got = await asyncio.wait_for(asyncio.gather(*outs), 30)
    assert 4 in batch_sizes  # the four sessions' steps ran as one merged batch
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def contextlib_exit_stack():
    import contextlib

    return contextlib.AsyncExitStack()


def test_build_fast_path_refuses_cpu() -> None:
    plain, _ = make_backends()
    assert build_fast_path(plain, kv_pool_bytes=1 << 20, max_seq_len_tokens=64) is None
