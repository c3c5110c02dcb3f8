"""Tiny Falcon (7B-style multi-query) and BLOOM (ALiBi) spans served by the server's engine executor on CPU
(fused kernels): the serving path chooses the engine's Falcon/BLOOM span, and inference steps (prefill,
merged decode of two sessions at different lengths, rollback) equal `SpanBackend.inference_step`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from corolla.engine.serving import SpanTraits
from corolla.engine.spans.fast_dense import FastDenseSpan
from corolla.models.registry import get_family
from corolla.server.backend import SpanBackend
from corolla.server.core.engine_executor import EngineExecutor, build_engine_executor
from corolla.server.core.executor import SessionSpec, StepInputs
from corolla.server.core.runtime import Runtime
from corolla.server.metrics import ServerMetrics
from helpers.tiny_models import tiny_config, torch_threads

SPAN = (1, 2)


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is fastest, above all on a loaded machine (restored after the module)."""
    with torch_threads(1):
        yield


def make_backend(family: str) -> SpanBackend:
    torch.manual_seed(0)
    config = tiny_config(family, 3)
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


@pytest.mark.parametrize("family", ["falcon_mq", "bloom"])
async def test_falcon_and_bloom_spans_run_on_the_fast_path(family: str) -> None:
    backend = make_backend(family)
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
        executor = build_engine_executor(backend, runtime, traits, kv_pool_bytes=1 << 20, max_seq_len_tokens=64,
                                         metrics=ServerMetrics(), warmup=False)  # fmt: skip
        assert isinstance(executor, EngineExecutor) and executor.path == "fused"
        assert isinstance(executor.engine.model, FastDenseSpan)
        spec = SessionSpec(SPAN, 1, 32)
        async with executor.open_session(spec, 0) as a, executor.open_session(spec, 0) as b:
            got_a = [await executor.step(a, _step(prompts[0], 0))]
            got_b = [await executor.step(b, _step(prompts[1], 0))]
            pair = await asyncio.wait_for(
                asyncio.gather(executor.step(a, _step(tokens[0], 9)), executor.step(b, _step(tokens[1], 4))), 30
            )
            got_a.append(pair[0])
            got_b.append(pair[1])
            got_a.append(await executor.step(a, _step(redo, 5)))
    for got, ref in zip(got_a + got_b, expected[0] + expected[1], strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
