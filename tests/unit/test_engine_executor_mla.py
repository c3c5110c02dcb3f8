"""A tiny DeepSeek-V3 span served by the server's engine executor on CPU (fused kernels): the engine
chooses its fused latent span for the family, inference steps (prefill, merged decode of two sessions, rollback) equal
`SpanBackend.inference_step`, and the executor's cache accounting counts the latent pool's bytes: the MLA formula
(kv_lora_rank + qk_rope_head_dim values per token per block), the number the server logs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from corolla.engine.serving import SpanTraits, unsupported_reason
from corolla.engine.spans.fast_mla import FastMlaSpan
from corolla.models.registry import get_family
from corolla.models.sizing import kv_cache_bytes_per_token
from corolla.server.backend import SpanBackend
from corolla.server.core.engine_executor import EngineExecutor, build_engine_executor
from corolla.server.core.executor import SessionSpec, StepInputs
from corolla.server.core.runtime import Runtime
from corolla.server.metrics import ServerMetrics
from helpers.tiny_models import torch_threads
from helpers.tiny_models_fam_a import tiny_config_of

FIRST, N_BLOCKS = 0, 3  # block 0 dense, 1..2 MoE
SPAN = tuple(range(FIRST, FIRST + N_BLOCKS))
POOL_BYTES = 1 << 20


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is fastest, above all on a loaded machine (restored after the module)."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def backend() -> SpanBackend:
    torch.manual_seed(0)
    config = tiny_config_of("deepseek_v3", N_BLOCKS)
    blocks = {}
    for i in SPAN:
        block = get_family(config).build_block(config, i)
        for name, p in block.named_parameters():
            if p.ndim > 1:
                torch.nn.init.normal_(p, std=0.15)
            else:
                torch.nn.init.normal_(p, mean=0.0 if "bias" in name else 1.0, std=0.2)
        blocks[i] = block.eval()
    return SpanBackend(blocks, config=config, dtype=torch.float32, device="cpu")


def _step(hidden: torch.Tensor, position: int) -> StepInputs:
    return StepInputs(hidden, position, None, None, "", lone_session=False)


async def test_deepseek_span_runs_on_the_fast_path(backend: SpanBackend) -> None:
    traits = SpanTraits(
        device_type="cpu", dtype=torch.float32, quant_type="none", family=get_family(backend.config).family,
        num_adapters=0, tensor_parallel_devices=0,
    )  # fmt: skip
    h = int(backend.config.hidden_size)
    torch.manual_seed(1)
    prompts = [torch.randn(1, 9, h), torch.randn(1, 4, h)]
    tokens = [torch.randn(1, 1, h), torch.randn(1, 1, h)]
    redo = torch.randn(1, 2, h)
    expected = []
    for prompt, token in zip(prompts, tokens, strict=True):
        caches = [[torch.zeros(tuple(d.shape)) for d in per] for per in backend.cache_descriptors(SPAN, 1, 32)]
        run = [_step(prompt, 0), _step(token, prompt.shape[1])]
        if prompt is prompts[0]:
            run.append(_step(redo, 5))  # rollback onto position 5
        expected.append(
            [backend.inference_step(SPAN, s.hidden_states, caches, prefix_length=s.prefix_length, max_length=32)
             for s in run]
        )  # fmt: skip
    with Runtime(max_batch_size_tokens=1024) as runtime:
        executor = build_engine_executor(backend, runtime, traits, kv_pool_bytes=POOL_BYTES, max_seq_len_tokens=64,
                                         metrics=ServerMetrics(), warmup=False)  # fmt: skip
        assert isinstance(executor, EngineExecutor) and executor.path == "fused"
        assert isinstance(executor.engine.model, FastMlaSpan)
        per_token = kv_cache_bytes_per_token(backend.config, torch.float32) * N_BLOCKS
        config = backend.config
        assert per_token == (int(config.kv_lora_rank) + int(config.qk_rope_head_dim)) * 4 * N_BLOCKS
        page = executor.engine.pool.page_size_tokens
        assert executor.engine.pool.page_bytes == page * per_token  # the pool is sized and counted by the latent bytes
        assert executor.cache_bytes_per_token(SPAN) == per_token
        left = executor.bytes_left
        spec = SessionSpec(SPAN, 1, 32)
        async with executor.open_session(spec, 0) as a, executor.open_session(spec, 0) as b:
            assert executor.bytes_left == left - 2 * executor.session_bytes(spec)
            assert executor.session_bytes(spec) == executor.engine.pool.pages_for(32) * page * per_token
            got_a = [await executor.step(a, _step(prompts[0], 0))]
            got_b = [await executor.step(b, _step(prompts[1], 0))]
            pair = await asyncio.wait_for(
                asyncio.gather(executor.step(a, _step(tokens[0], 9)), executor.step(b, _step(tokens[1], 4))), 30
            )
            got_a.append(pair[0])
            got_b.append(pair[1])
            got_a.append(await executor.step(a, _step(redo, 5)))
        assert executor.bytes_left == left
    for got, ref in zip(got_a + got_b, expected[0] + expected[1], strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_quantized_deepseek_spans_run_eagerly_with_the_reason() -> None:
    traits = SpanTraits(
        device_type="cuda", dtype=torch.bfloat16, quant_type="nf4", family="deepseek_v3", num_adapters=0,
        tensor_parallel_devices=0,
    )  # fmt: skip
    reason = unsupported_reason(traits)
    assert reason is not None and "unquantized" in reason
    unquantized = SpanTraits(**{**vars(traits), "quant_type": "none"})
    assert unsupported_reason(unquantized) is None
