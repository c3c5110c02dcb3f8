"""A tiny Llama span with LoRA adapters served by the server's engine executor on CPU (fused kernels): the
engine keeps its fused span, sessions on two adapters and on the base model (prefill, one merged decode step,
rollback) equal `SpanBackend.inference_step` with each session's adapter, and a step naming an unknown adapter or
another adapter than the session's is refused; the same over the eager blocks (the span of a family without fused
LoRA kernels)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.serving import SpanTraits
from corolla.server.backend import SpanBackend
from corolla.server.core.engine_executor import EngineExecutor, build_engine_executor
from corolla.server.core.executor import SessionSpec, StepInputs
from corolla.server.core.runtime import Runtime
from corolla.server.metrics import ServerMetrics
from helpers.lora_blocks import ADAPTERS, make_lora_blocks
from helpers.tiny_models import torch_threads

SPAN = (0, 1, 2)
MAX_LEN = 32


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def backend() -> SpanBackend:
    blocks = make_lora_blocks(num_layers=len(SPAN))
    return SpanBackend(
        dict(enumerate(blocks)), config=blocks[0].config, dtype=torch.float32, device="cpu", adapters=tuple(ADAPTERS)
    )


def _step(hidden: torch.Tensor, position: int, adapter: str) -> StepInputs:
    return StepInputs(hidden, position, None, None, adapter, lone_session=False)


@pytest.mark.parametrize("fused", [True, False])
async def test_sessions_on_different_adapters_merge(backend: SpanBackend, fused: bool) -> None:
    traits = SpanTraits(
        device_type="cpu", dtype=torch.float32, quant_type="none", family="llama", num_adapters=len(ADAPTERS),
        tensor_parallel_devices=0,
    )  # fmt: skip
    h = backend.hidden_size
    names = ["big", "", "some"]
    torch.manual_seed(2)
    plans = []
    for length in (6, 4, 9):
        plans.append(
            [(torch.randn(1, length, h), 0), (torch.randn(1, 1, h), length), (torch.randn(1, 2, h), length - 1)]
        )  # prefill, a merged decode step, a rollback
    expected = []
    for name, plan in zip(names, plans, strict=True):
        caches = [[torch.zeros(tuple(d.shape)) for d in per] for per in backend.cache_descriptors(SPAN, 1, MAX_LEN)]
        expected.append(
            [backend.inference_step(SPAN, x, caches, prefix_length=p, max_length=MAX_LEN, adapter=name)
             for x, p in plan]
        )  # fmt: skip
    with Runtime(max_batch_size_tokens=1024) as runtime:
        if fused:
            executor = build_engine_executor(backend, runtime, traits, kv_pool_bytes=1 << 20, max_seq_len_tokens=64,
                                             metrics=ServerMetrics(), warmup=False)  # fmt: skip
        else:
            config = EngineConfig(kv_pool_bytes=1 << 20, max_seq_len_tokens=64)
            engine = SpanEngine.from_blocks([backend.blocks[i] for i in SPAN], config, fused=False)
            executor = EngineExecutor(backend, engine, runtime, ServerMetrics())
        assert executor.path == ("fused" if fused else "eager")
        spec = SessionSpec(SPAN, 1, MAX_LEN)
        async with (
            executor.open_session(spec, 0) as a,
            executor.open_session(spec, 0) as b,
            executor.open_session(spec, 0) as c,
        ):
            caches = [a, b, c]
            got = [[await executor.step(cache, _step(*plans[i][0], names[i]))] for i, cache in enumerate(caches)]
            merged = await asyncio.wait_for(
                asyncio.gather(
                    *[executor.step(cache, _step(*plans[i][1], names[i])) for i, cache in enumerate(caches)]
                ),
                30,
            )
            for i, cache in enumerate(caches):
                got[i].append(merged[i])
                got[i].append(await executor.step(cache, _step(*plans[i][2], names[i])))
            with pytest.raises(ValueError, match="fixed when it opened"):
                await executor.step(a, _step(plans[0][1][0], 7, "mid"))
        async with executor.open_session(spec, 0) as d:
            with pytest.raises(ValueError, match="Unknown adapter 'missing'"):
                await executor.step(d, _step(plans[0][0][0], 0, "missing"))
    for i, name in enumerate(names):
        for out, ref in zip(got[i], expected[i], strict=True):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=0, msg=lambda m, name=name: f"{name!r}: {m}")
