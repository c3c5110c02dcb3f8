"""The device channel's step path without the event loop (`device_channel`, `Runtime.queue` of callback
tasks): callback tasks report each result then flush once per merged batch, a refused step fails only its caller, a channel
whose handler process dies ends its sessions (their cache comes back), and no reader thread outlives the channel."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import pytest
import torch

from corolla.engine import EngineConfig, SpanEngine
from corolla.protocol import channel_frames as wire
from corolla.server.backend import SpanBackend
from corolla.server.core.engine_executor import EngineExecutor
from corolla.server.core.executor import SessionSpec, StepInputs
from corolla.server.core.refusals import BadRequest, RuntimeStopped
from corolla.server.core.runtime import Runtime, Task
from corolla.server.handlers.device_channel import FrameSocket
from corolla.server.handlers.remote_core import RemoteCore
from corolla.utils.tensor_bytes import TensorBytes, as_tensor
from helpers.channel_frames import recv_frame, remote_session, served_channel
from helpers.executor_runs import step_inputs
from helpers.tiny_models import tiny_span_backend

H, SPAN = 64, (0, 1)


def _channel_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("corolla-channel-")]


def test_callback_tasks_report_each_result_then_flush_once_per_batch() -> None:
    events: list[tuple[str, object]] = []
    done = threading.Event()

    def merged(tasks: list[Task]) -> list[object]:
        return [ValueError("refused") if t.payload == 2 else t.payload * 10 for t in tasks]

    def flush() -> None:
        events.append(("flush", None))
        done.set()

    with Runtime(max_batch_size_tokens=64) as runtime:
        runtime.register_batch_executor("k", merged)
        tasks = [
            runtime.task(
                lambda: None,
                on_done=lambda r, e: events.append(("done", e if e is not None else r)),
                flush=flush,
                priority=1.0,
                size_tokens=1,
                kind="k",
                merge_key="m",
                payload=i,
            )  # fmt: skip
            for i in range(4)
        ]
        runtime.queue(tasks)  # queued under one lock with one wake: one merged batch
        assert done.wait(10)
    results = [value for name, value in events if name == "done"]
    assert [r for r in results if not isinstance(r, BaseException)] == [0, 10, 30]
    assert [str(r) for r in results if isinstance(r, BaseException)] == ["refused"]  # only its own task failed
    assert events[-1] == ("flush", None) and sum(1 for name, _ in events if name == "flush") == 1
    assert runtime.num_batches_done == 1


def test_a_stopped_runtime_fails_queued_callback_tasks_and_refuses_new_ones() -> None:
    errors: list[BaseException | None] = []
    runtime = Runtime(max_batch_size_tokens=64)  # never started: tasks stay queued
    runtime.queue(runtime.task(lambda: 1, on_done=lambda r, e: errors.append(e), priority=1.0, size_tokens=1))
    runtime.stop()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeStopped)
    with pytest.raises(RuntimeStopped):
        runtime.queue(runtime.task(lambda: 1, on_done=lambda r, e: None, priority=1.0, size_tokens=1))
    with pytest.raises(ValueError, match="max_batch_size"):
        Runtime(max_batch_size_tokens=4).task(lambda: 1, on_done=lambda r, e: None, priority=1.0, size_tokens=5)


def test_frame_socket_refuses_an_oversized_frame_before_reading_it() -> None:
    ours, theirs = socket.socketpair()
    with FrameSocket(ours, max_frame_bytes=1024) as io, theirs:
        theirs.sendall(wire.HEADER.pack(1 << 30, wire.STEP, 7))  # 1 GiB announced, nothing behind it
        with pytest.raises(wire.FrameError, match="exceeds max_frame_bytes"):
            recv_frame(io)
        assert len(io._buffer) <= 1024  # nothing was allocated for it
    ours, theirs = socket.socketpair()  # a frame error ends the channel: the next case on a fresh one
    with FrameSocket(ours, max_frame_bytes=1024) as io, theirs:
        theirs.sendall(wire.HEADER.pack(3, 99, 0) + b"abc")
        with pytest.raises(wire.FrameError, match="unknown frame kind"):
            recv_frame(io)


@pytest.fixture(scope="module")
def backend() -> SpanBackend:
    return tiny_span_backend(SPAN)


async def test_a_refused_step_fails_only_its_caller_and_the_session_goes_on(backend) -> None:
    spec = SessionSpec(SPAN, 1, 16)
    async with served_channel(backend, SPAN) as (real, _, _, link), contextlib.AsyncExitStack() as stack:
        proxy = RemoteCore(link)
        a, b = [await stack.enter_async_context(remote_session(proxy, spec)) for _ in range(2)]
        too_long = torch.randn(1, 17, H)  # past the session's 16 tokens: the engine refuses it
        results = await asyncio.gather(
            proxy.step(a, step_inputs(torch.randn(1, 3, H), 0)),
            proxy.step(b, step_inputs(too_long, 0)),
            return_exceptions=True,
        )
        assert isinstance(results[0], TensorBytes) and results[0].tensor().shape == (1, 3, H)
        assert isinstance(results[1], (BadRequest, ValueError)), results[1]
        out = as_tensor(await proxy.step(b, step_inputs(torch.randn(1, 2, H), 0)))  # the refused session still serves
        assert out.shape == (1, 2, H) and torch.isfinite(out).all()


async def test_a_dead_handler_process_ends_its_sessions_and_leaves_no_thread(backend) -> None:
    spec = SessionSpec(SPAN, 1, 16)
    async with served_channel(backend, SPAN) as (real, channel, serving, link):
        free = real.bytes_left
        proxy = RemoteCore(link)
        stack = contextlib.AsyncExitStack()
        caches = [await stack.enter_async_context(remote_session(proxy, spec)) for _ in range(3)]
        await asyncio.gather(*(proxy.step(c, step_inputs(torch.randn(1, 2, H), 0)) for c in caches))
        assert len(channel.sessions) == 3 and real.bytes_left < free and len(_channel_threads()) == 1
        link.writer.transport.abort()  # the handler process dies: its end of the socket is gone
        await asyncio.wait_for(asyncio.shield(serving), 10)
        assert channel.sessions == {} and real.bytes_left == free  # every session's pages came back
        assert _channel_threads() == []
        with contextlib.suppress(Exception):
            await stack.aclose()
    assert _channel_threads() == []


async def test_a_stream_loan_recall_is_answered_by_a_dead_handler_process_s_end_and_not_sent_to_a_gone_one(
    backend,
) -> None:
    """The core waits for a recall's answer however long (decision 0252): a handler process that dies before it
    answers answers it by its end, and one already gone is not asked (nothing would ever answer)."""
    async with served_channel(backend, SPAN) as (_, channel, serving, link):
        asked = asyncio.Event()
        link.notes["recall_stream"] = (tuple[int, str, int, int, int], lambda *_: asked.set())  # (never answers)
        recall = asyncio.ensure_future(channel.recall_streams("a", 1, 0, 0))
        await asyncio.wait_for(asked.wait(), 10)
        assert not recall.done()  # (its answer is waited for)
        link.writer.transport.abort()  # the handler process dies
        await asyncio.wait_for(recall, 10)
        await asyncio.wait_for(asyncio.shield(serving), 10)
        await asyncio.wait_for(channel.recall_streams("a", 1, 0, 0), 10)


async def test_prepare_step_refuses_inputs_the_engine_cannot_run_before_anything_is_queued(backend) -> None:
    runtime = Runtime(max_batch_size_tokens=1024)  # never started: nothing would run
    config = EngineConfig(kv_pool_bytes=1 << 20, page_size_tokens=16, max_seq_len_tokens=64, max_batch_rows=8)
    executor = EngineExecutor(backend, SpanEngine.from_blocks([backend.blocks[i] for i in SPAN], config), runtime)
    async with executor.open_session(SessionSpec(SPAN, 1, 16), None) as cache:
        with pytest.raises(ValueError, match=r"hidden states must be \[1, tokens, 64\]"):
            executor.prepare_step(cache, StepInputs(torch.randn(2, 1, H), 0, None, None, "", lone_session=False))
        request = executor.prepare_step(cache, StepInputs(torch.randn(1, 1, H), 0, None, None, "", False))
        assert request.inputs_checked  # the device thread checks only the session's state
        alone = request.run()  # the step alone, on its session's engine
        assert alone.shape == (1, 1, H) and cache.session.length_tokens == 1
    assert runtime.num_pending == 0
    runtime.stop()


async def test_a_call_the_core_does_not_take_fails_only_its_caller(backend) -> None:
    """A call whose name or argument types the device does not take (`DeviceChannel.calls`) is refused to its
    caller before anything runs; the channel and its sessions go on."""
    async with served_channel(backend, SPAN) as (_, _, _, link), contextlib.AsyncExitStack() as stack:
        for name, args in [
            ("forward", ("peer", (0, 1), "no tensor", None, "", 16, 1.0)),  # a str where the hidden states go
            ("forward", ("peer", (0, 1), torch.randn(1, 2, H))),  # too few
            ("open_everything", ()),  # no such call
        ]:
            with pytest.raises(Exception, match="takes these arguments"):
                await link.request(name, *args)
        with pytest.raises(Exception, match="not inside the span"):
            await link.request("forward", "peer", (0, 9), torch.randn(1, 2, H), None, "", 16, 1.0)
        proxy = RemoteCore(link)
        cache = await stack.enter_async_context(remote_session(proxy, SessionSpec(SPAN, 1, 16)))
        assert (await proxy.step(cache, step_inputs(torch.randn(1, 2, H), 0))).shape == (1, 2, H)
