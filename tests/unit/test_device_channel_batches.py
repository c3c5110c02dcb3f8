"""The handler <-> device channel batches steps both ways (`remote_core.DeviceLink`, `device_channel`): steps
of many sessions issued in one loop iteration leave as one STEP_BATCH frame, their replies come back in fewer frames
than steps, every session gets exactly its own output (equal to the executor's without the channel), and a step
the device refuses inside a batch fails only its caller, with its typed refusal."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from corolla.server.backend import SpanBackend
from corolla.server.core.executor import SessionSpec
from corolla.server.core.refusals import BadRequest
from corolla.server.handlers.remote_core import RemoteCore, RemoteSessionCache
from corolla.utils.tensor_bytes import TensorBytes, as_tensor
from helpers.channel_frames import remote_session, served_channel
from helpers.executor_runs import step_inputs
from helpers.tiny_models import tiny_span_backend

H, SPAN, SESSIONS = 64, (0, 1), 6


@pytest.fixture(scope="module")
def backend() -> SpanBackend:
    return tiny_span_backend(SPAN)


async def test_steps_of_many_sessions_travel_in_batches_and_each_gets_its_own_output(backend) -> None:
    torch.manual_seed(1)
    prompts = [torch.randn(1, 3, H) for _ in range(SESSIONS)]
    tokens = [[torch.randn(1, 1, H) for _ in range(SESSIONS)] for _ in range(4)]
    spec = SessionSpec(SPAN, 1, 16)
    async with served_channel(backend, SPAN) as (real, channel, _, link), contextlib.AsyncExitStack() as stack:
        proxy = RemoteCore(link)
        direct = [await stack.enter_async_context(real.open_session(spec, 0)) for _ in range(SESSIONS)]
        remote = [await stack.enter_async_context(remote_session(proxy, spec)) for _ in range(SESSIONS)]
        for i in range(SESSIONS):
            await real.step(direct[i], step_inputs(prompts[i], 0))
            await proxy.step(remote[i], step_inputs(prompts[i], 0))
        frames_in, frames_out, requests = channel.num_frames_in, channel.io.frames_sent, channel.num_requests
        for step, row in enumerate(tokens):  # every session steps in the same loop iteration
            want = [await real.step(direct[i], step_inputs(row[i], 3 + step)) for i in range(SESSIONS)]
            got = await asyncio.gather(*(proxy.step(remote[i], step_inputs(row[i], 3 + step)) for i in range(SESSIONS)))
            for w, g in zip(want, got, strict=True):
                torch.testing.assert_close(as_tensor(g), as_tensor(w), rtol=1e-5, atol=1e-5)
        steps = len(tokens) * SESSIONS
        assert channel.num_requests - requests == steps
        assert channel.num_frames_in - frames_in == len(tokens)  # one STEP_BATCH per round
        assert channel.io.frames_sent - frames_out < steps  # replies of one merged forward share frames


async def test_a_refused_step_inside_a_batch_fails_only_its_caller(backend) -> None:
    spec = SessionSpec(SPAN, 1, 16)
    async with served_channel(backend, SPAN) as (_, channel, _, link), contextlib.AsyncExitStack() as stack:
        proxy = RemoteCore(link)
        caches = [await stack.enter_async_context(remote_session(proxy, spec)) for _ in range(3)]
        assert isinstance(caches[0], RemoteSessionCache)
        ghost = RemoteSessionCache(spec, proxy.link, handle=999_999)  # no such session in the device process
        frames_in = channel.num_frames_in
        results = await asyncio.gather(
            *(proxy.step(c, step_inputs(torch.randn(1, 2, H), 0)) for c in (*caches, ghost)), return_exceptions=True
        )
        assert channel.num_frames_in - frames_in == 1  # all four in one frame
        assert all(isinstance(r, TensorBytes) and r.tensor().shape == (1, 2, H) for r in results[:3])
        assert isinstance(results[3], BadRequest)  # the device's FrameError crosses as the handler's BadRequest
        assert "handle 999999" in str(results[3])
