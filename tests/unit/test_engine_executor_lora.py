"""A tiny Llama span with LoRA adapters served by the server's engine executor on CPU (fused kernels): the
engine keeps its fused span, sessions on two adapters and on the base model (prefill, one merged decode step,
rollback) equal `SpanBackend.inference_step` with each session's adapter, and a step naming an unknown adapter or
another adapter than the session's is refused; the same over the eager blocks (the span of a family without fused
LoRA kernels)."""

from __future__ import annotations

import pytest
import torch

from corolla.engine import EngineConfig, SpanEngine
from corolla.server.backend import SpanBackend
from corolla.server.core.engine_executor import EngineExecutor, build_engine_executor
from corolla.server.core.executor import SessionSpec
from corolla.server.core.runtime import Runtime
from corolla.server.metrics import ServerMetrics
from helpers.executor_runs import backend_steps, cpu_traits, merged_sessions_run, step_inputs
from helpers.lora_blocks import ADAPTERS, make_lora_blocks

SPAN = (0, 1, 2)
MAX_LEN = 32


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def backend() -> SpanBackend:
    blocks = make_lora_blocks(num_layers=len(SPAN))
    return SpanBackend(
        dict(enumerate(blocks)), config=blocks[0].config, dtype=torch.float32, device="cpu", adapters=tuple(ADAPTERS)
    )


@pytest.mark.parametrize("fused", [True, False])
async def test_sessions_on_different_adapters_merge(backend: SpanBackend, fused: bool) -> None:
    h = backend.hidden_size
    names = ["big", "", "some"]
    torch.manual_seed(2)
    plans = [
        [step_inputs(torch.randn(1, length, h), 0, name), step_inputs(torch.randn(1, 1, h), length, name),
         step_inputs(torch.randn(1, 2, h), length - 1, name)]
        for length, name in zip((6, 4, 9), names, strict=True)
    ]  # fmt: skip  # prefill, a merged decode step, a rollback
    expected = [backend_steps(backend, SPAN, plan, MAX_LEN) for plan in plans]
    with Runtime(max_batch_size_tokens=1024) as runtime:
        if fused:
            executor = build_engine_executor(backend, runtime, cpu_traits("llama", num_adapters=len(ADAPTERS)),
                                             kv_pool_bytes=1 << 20, max_seq_len_tokens=64, metrics=ServerMetrics(),
                                             warmup=False)  # fmt: skip
        else:
            config = EngineConfig(kv_pool_bytes=1 << 20, max_seq_len_tokens=64)
            engine = SpanEngine.from_blocks([backend.blocks[i] for i in SPAN], config, fused=False)
            executor = EngineExecutor(backend, engine, runtime, ServerMetrics())
        assert executor.path == ("fused" if fused else "eager")
        spec = SessionSpec(SPAN, 1, MAX_LEN)

        async def refuse_another_adapter(sessions: list) -> None:
            with pytest.raises(ValueError, match="fixed when it opened"):
                await executor.step(sessions[0], step_inputs(plans[0][1].hidden_states, 7, "mid"))

        got = await merged_sessions_run(executor, spec, plans, while_open=refuse_another_adapter)
        async with executor.open_session(spec, 0) as d:
            with pytest.raises(ValueError, match="Unknown adapter 'missing'"):
                await executor.step(d, step_inputs(plans[0][0].hidden_states, 0, "missing"))
    for i, name in enumerate(names):
        for out, ref in zip(got[i], expected[i], strict=True):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=0, msg=lambda m, name=name: f"{name!r}: {m}")
