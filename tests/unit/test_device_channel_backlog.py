"""The core never blocks on a handler process that stops reading its channel (`device_channel.FrameSocket`'s
backlog, drained by the `ChannelIntake`, decision 0258): a sender (the runtime thread, the event loop) returns at once
however full the socket is, the other channels keep serving, and the stalled channel is declared dead once (its
backlog past its cap, or nothing read for the stall bound): its sessions end (their cache back) and the handler's
steps waiting on it fail with `ChannelClosed`. A slow reader that keeps reading is not stalled: every frame arrives
whole and in order, from any number of sending threads."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from corolla.protocol import channel_frames as wire
from corolla.server.backend import SpanBackend
from corolla.server.core.executor import SessionSpec
from corolla.server.handlers import device_channel
from corolla.server.handlers.device_channel import ChannelIntake, FrameSocket
from corolla.server.handlers.remote_core import RemoteCore
from helpers.channel_frames import remote_session, served_channels
from helpers.executor_runs import step_inputs
from helpers.tiny_models import tiny_span_backend

H, SPAN = 64, (0, 1)
T = TypeVar("T")
SENDER_BOUND_S = 5.0  # a sender that was not back by then was blocked by the stalled channel (main: for good)


class _Echo:
    """A channel that answers each frame with the same frame; counts its ends."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int = 1 << 16):
        self.io = FrameSocket(sock, max_frame_bytes)
        self.ends: list[BaseException | None] = []
        self.ended = threading.Event()

    def on_frame(self, kind: int, request_id: int, payload: memoryview) -> None:
        self.io.send_frames([_frame(kind, request_id, bytes(payload))])

    def on_end(self, error: BaseException | None) -> None:
        self.ends.append(error)
        self.ended.set()


def _frame(kind: int, rid: int, payload: bytes) -> bytes:
    return wire.HEADER.pack(len(payload), kind, rid) + payload


def _flood(send: Callable[[T], object], items: list[T]) -> tuple[threading.Thread, list[float]]:
    """`send(item)` for each item from a thread of its own (as the runtime thread sends replies); the thread and the
    duration of each call."""
    durations: list[float] = []

    def run() -> None:
        for item in items:
            started = time.monotonic()
            send(item)
            durations.append(time.monotonic() - started)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, durations


def _send(io: FrameSocket) -> Callable[[bytes], bool]:
    return lambda frame: io.send_frames([frame])


def _watch(io: FrameSocket) -> threading.Thread:
    """Asks `io`'s stall clock every 0.1 s until it ends, as a channel's watch does (`DeviceChannel._watch`)."""

    def run() -> None:
        while not io.closed:
            time.sleep(0.1)
            io.declare_stalled(time.monotonic())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _echo_round_trip(far: socket.socket, rid: int) -> None:
    far.sendall(_frame(wire.NOTE, rid, b"ping"))
    far.settimeout(SENDER_BOUND_S)
    want = _frame(wire.NOTE, rid, b"ping")
    got = b""
    while len(got) < len(want):
        got += far.recv(len(want) - len(got))
    assert got == want


@pytest.mark.parametrize("bound", ["backlog cap", "stall bound"])
def test_a_channel_whose_reader_stopped_blocks_no_sender_and_ends_once(monkeypatch, bound: str) -> None:
    if bound == "backlog cap":  # the flood passes 4 MiB long before 30 s
        monkeypatch.setattr(device_channel, "BACKLOG_MIN_BYTES", 4 << 20, raising=False)
    else:  # a flood within the cap, then nothing read for 0.5 s
        monkeypatch.setattr(device_channel, "WRITE_STALL_S", 0.5, raising=False)
    (stalled_ours, stalled_far), (live_ours, live_far) = socket.socketpair(), socket.socketpair()
    stalled, live = _Echo(stalled_ours), _Echo(live_ours)
    count = 2000 if bound == "backlog cap" else 200  # 32 MiB / 3.2 MiB of 16 KiB frames; its far end reads none
    sender: threading.Thread | None = None
    try:
        with ChannelIntake() as intake:
            intake.add(stalled)
            intake.add(live)
            _watch(stalled.io)
            sender, durations = _flood(_send(stalled.io), [_frame(wire.NOTE, i, bytes(16 << 10)) for i in range(count)])
            for rid in range(20):  # the live channel is served meanwhile
                _echo_round_trip(live_far, rid)
            sender.join(SENDER_BOUND_S)
            assert not sender.is_alive(), "the sender is blocked on the channel that stopped reading"
            assert len(durations) == count and max(durations) < 1.0
            assert stalled.ended.wait(SENDER_BOUND_S)
            assert len(stalled.ends) == 1 and isinstance(stalled.ends[0], device_channel.ChannelStalled)
            assert str(stalled.ends[0]).startswith(f"handler channel stalled ({bound}")
            assert stalled.io.closed and stalled.io.send_frames([_frame(wire.NOTE, 0, b"")]) is False
            _echo_round_trip(live_far, 99)  # the live one still serves
            assert not live.ended.is_set()
        assert stalled.ends == [stalled.ends[0]]  # ended once, not again when the intake closed
    finally:
        stalled_far.close()  # (main: the blocked sender gets EPIPE and ends)
        live_far.close()
        if sender is not None:
            sender.join(SENDER_BOUND_S)


def test_a_slow_reader_gets_every_frame_whole_and_in_order_from_many_senders(monkeypatch) -> None:
    """Partly sent frames wait in the backlog and go out after it in order; a reader that takes a little every
    100 ms is never stalled (2 s bound)."""
    monkeypatch.setattr(device_channel, "WRITE_STALL_S", 2.0, raising=False)
    ours, far = socket.socketpair()
    channel = _Echo(ours, max_frame_bytes=1 << 20)
    threads = 4
    sizes = [(i * 7919) % (300 << 10) + 1 for i in range(60)]  # up to 300 KiB: past the socket's buffer
    expected = {
        t: [_frame(wire.NOTE, t * 1000 + i, bytes([t]) * n) for i, n in enumerate(sizes)] for t in range(threads)
    }
    with ChannelIntake() as intake:
        intake.add(channel)
        _watch(channel.io)
        senders = [_flood(_send(channel.io), expected[t])[0] for t in range(threads)]
        total = sum(len(f) for frames in expected.values() for f in frames)
        received = bytearray()
        far.settimeout(SENDER_BOUND_S)
        slow_until = time.monotonic() + 4.0
        while len(received) < total:
            received += far.recv(1 << 20)
            if time.monotonic() < slow_until:
                time.sleep(0.1)  # slow for 4 s: longer than the stall bound, but always reading
        for sender in senders:
            sender.join(SENDER_BOUND_S)
        assert not channel.ended.is_set()
    got: dict[int, list[bytes]] = {t: [] for t in range(threads)}
    view = memoryview(received)
    while view:
        length, _, rid = wire.HEADER.unpack_from(view)
        got[rid // 1000].append(bytes(view[: wire.HEADER_BYTES + length]))
        view = view[wire.HEADER_BYTES + length :]
    assert got == expected


def _recorded_ends(channel) -> list[BaseException | None]:
    """The errors `channel.on_end` is called with (it still runs), as they come."""
    ends: list[BaseException | None] = []
    on_end = channel.on_end
    channel.on_end = lambda error: (ends.append(error), on_end(error))
    return ends


@pytest.fixture(scope="module")
def backend() -> SpanBackend:
    return tiny_span_backend(SPAN)


async def test_a_handler_process_that_stops_reading_stalls_no_other_and_its_sessions_end(backend, monkeypatch) -> None:
    """Two channels of one core (a pool's layout); handler 0 stops reading (wedged) while the runtime thread and the
    event loop send it frames: neither is held, handler 1 keeps stepping, channel 0 is declared dead once after
    the stall bound, its session's cache comes back, and the step it was waiting on fails with ChannelClosed."""
    monkeypatch.setattr(device_channel, "WRITE_STALL_S", 1.0, raising=False)
    spec = SessionSpec(SPAN, 1, 16)
    async with served_channels(backend, SPAN, 2) as (real, channels, servings, links):
        ends = _recorded_ends(channels[0])
        wedged, live = RemoteCore(links[0]), RemoteCore(links[1])
        async with contextlib.AsyncExitStack() as stack:
            a = await stack.enter_async_context(remote_session(wedged, spec))
            b = await stack.enter_async_context(remote_session(live, spec))
            for proxy, cache in ((wedged, a), (live, b)):
                await proxy.step(cache, step_inputs(torch.randn(1, 2, H), 0))
            both = real.max_size_bytes - real.bytes_left  # (one page a block each: 16 tokens)
            links[0].writer.transport.pause_reading()  # handler 0 reads nothing more
            waiting = asyncio.ensure_future(wedged.step(a, step_inputs(torch.randn(1, 1, H), 2)))
            durations: list[float] = []
            flooded = threading.Event()

            def flood() -> None:  # in the runtime thread, as it sends a merged forward's replies
                for _ in range(20000):
                    started = time.monotonic()
                    channels[0].send_state()
                    durations.append(time.monotonic() - started)

            runtime = real.runtime
            runtime.queue(runtime.task(flood, on_done=lambda r, e: flooded.set(), priority=1.0, size_tokens=1))
            try:
                for position in range(2, 8):  # handler 1 steps meanwhile (main: its steps wait behind the flood)
                    out = await asyncio.wait_for(live.step(b, step_inputs(torch.randn(1, 1, H), position)), 10)
                    assert out.shape == (1, 1, H)
                assert await asyncio.to_thread(flooded.wait, SENDER_BOUND_S), "the runtime thread is blocked"
                started = time.monotonic()
                for _ in range(2000):  # the event loop's sends (a state broadcast, a note) return at once too
                    channels[0].send_state()
                assert time.monotonic() - started < SENDER_BOUND_S
                await asyncio.wait_for(asyncio.shield(servings[0]), 10)  # declared dead: its serving ended
            finally:
                links[0].writer.transport.resume_reading()  # (main: the blocked runtime thread goes on)
                await asyncio.to_thread(flooded.wait, SENDER_BOUND_S)
            assert len(ends) == 1 and isinstance(ends[0], device_channel.ChannelStalled), ends
            assert channels[0].sessions == {} and real.max_size_bytes - real.bytes_left == both // 2  # b's only
            with pytest.raises(wire.ChannelClosed):
                await asyncio.wait_for(waiting, 10)
            out = await asyncio.wait_for(live.step(b, step_inputs(torch.randn(1, 1, H), 8)), 10)
            assert out.shape == (1, 1, H) and not servings[1].done()
            assert max(durations) < 1.0
        assert len(ends) == 1


def test_two_frames_at_the_bound_fit_the_backlog_and_one_byte_more_does_not(monkeypatch) -> None:
    """The cap holds `BACKLOG_FRAMES` whole frames of the largest payload (a KV export's reply behind a forward's),
    headers included; a frame more past it declares the channel dead (main: the two frames alone did, 18 bytes over)."""
    monkeypatch.setattr(device_channel, "BACKLOG_MIN_BYTES", 0, raising=False)
    ours, far = socket.socketpair()
    io = FrameSocket(ours, max_frame_bytes=1 << 20)
    try:
        with contextlib.suppress(BlockingIOError):  # the socket full first: both frames wait in the backlog, whole
            while True:
                ours.send(bytes(1 << 16), socket.MSG_DONTWAIT)
        assert io.send_frames([_frame(wire.NOTE, 1, bytes(1 << 20))])
        assert io.send_frames([_frame(wire.NOTE, 2, bytes(1 << 20))])
        assert io.failure is None and not io.closed, io.failure
        assert io.send_frames([_frame(wire.NOTE, 3, b"")]) is False  # 9 bytes past the cap
        assert isinstance(io.failure, device_channel.ChannelStalled) and io.closed
        assert str(io.failure).startswith("handler channel stalled (backlog cap")
    finally:
        io.close()
        far.close()


async def test_a_handler_process_that_leaves_a_few_frames_unread_is_declared_dead(backend, monkeypatch) -> None:
    """A process that stops reading while the core sends it little (a step's reply: its socket takes it, no backlog
    forms) is declared dead after the stall bound all the same (a ping it leaves unanswered): its session's cache comes
    back, and it reads the reply it left unread, then the channel's end. A live process that pauses shorter than the bound answers its
    ping and stays (main: the stopped one's channel never ends, its session holds its cache for good)."""
    monkeypatch.setattr(device_channel, "WRITE_STALL_S", 1.0, raising=False)
    spec = SessionSpec(SPAN, 1, 16)
    async with served_channels(backend, SPAN, 2) as (real, channels, servings, links):
        ends = _recorded_ends(channels[0])
        pings: list[int] = []
        if (ping_note := links[1].notes.get("ping")) is not None:  # (main: no ping)
            types, answer = ping_note
            links[1].notes["ping"] = (types, lambda ping: (pings.append(ping), answer(ping)))
        wedged, live = RemoteCore(links[0]), RemoteCore(links[1])
        async with contextlib.AsyncExitStack() as stack:
            a = await stack.enter_async_context(remote_session(wedged, spec))
            b = await stack.enter_async_context(remote_session(live, spec))
            for proxy, cache in ((wedged, a), (live, b)):
                await proxy.step(cache, step_inputs(torch.randn(1, 2, H), 0))
            both = real.max_size_bytes - real.bytes_left
            links[0].writer.transport.pause_reading()  # handler 0 reads nothing more
            waiting = asyncio.ensure_future(wedged.step(a, step_inputs(torch.randn(1, 1, H), 2)))
            links[1].writer.transport.pause_reading()  # handler 1 pauses for half the bound, a state unread meanwhile
            channels[1].send_state()
            await asyncio.sleep(0.5)
            links[1].writer.transport.resume_reading()
            try:
                await asyncio.wait_for(asyncio.shield(servings[0]), 10)  # declared dead: its serving ended
            finally:
                links[0].writer.transport.resume_reading()
            assert len(ends) == 1 and isinstance(ends[0], device_channel.ChannelStalled), ends
            assert str(ends[0]).startswith("handler channel stalled (ping unanswered")
            assert channels[0].sessions == {} and real.max_size_bytes - real.bytes_left == both // 2  # b's only
            out = await asyncio.wait_for(waiting, 10)  # its reply, left unread, was sent before the end
            assert out.shape == (1, 1, H)
            await asyncio.wait_for(links[0].closed.wait(), 10)  # then the end
            await asyncio.sleep(1.5)  # past the bound again: the live one answered its ping
            assert pings and not servings[1].done()
            out = await asyncio.wait_for(live.step(b, step_inputs(torch.randn(1, 1, H), 2)), 10)
            assert out.shape == (1, 1, H)
        assert len(ends) == 1
