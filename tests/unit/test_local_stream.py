"""Same-host stream pieces without a server: frame encoding and limits, hello validation, where sockets may be
trusted, and the client stream's sync `exchange` (partial frames, errors, end of stream, timeouts, polling)."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
import time
from collections import Counter

import pytest
from hivemind.p2p import P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.client.session.stalls import StepClock
from corolla.client.session.step_wait import StepWait
from corolla.client.transport.local_transport import LocalInferenceStream, SocketTurns, fewer_streams_first
from corolla.protocol import local_stream as ls


def _read(data: bytes, limit: int = 1 << 20):
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await ls.read_frame(reader, limit)

    return asyncio.run(go())


def test_frames_round_trip_and_limits() -> None:
    assert _read(b"".join(ls.frame(ls.MESSAGE, b"abc"))) == (ls.MESSAGE, b"abc")
    assert _read(b"".join(ls.frame(ls.END))) == (ls.END, b"")
    with pytest.raises(ValueError, match="exceeds the limit of 2 bytes"):
        _read(b"".join(ls.frame(ls.MESSAGE, b"abc")), limit=2)
    with pytest.raises(ValueError, match="unknown local stream frame kind 9"):
        _read(bytes([9, 0, 0, 0, 0]))
    with pytest.raises(asyncio.IncompleteReadError):
        _read(b"".join(ls.frame(ls.MESSAGE, b"abc"))[:-1])
    with pytest.raises(ValueError, match="unknown frame kind"):
        ls.frame(42)


def test_hello_round_trip_and_rejects() -> None:
    hello = ls.LocalHello(rpc="rpc_inference", peer_id="QmAbc")
    assert ls.LocalHello.from_bytes(hello.to_bytes()) == hello
    for bad in (b"\xff", b"[1]", b'{"rpc": 1, "peer_id": "x", "version": 1}', b'{"rpc": "r", "peer_id": "x"}'):
        with pytest.raises(ValueError):
            ls.LocalHello.from_bytes(bad)


def test_only_private_dirs_and_own_sockets_are_trusted(tmp_path, monkeypatch) -> None:
    directory = tmp_path / "socks"
    monkeypatch.setenv(ls.SOCKET_DIR_ENV, str(directory))
    assert ls.socket_dir() == directory
    assert ls.usable_sockets("QmPeer") == []  # no dir yet
    assert ls.ensure_private_dir(directory) and (directory.stat().st_mode & 0o777) == 0o700
    assert ls.usable_sockets("QmPeer") == []  # no socket
    (directory / "QmFile.sock").write_text("")  # a plain file is not a socket
    assert ls.usable_sockets("QmFile") == []
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(ls.socket_path("QmPeer")))
        assert ls.usable_sockets("QmPeer") == [directory / "QmPeer.sock"]
        os.chmod(directory, 0o755)  # others could now have put sockets here
        assert not ls.is_private_dir(directory) and ls.usable_sockets("QmPeer") == []
        assert not ls.ensure_private_dir(directory)
    finally:
        server.close()
    for bad in ("", "../etc", "a/b", "x y"):
        assert ls.usable_sockets(bad) == []
        with pytest.raises(ValueError):
            ls.socket_path(bad)
    assert ls.usable_sockets("Q" * 200) == []  # longer than a unix socket path may be


def test_handler_process_sockets_are_found_tried_in_turn_and_removed(tmp_path) -> None:
    """A server with handler processes has one socket per process (`<peer>.<i>.sock`): a client finds them all (and
    no other peer's), skips one that refuses (a dead process's) for one that accepts, and a restarting server
    removes every socket of its identity before listening."""
    directory = tmp_path / "socks"
    assert ls.ensure_private_dir(directory)
    assert ls.socket_path("QmPeer", directory, 3) == directory / "QmPeer.3.sock"
    with pytest.raises(ValueError, match="handler index"):
        ls.socket_path("QmPeer", directory, -1)
    stale, live = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    others = [socket.socket(socket.AF_UNIX) for _ in range(3)]
    try:
        stale.bind(str(ls.socket_path("QmPeer", directory, 0)))  # bound, never listening: refuses connections
        live.bind(str(ls.socket_path("QmPeer", directory, 1)))
        live.listen()
        for other, name in zip(others, ("QmPeerX.sock", "QmPeer.x.sock", "QmOther.1.sock"), strict=True):
            other.bind(str(directory / name))
        names = sorted(path.name for path in ls.usable_sockets("QmPeer", directory))
        assert names == ["QmPeer.0.sock", "QmPeer.1.sock"]

        def accept() -> None:
            conn, _ = live.accept()
            with conn:
                ls.parse_header(conn.recv(ls.HEADER_BYTES), ls.MAX_HELLO_BYTES)
                conn.sendall(b"".join(ls.frame(ls.ACCEPT)))
                conn.recv(1)

        for _ in range(4):  # whichever order the client tries them in, it ends on the live one
            thread = threading.Thread(target=accept, daemon=True)
            thread.start()
            stream = asyncio.run(LocalInferenceStream.open("QmPeer", timeout_s=5, directory=directory))
            assert stream is not None and stream.path == directory / "QmPeer.1.sock"
            stream.close()
            thread.join(5)
        assert ls.remove_sockets("QmPeer", directory) == 2
        assert ls.usable_sockets("QmPeer", directory) == []
        assert sorted(os.listdir(directory)) == ["QmOther.1.sock", "QmPeer.x.sock", "QmPeerX.sock"]
    finally:
        for sock in (stale, live, *others):
            sock.close()


def _stream_pair() -> tuple[LocalInferenceStream, socket.socket]:
    client, server = socket.socketpair()
    client.setblocking(False)
    return LocalInferenceStream(client, "QmPeer"), server


def _response(value: float) -> bytes:
    payload = runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=b"x", size=[1], dtype=str(value))])
    return b"".join(ls.frame(ls.MESSAGE, payload.SerializeToString()))


@pytest.mark.parametrize("poll_s", [0.0, 1.0])
def test_exchange_reads_a_response_sent_in_pieces(poll_s: float) -> None:
    stream, server = _stream_pair()
    data = _response(1.5)

    def serve() -> None:
        kind, length = server.recv(1)[0], int.from_bytes(server.recv(4), "big")
        assert kind == ls.MESSAGE and runtime_pb2.ExpertRequest.FromString(server.recv(length)).uid == "a.0"
        for i in range(0, len(data), 3):  # dribble the response
            server.sendall(data[i : i + 3])
            time.sleep(0.001)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        response = stream.exchange(runtime_pb2.ExpertRequest(uid="a.0"), timeout_s=5, poll_s=poll_s)
        assert response.tensors[0].dtype == "1.5"
        assert stream.polled_responses == (1 if poll_s else 0)
    finally:
        thread.join(5)
        stream.close()
        server.close()


class _TimeoutOnly:
    """A `ReplyWaiter` of the step's own policy (`StepWait`, no pings, no deadline): its `timeout` ends the wait."""

    def __init__(self, timeout_s: float) -> None:
        self.wait = StepWait(StepClock(), time.monotonic(), None, timeout_s=timeout_s, ping_period_s=0.0, pings=False)

    def wake_at(self, now_s: float) -> float:
        return self.wait.wake_at(now_s)

    def woke(self, asked_s: float, now_s: float) -> float:
        return self.wait.woke(asked_s, now_s)

    def idle(self) -> None:
        if self.wait.due() == "timeout":
            raise TimeoutError("the step's timeout")


@pytest.mark.parametrize("waiter", [False, True])
@pytest.mark.parametrize("poll_s", [0.0, 1.0])
def test_a_trickle_of_bytes_does_not_hold_exchange_past_its_timeout(waiter: bool, poll_s: float) -> None:
    """A server that sends its reply a byte every 10 ms (2.3 s for the frame, the step's timeout 0.3 s) keeps the
    socket readable at every wake: the wait still ends at its timeout. On main `exchange` asked for the timeout (its
    own deadline, or the waiter's `idle`) only at a read that found nothing, so the trickle held the step until the
    frame was whole, however long that was, and it was taken as the answer."""
    stream, server = _stream_pair()
    data = b"".join(
        ls.frame(
            ls.MESSAGE, runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=b"x" * 220)]).SerializeToString()
        )
    )
    stop = threading.Event()

    def trickle() -> None:
        server.recv(1 << 16)  # the request
        for i in range(len(data)):
            if stop.wait(0.01):
                return
            server.sendall(data[i : i + 1])

    thread = threading.Thread(target=trickle)
    thread.start()
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            stream.exchange(
                runtime_pb2.ExpertRequest(uid="a.0"),
                timeout_s=0.3,
                poll_s=poll_s,
                waiter=_TimeoutOnly(0.3) if waiter else None,
            )
        assert time.monotonic() - started < 1.5
    finally:
        stop.set()
        thread.join(5)
        stream.close()
        server.close()


def test_a_request_left_unread_is_held_to_the_steps_wait() -> None:
    """hrev18 (decision 0245): a server that leaves a long request (16 MiB, past the socket's buffers) unread holds
    the write; the step's wait (its policy's timeout, 0.3 s; `timeout_s` the request timeout, 5 s here, 180 s by
    default) ends it as it ends a wait for the reply. On main the write waited out `timeout_s` (wall time) without
    asking the waiter: no stall, ping or late budget."""
    stream, server = _stream_pair()
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="the step's timeout"):
            stream.exchange(b"x" * (16 << 20), timeout_s=5, waiter=_TimeoutOnly(0.3))
        assert time.monotonic() - started < 2
    finally:
        stream.close()
        server.close()


def test_exchange_reports_errors_end_and_timeouts() -> None:
    stream, server = _stream_pair()
    try:
        server.sendall(b"".join(ls.frame(ls.ERROR, b"Maximum length exceeded")))
        with pytest.raises(P2PHandlerError, match="Maximum length exceeded"):
            stream.exchange(runtime_pb2.ExpertRequest(), timeout_s=5)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            stream.exchange(runtime_pb2.ExpertRequest(), timeout_s=0.05)
        assert time.monotonic() - started < 2
        server.sendall(b"".join(ls.frame(ls.END)))
        with pytest.raises(ConnectionError, match="ended"):
            stream.exchange(runtime_pb2.ExpertRequest(), timeout_s=5)
        server.close()
        with pytest.raises(ConnectionError):  # broken pipe or closed, whichever the OS reports first
            stream.exchange(runtime_pb2.ExpertRequest(), timeout_s=5)
    finally:
        stream.close()
        server.close()


def test_one_process_spreads_its_streams_evenly_over_the_handler_sockets(tmp_path) -> None:
    """A process's streams to one server take its handler processes' sockets in turn (from a random start per
    server), so 8 sessions of one client process land 2 on each of 4 processes; another server keeps its own turn.
    Picked at random, one process of 4 would often get 3 or more."""
    turns = SocketTurns(random.Random(7))
    paths = [tmp_path / f"QmPeer.{i}.sock" for i in range(4)]  # as usable_sockets lists them: sorted
    firsts = [turns.order("QmPeer", list(paths))[0] for _ in range(8)]
    assert sorted(Counter(firsts).values()) == [2, 2, 2, 2]
    assert all(sorted(turns.order("QmPeer", list(paths))) == sorted(paths) for _ in range(3))  # all tried, in turn
    others = [tmp_path / "QmOther.0.sock", tmp_path / "QmOther.1.sock"]
    assert sorted(Counter(turns.order("QmOther", list(others))[0] for _ in range(4)).values()) == [2, 2]
    assert turns.order("QmLone", [tmp_path / "QmLone.sock"]) == [tmp_path / "QmLone.sock"]


def test_a_load_file_says_how_many_connections_and_anything_else_reads_as_unknown(tmp_path) -> None:
    sock = tmp_path / "QmPeer.0.sock"
    assert ls.read_load(sock) is None  # none yet
    with ls.StreamLoad(sock) as load:
        assert ls.read_load(sock) == 0
        load.write(17)
        assert ls.read_load(sock) == 17
        load.write(3)  # rewritten in place: no digits of the longer count left behind
        assert ls.read_load(sock) == 3
    assert not ls.load_path(sock).exists() and ls.read_load(sock) is None  # removed when closed
    for junk in (b"", b"x", b"-1", b"%d" % (ls.MAX_LOAD + 1), b"1" * (ls.MAX_LOAD_FILE_BYTES + 1), b"\xff\xfe"):
        ls.load_path(sock).write_bytes(junk)
        assert ls.read_load(sock) is None, junk
    ls.load_path(sock).unlink()
    target = tmp_path / "elsewhere"
    target.write_bytes(b"0")
    ls.load_path(sock).symlink_to(target)  # a link is not followed
    assert ls.read_load(sock) is None
    ls.load_path(sock).unlink()
    ls.load_path(sock).mkdir()
    assert ls.read_load(sock) is None
    ls.load_path(sock).rmdir()
    ls.load_path(sock).symlink_to(target)
    with ls.StreamLoad(sock):  # a stale link in its place is replaced, never written through
        assert ls.read_load(sock) == 0 and target.read_bytes() == b"0"


def test_of_the_first_two_sockets_the_less_loaded_is_tried_first(tmp_path) -> None:
    paths = [tmp_path / f"QmPeer.{i}.sock" for i in range(3)]
    assert fewer_streams_first(list(paths)) == paths  # no load files: the order stays
    loads = [ls.StreamLoad(p).open() for p in paths]
    try:
        for load, count in zip(loads, (5, 5, 0), strict=True):
            load.write(count)
        assert fewer_streams_first(list(paths)) == paths  # equal: the turn's order; the third is not looked at
        loads[1].write(4)
        assert fewer_streams_first(list(paths)) == [paths[1], paths[0], paths[2]]
        loads[0].close()  # one unknown: the order stays
        assert fewer_streams_first(list(paths)) == paths
        assert fewer_streams_first(paths[:1]) == paths[:1]
    finally:
        for load in loads:
            load.close()


def test_one_session_client_processes_spread_nearly_evenly_over_the_handler_sockets(tmp_path) -> None:
    """64 client processes of one session each (a fresh turn per process: a random start), arriving one after
    another: with the less loaded of two candidates they land 15-17 on each of 4 handler processes; with the first
    candidate alone (the order before load files) the same processes spread 14-18 (over many such draws the busiest
    gets 20 on average, 23 or more one time in ten)."""
    paths = [tmp_path / f"QmPeer.{i}.sock" for i in range(4)]
    unloaded = [tmp_path / f"QmBlind.{i}.sock" for i in range(4)]  # no load files: the turn's order alone
    loads = [ls.StreamLoad(p).open() for p in paths]
    try:
        counts, blind = Counter({p: 0 for p in paths}), Counter({p: 0 for p in unloaded})
        for process in range(64):
            blind[SocketTurns(random.Random(process)).order("QmBlind", list(unloaded))[0]] += 1
            chosen = SocketTurns(random.Random(process)).order("QmPeer", list(paths))[0]
            counts[chosen] += 1
            loads[paths.index(chosen)].write(counts[chosen])
        assert max(counts.values()) <= 17 and min(counts.values()) >= 15, counts
        assert max(blind.values()) - min(blind.values()) > max(counts.values()) - min(counts.values()), blind
    finally:
        for load in loads:
            load.close()


def test_forked_client_processes_each_take_their_own_start(tmp_path) -> None:
    """The process-wide `SOCKET_TURNS` is made at import; processes forked after it (a forkserver's children, a
    pre-forking web server's workers) each start their turns at a socket of their own, not all at the parent's: with
    one inherited generator, 16 one-session client processes landed 0 / 8 / 8 / 0 on 4 handler processes."""
    from corolla.client.transport.local_transport import SOCKET_TURNS

    paths = [tmp_path / f"QmForked.{i}.sock" for i in range(4)]  # no load files: the turn's order alone
    SOCKET_TURNS.order("QmForked", list(paths))  # the parent has a turn for this server too
    firsts = []
    for _ in range(12):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report its first socket, then leave without running the parent's cleanup
            try:
                os.write(write_end, bytes([paths.index(SOCKET_TURNS.order("QmForked", list(paths))[0])]))
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as reader:
            firsts.append(reader.read())
        os.waitpid(pid, 0)
    assert all(len(first) == 1 for first in firsts), firsts
    assert len(set(firsts)) >= 2, f"every forked process started at the same socket: {firsts}"  # (1/4)^11 by chance
