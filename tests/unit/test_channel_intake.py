"""The device process's one channel reader (`server.handlers.device_channel.ChannelIntake`): one thread serves every channel
whatever their number, delivers each channel's frames whole and in order (cut anywhere, sent together), ends only
the channel whose frame breaks the bounds, ends a channel whose other end goes, and ends every channel when it
closes. Also the non-blocking read it uses (`FrameSocket.receive(block=False)`)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from corolla.protocol import channel_frames as wire
from corolla.server.handlers.device_channel import THREAD_NAME, ChannelIntake, FrameSocket


class _Channel:
    def __init__(self, sock: socket.socket, max_frame_bytes: int = 1 << 16):
        self.io = FrameSocket(sock, max_frame_bytes)
        self.frames: list[tuple[int, int, bytes]] = []
        self.ended = threading.Event()
        self.error: BaseException | None = None
        self.threads: set[str] = set()

    def on_frame(self, kind: int, request_id: int, payload: memoryview) -> None:
        self.threads.add(threading.current_thread().name)
        self.frames.append((kind, request_id, bytes(payload)))

    def on_end(self, error: BaseException | None) -> None:
        self.error = error
        self.ended.set()


def _frame(kind: int, rid: int, payload: bytes) -> bytes:
    return wire.HEADER.pack(len(payload), kind, rid) + payload


def _wait(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _intake_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def test_one_thread_reads_every_channel_in_order_and_whole() -> None:
    pairs = [socket.socketpair() for _ in range(6)]
    channels = [_Channel(ours) for ours, _ in pairs]
    expected = {i: [(wire.STEP_BATCH, i * 100 + j, bytes([j]) * (j * 997 % 5000)) for j in range(40)] for i in range(6)}
    with ChannelIntake() as intake:
        for channel in channels:
            intake.add(channel)
        assert len(_intake_threads()) == 1  # not one per channel

        def send(i: int) -> None:
            data = b"".join(_frame(*f) for f in expected[i])
            for start in range(0, len(data), 333 + i):  # cut anywhere, across headers too
                pairs[i][1].sendall(data[start : start + 333 + i])

        senders = [threading.Thread(target=send, args=(i,)) for i in range(6)]
        for s in senders:
            s.start()
        for s in senders:
            s.join(10)
        _wait(lambda: all(len(c.frames) == 40 for c in channels))
        assert [c.frames for c in channels] == [expected[i] for i in range(6)]
        assert {name for c in channels for name in c.threads} == {THREAD_NAME}
        pairs[2][1].close()  # the handler process of channel 2 went away: only it ends
        _wait(channels[2].ended.is_set)
        assert channels[2].error is None and not any(c.ended.is_set() for i, c in enumerate(channels) if i != 2)
        pairs[0][1].sendall(_frame(wire.STEP, 7, b"still"))
        _wait(lambda: channels[0].frames[-1] == (wire.STEP, 7, b"still"))
    assert all(c.ended.is_set() for c in channels)  # closing ended every channel still read
    assert not _intake_threads()
    with pytest.raises(RuntimeError, match="closed"):
        intake.add(_Channel(socket.socketpair()[0]))


def test_a_frame_over_the_bound_ends_only_its_channel_before_anything_is_allocated() -> None:
    (bad_ours, bad_theirs), (good_ours, good_theirs) = socket.socketpair(), socket.socketpair()
    bad, good = _Channel(bad_ours, max_frame_bytes=1024), _Channel(good_ours, max_frame_bytes=1024)
    with ChannelIntake() as intake:
        intake.add(bad)
        intake.add(good)
        bad_theirs.sendall(wire.HEADER.pack(1 << 30, wire.STEP, 1))  # claims 1 GiB
        _wait(bad.ended.is_set)
        assert isinstance(bad.error, wire.FrameError) and "max_frame_bytes" in str(bad.error)
        assert len(bad.io._buffer) <= 1024
        good_theirs.sendall(_frame(wire.STEP, 1, b"ok"))
        _wait(lambda: good.frames == [(wire.STEP, 1, b"ok")])
        assert not good.ended.is_set()


def test_a_failing_channel_handler_ends_that_channel_only() -> None:
    (a_ours, a_theirs), (b_ours, b_theirs) = socket.socketpair(), socket.socketpair()
    a, b = _Channel(a_ours), _Channel(b_ours)

    def broken(kind: int, request_id: int, payload: memoryview) -> None:
        raise wire.FrameError("bad step batch")

    a.on_frame = broken  # type: ignore[method-assign]
    with ChannelIntake() as intake:
        intake.add(a)
        intake.add(b)
        a_theirs.sendall(_frame(wire.STEP_BATCH, 1, b"x"))
        b_theirs.sendall(_frame(wire.STEP_BATCH, 2, b"y"))
        _wait(lambda: a.ended.is_set() and b.frames)
        assert isinstance(a.error, wire.FrameError) and not b.ended.is_set()


def test_a_non_blocking_receive_returns_at_once_when_nothing_is_waiting() -> None:
    ours, theirs = socket.socketpair()
    with FrameSocket(ours, max_frame_bytes=1 << 16) as io, theirs:
        started = time.monotonic()
        assert io.receive(block=False) == 0 and io.next_frame() is None
        assert time.monotonic() - started < 0.5
        data = _frame(wire.STEP, 3, b"abcdef") + _frame(wire.NOTE, 4, b"")
        theirs.sendall(data[:5])  # part of a header
        assert io.receive(block=False) == 5 and io.next_frame() is None
        theirs.sendall(data[5:])
        while io.receive(block=False):
            pass
        got = [(k, r, bytes(p)) for k, r, p in iter(io.next_frame, None)]
        assert got == [(wire.STEP, 3, b"abcdef"), (wire.NOTE, 4, b"")]
        theirs.close()
        with pytest.raises(wire.ChannelClosed):
            io.receive(block=False)


def test_an_intake_whose_thread_failed_refuses_new_channels_instead_of_never_reading_them(monkeypatch) -> None:
    (ours, theirs), (later, _) = socket.socketpair(), socket.socketpair()
    first = _Channel(ours)
    intake = ChannelIntake()

    def broken(selector, source):  # a bug in the intake loop itself
        raise RuntimeError("bug")

    monkeypatch.setattr(intake, "_read", broken)
    intake.add(first)
    theirs.sendall(_frame(wire.STEP, 1, b"x"))
    _wait(first.ended.is_set)  # the failure ended the channel it had, loudly
    _wait(lambda: not _intake_threads())
    with pytest.raises(RuntimeError, match="closed"):
        intake.add(_Channel(later))
    intake.close()
