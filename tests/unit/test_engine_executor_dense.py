"""Tiny Falcon (7B-style multi-query) and BLOOM (ALiBi) spans served by the server's engine executor on CPU
(fused kernels): the serving path chooses the engine's Falcon/BLOOM span, and inference steps (prefill,
merged decode of two sessions at different lengths, rollback) equal `SpanBackend.inference_step`."""

from __future__ import annotations

import pytest
import torch

from corolla.engine.spans.fast_dense import FastDenseSpan
from corolla.models.registry import get_family
from corolla.server.core.engine_executor import EngineExecutor, build_engine_executor
from corolla.server.core.executor import SessionSpec
from corolla.server.core.runtime import Runtime
from corolla.server.metrics import ServerMetrics
from helpers.executor_runs import backend_steps, cpu_traits, merged_sessions_run, random_span_backend, two_session_plans
from helpers.tiny_models import tiny_config

SPAN = (1, 2)


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize("family", ["falcon_mq", "bloom"])
async def test_falcon_and_bloom_spans_run_on_the_fast_path(family: str) -> None:
    backend = random_span_backend(tiny_config(family, 3), SPAN)
    torch.manual_seed(1)
    plans = two_session_plans(int(backend.config.hidden_size))
    expected = [backend_steps(backend, SPAN, plan, 32) for plan in plans]
    traits = cpu_traits(get_family(backend.config).family)
    with Runtime(max_batch_size_tokens=1024) as runtime:
        executor = build_engine_executor(backend, runtime, traits, kv_pool_bytes=1 << 20, max_seq_len_tokens=64,
                                         metrics=ServerMetrics(), warmup=False)  # fmt: skip
        assert isinstance(executor, EngineExecutor) and executor.path == "fused"
        assert isinstance(executor.engine.model, FastDenseSpan)
        got = await merged_sessions_run(executor, SessionSpec(SPAN, 1, 32), plans)
    for outputs, refs in zip(got, expected, strict=True):
        for out, ref in zip(outputs, refs, strict=True):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
