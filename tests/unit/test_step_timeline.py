"""Step timelines of a front's inference streams (`server.step_timeline`, the many-users bench's `--timeline`): off
unless a directory is named (nothing stamped, nothing written); on, every step of a stream served by
`stream_endpoint.serve_inference` (the socket's, the direct port's) or by `stream_guard.steps_handler` (p2p's) gets its
stamps in order (request read, step sent to the device, reply back, response written), saved when the stream ends;
the bench's `timeline_summary` reports the intervals (a one-process server's steps have no device channel: the
server's part and the client's turnaround only)."""

from __future__ import annotations

import asyncio
import json
import math
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from benchmarks.users.timeline import TIMELINE_SKIP_STEPS, timeline_by_process, timeline_summary
from corolla.protocol import local_stream as ls
from corolla.server.core.limits import PeerLimits
from corolla.server.core.peer_bytes import StreamBudget
from corolla.server.front import step_timeline, stream_guard
from corolla.server.front.stream_endpoint import FrameConnection, PlainFrames, serve_inference


class _Handler:
    """Answers each request, stamping the core's hand-off on the port's timeline as `SessionSteps` does."""

    async def serve_steps(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context, port) -> None:
        async for request in requests:
            if port.timeline is not None:
                port.timeline.stamp(step_timeline.SENT)
            await asyncio.sleep(0.002)  # the core's part
            if port.timeline is not None:
                port.timeline.stamp(step_timeline.BACK)
            port.reply(runtime_pb2.ExpertResponse(tensors=request.tensors))


def _serve(num_requests: int) -> list[int]:
    """The kinds of the frames the stream answered `num_requests` requests and END with."""

    async def go() -> list[int]:
        ours, theirs = socket.socketpair()
        _, conn = await asyncio.get_running_loop().connect_accepted_socket(FrameConnection, ours)
        for i in range(num_requests):
            payload = runtime_pb2.ExpertRequest(uid=f"block.{i}").SerializeToString()
            theirs.sendall(b"".join(ls.frame(ls.MESSAGE, payload)))
        theirs.sendall(b"".join(ls.frame(ls.END)))
        theirs.shutdown(socket.SHUT_WR)
        await serve_inference(_Handler(), conn, None, PlainFrames(), 1 << 20)  # type: ignore[arg-type]
        conn.close()
        await asyncio.sleep(0)  # the close reaches the socket
        replies = b""
        while chunk := theirs.recv(1 << 16):
            replies += chunk
        theirs.close()
        kinds = []
        while replies:
            kind, length = ls.parse_header(replies, 1 << 20)
            kinds.append(kind)
            replies = replies[ls.HEADER_BYTES + length :]
        return kinds

    return asyncio.run(go())


def test_off_unless_a_directory_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(step_timeline, "DIRECTORY", None)
    assert step_timeline.open_stream() is None
    assert _serve(3) == [ls.MESSAGE] * 3 + [ls.END]  # three responses and END: served as ever
    assert not list(tmp_path.iterdir())


def test_every_step_of_a_stream_is_stamped_in_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(step_timeline, "DIRECTORY", tmp_path)
    _serve(5)
    _serve(4)  # a second stream of the same process: a line of its own
    (saved,) = tmp_path.glob("timeline-*.jsonl")
    streams = [json.loads(line) for line in saved.read_text().splitlines()]
    assert [len(rows) for rows in streams] == [5, 4]
    for rows in streams:
        for t_in, sent, back, out in rows:
            assert 0 < t_in <= sent < back <= out
            assert back - sent >= 2_000_000  # the 2 ms round trip, in ns
    summary = timeline_summary(tmp_path)
    assert summary["steps"] == (5 - TIMELINE_SKIP_STEPS) + (4 - TIMELINE_SKIP_STEPS)
    assert 2.0 <= summary["device_round_trip_p50_ms"] < 50.0
    assert summary["handler_in_p50_ms"] >= 0.0 and summary["client_turn_p50_ms"] >= 0.0


def _serve_p2p(num_requests: int) -> list[bytes]:
    """The markers of the frames a p2p stream (`steps_handler`, hivemind's framing) answered `num_requests` with."""

    def message(body: bytes, marker: bytes = P2P.MESSAGE_MARKER) -> bytes:
        return marker + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body

    async def go() -> list[bytes]:
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        for i in range(num_requests):
            theirs.sendall(message(runtime_pb2.ExpertRequest(uid=f"block.{i}").SerializeToString()))
        theirs.sendall(message(b"", P2P.ERROR_MARKER))  # the caller's end of stream
        p2p = type("P2PStub", (), {"peer_id": "server"})()
        handle = stream_guard.steps_handler(
            p2p, "rpc_inference", _Handler().serve_steps, StreamBudget(PeerLimits()), on_reject=lambda *_: None
        )  # type: ignore[arg-type]
        await handle(type("Info", (), {"peer_id": PeerID(b"client")})(), reader, writer)
        await asyncio.sleep(0)  # the close reaches the socket
        replies = b""
        while chunk := theirs.recv(1 << 16):
            replies += chunk
        theirs.close()
        markers = []
        while replies:
            markers.append(replies[:1])
            replies = replies[1 + P2P.HEADER_LEN + int.from_bytes(replies[1 : 1 + P2P.HEADER_LEN], "big") :]
        return markers

    return asyncio.run(go())


def test_every_step_of_a_p2p_stream_is_stamped_as_the_sockets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(step_timeline, "DIRECTORY", tmp_path)
    assert _serve_p2p(5) == [P2P.MESSAGE_MARKER] * 5
    (saved,) = tmp_path.glob("timeline-*.jsonl")
    (rows,) = [json.loads(line) for line in saved.read_text().splitlines()]
    assert len(rows) == 5
    for t_in, sent, back, out in rows:
        assert 0 < t_in <= sent < back <= out
    assert timeline_summary(tmp_path)["steps"] == 5 - TIMELINE_SKIP_STEPS


def test_start_names_the_directory_after_the_import(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(step_timeline, "DIRECTORY", None)
    assert step_timeline.open_stream() is None
    step_timeline.start(tmp_path)
    assert step_timeline.DIRECTORY == tmp_path and step_timeline.open_stream() is not None


def test_a_step_without_the_channels_stamps_gives_the_servers_part_and_the_clients_turn(tmp_path: Path) -> None:
    ms = 1_000_000
    # one process's front: a request read at 0, its response written 6 ms later, the next read 2 ms after that
    rows = [[k * 8 * ms, 0, 0, k * 8 * ms + 6 * ms] for k in range(6)]
    (tmp_path / "timeline-1.jsonl").write_text(json.dumps(rows) + "\n")
    summary = timeline_summary(tmp_path)
    assert summary["steps"] == 6 - TIMELINE_SKIP_STEPS
    assert summary["server_step_p50_ms"] == pytest.approx(6.0)
    assert summary["client_turn_p50_ms"] == pytest.approx(2.0)
    assert math.isnan(summary["device_round_trip_p50_ms"]) and math.isnan(summary["handler_in_p50_ms"])


def test_summarize_reports_the_four_intervals(tmp_path: Path) -> None:
    ms = 1_000_000
    # a request read at 0, sent at 0.1 ms, back at 3.1, written at 3.2; the next read 1 ms after that write
    rows = [[k * 10 * ms + t for t in (0, ms // 10, 31 * ms // 10, 32 * ms // 10)] for k in range(6)]
    (tmp_path / "timeline-1.jsonl").write_text(json.dumps(rows) + "\n" + json.dumps([[1, 0, 0, 0]]) + "\n")
    summary = timeline_summary(tmp_path)
    assert summary["steps"] == 6 - TIMELINE_SKIP_STEPS  # (an unstamped step is left out)
    assert summary["handler_in_p50_ms"] == pytest.approx(0.1)
    assert summary["device_round_trip_p50_ms"] == pytest.approx(3.0)
    assert summary["handler_out_p50_ms"] == pytest.approx(0.1)
    assert summary["client_turn_p50_ms"] == pytest.approx(10 - 3.2)
    assert summary["server_step_p50_ms"] == pytest.approx(3.2)


def test_each_handler_process_gets_its_own_round_trip_and_step(tmp_path: Path) -> None:
    ms = 1_000_000
    # process 1: round trip 3 ms, a step every 10 ms; process 2 (two streams): round trip 4 ms, a step every 12 ms
    fast = [[k * 10 * ms, k * 10 * ms + ms, k * 10 * ms + 4 * ms, k * 10 * ms + 5 * ms] for k in range(6)]
    slow = [[k * 12 * ms, k * 12 * ms + ms, k * 12 * ms + 5 * ms, k * 12 * ms + 6 * ms] for k in range(6)]
    (tmp_path / "timeline-1.jsonl").write_text(json.dumps(fast) + "\n")
    (tmp_path / "timeline-2.jsonl").write_text(json.dumps(slow) + "\n" + json.dumps(slow) + "\n")
    (p1_trip, p1_step), (p2_trip, p2_step) = timeline_by_process(tmp_path)
    assert (p1_trip, p1_step) == (pytest.approx(3.0), pytest.approx(10.0))
    assert (p2_trip, p2_step) == (pytest.approx(4.0), pytest.approx(12.0))
    assert timeline_by_process(tmp_path / "none") == []


def test_a_stream_keeps_at_most_its_first_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_timeline, "MAX_STEPS_PER_STREAM", 3)
    timeline = step_timeline.StreamTimeline()
    for _ in range(10):
        timeline.request_read()
        timeline.stamp(step_timeline.OUT)
    assert len(timeline.rows) == 3
