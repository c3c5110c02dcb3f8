"""A tiny DeepSeek-V3 span served by the server's engine executor on CPU (fused kernels): the engine
chooses its fused latent span for the family, inference steps (prefill, merged decode of two sessions, rollback) equal
`SpanBackend.inference_step`, and the executor's cache accounting counts the latent pool's bytes: the MLA formula
(kv_lora_rank + qk_rope_head_dim values per token per block), the number the server logs."""

from __future__ import annotations

import pytest
import torch

from corolla.engine.serving import SpanTraits, unsupported_reason
from corolla.engine.spans.fast_mla import FastMlaSpan
from corolla.models.registry import get_family
from corolla.models.sizing import kv_cache_bytes_per_token
from corolla.server.backend import SpanBackend
from corolla.server.core.engine_executor import EngineExecutor, build_engine_executor
from corolla.server.core.executor import SessionSpec
from corolla.server.core.runtime import Runtime
from corolla.server.metrics import ServerMetrics
from helpers.executor_runs import backend_steps, cpu_traits, merged_sessions_run, random_span_backend, two_session_plans
from helpers.tiny_models_fam_a import tiny_config_of

FIRST, N_BLOCKS = 0, 3  # block 0 dense, 1..2 MoE
SPAN = tuple(range(FIRST, FIRST + N_BLOCKS))
POOL_BYTES = 1 << 20


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def backend() -> SpanBackend:
    return random_span_backend(tiny_config_of("deepseek_v3", N_BLOCKS), SPAN)


async def test_deepseek_span_runs_on_the_fast_path(backend: SpanBackend) -> None:
    torch.manual_seed(1)
    plans = two_session_plans(int(backend.config.hidden_size))
    expected = [backend_steps(backend, SPAN, plan, 32) for plan in plans]
    traits = cpu_traits(get_family(backend.config).family)
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

        async def check_accounting(_sessions: list) -> None:
            assert executor.bytes_left == left - 2 * executor.session_bytes(spec)
            assert executor.session_bytes(spec) == executor.engine.pool.pages_for(32) * page * per_token

        got = await merged_sessions_run(executor, spec, plans, while_open=check_accounting)
        assert executor.bytes_left == left
    for outputs, refs in zip(got, expected, strict=True):
        for out, ref in zip(outputs, refs, strict=True):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_quantized_deepseek_spans_run_eagerly_with_the_reason() -> None:
    traits = SpanTraits(
        device_type="cuda", dtype=torch.bfloat16, quant_type="nf4", family="deepseek_v3", num_adapters=0,
        tensor_parallel_devices=0,
    )  # fmt: skip
    reason = unsupported_reason(traits)
    assert reason is not None and "unquantized" in reason
    unquantized = SpanTraits(**{**vars(traits), "quant_type": "none"})
    assert unsupported_reason(unquantized) is None
