"""What the engine executor tests share on CPU: random tiny blocks whose every tensor matters, a float32 span
backend of them, the steps of one session, the reference (`SpanBackend.inference_step` on fresh caches) and the
run of several sessions through an executor with one merged decode step."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch
from tests.helpers import reference_backend as oracle

from corolla.engine.serving import SpanTraits
from corolla.models.registry import get_family
from corolla.server.backend import SpanBackend
from corolla.server.core.executor import SessionSpec, StepInputs
from corolla.utils.tensor_bytes import as_tensor

MERGED_STEP_TIMEOUT_S = 30.0


def randomize_(block: torch.nn.Module, *, matrix_std: float = 0.15, vector_std: float = 0.2) -> torch.nn.Module:
    """Redraws `block`'s parameters in place (norm weights around 1, biases around 0: every tensor matters, none is
    left at an identity value) and returns it in eval mode."""
    for name, p in block.named_parameters():
        if p.ndim > 1:
            torch.nn.init.normal_(p, std=matrix_std)
        else:
            torch.nn.init.normal_(p, mean=0.0 if "bias" in name else 1.0, std=vector_std)
    return block.eval()


def random_span_backend(config: Any, span: Sequence[int], *, seed: int = 0) -> SpanBackend:
    """A float32 CPU `SpanBackend` of `randomize_`d blocks of `config` at indices `span`."""
    torch.manual_seed(seed)
    blocks = {i: randomize_(get_family(config).build_block(config, i)) for i in span}
    return SpanBackend(blocks, config=config, dtype=torch.float32, device="cpu")


def cpu_traits(family: str, *, num_adapters: int = 0) -> SpanTraits:
    """The traits of an unquantized float32 CPU span of `family` (the fused path's conditions, as the server asks)."""
    return SpanTraits(
        device_type="cpu", dtype=torch.float32, quant_type="none", family=family, num_adapters=num_adapters,
        tensor_parallel_devices=0,
    )  # fmt: skip


def step_inputs(hidden: torch.Tensor, position: int, adapter: str = "") -> StepInputs:
    """One step of a session among others (not lone): `hidden` [B, T, H] written at `position`."""
    return StepInputs(hidden, position, None, None, adapter, lone_session=False)


def two_session_plans(hidden_size: int) -> list[list[StepInputs]]:
    """Two sessions' steps (random [1, T, hidden_size] inputs): prompts of 9 and 4 tokens, one token each (the merged
    decode step), then the first rolls back onto position 5 with 2 tokens."""
    h = hidden_size
    return [
        [step_inputs(torch.randn(1, 9, h), 0), step_inputs(torch.randn(1, 1, h), 9), step_inputs(torch.randn(1, 2, h), 5)],
        [step_inputs(torch.randn(1, 4, h), 0), step_inputs(torch.randn(1, 1, h), 4)],
    ]  # fmt: skip


def backend_steps(
    backend: SpanBackend, span: Sequence[int], steps: Sequence[StepInputs], max_length: int
) -> list[torch.Tensor]:
    """The reference: `steps` of one session through `backend.inference_step` on fresh caches."""
    first = steps[0].hidden_states
    assert first is not None
    descriptors = backend.cache_descriptors(span, first.shape[0], max_length)
    caches = [[torch.zeros(tuple(d.shape)) for d in per_block] for per_block in descriptors]
    outputs = []
    for s in steps:
        assert s.hidden_states is not None
        outputs.append(
            oracle.inference_step(backend, span, s.hidden_states, caches, prefix_length=s.prefix_length, max_length=max_length,
                hypo_ids=s.hypo_ids, prompts=s.prompts, adapter=s.adapter,
            )
        )  # fmt: skip
    return outputs


async def merged_sessions_run(
    executor: Any,
    spec: SessionSpec,
    plans: Sequence[Sequence[StepInputs]],
    *,
    while_open: Callable[[list[Any]], Awaitable[None]] | None = None,
) -> list[list[torch.Tensor]]:
    """Opens one session per plan; steps each plan's first step alone (the prefills), then every plan's second step
    at once (one merged decode), then the rest of each plan in turn; `while_open(sessions)` runs after the steps,
    before the sessions close. Returns each plan's outputs."""
    async with contextlib.AsyncExitStack() as stack:
        sessions = [await stack.enter_async_context(executor.open_session(spec, 0)) for _ in plans]
        got = [
            [as_tensor(await executor.step(session, plan[0]))] for session, plan in zip(sessions, plans, strict=True)
        ]
        merged = await asyncio.wait_for(
            asyncio.gather(*[executor.step(session, plan[1]) for session, plan in zip(sessions, plans, strict=True)]),
            MERGED_STEP_TIMEOUT_S,
        )
        for outputs, session, plan, decoded in zip(got, sessions, plans, merged, strict=True):
            outputs.append(as_tensor(decoded))
            outputs += [as_tensor(await executor.step(session, step)) for step in plan[2:]]
        if while_open is not None:
            await while_open(sessions)
    return got
