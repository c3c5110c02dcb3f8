"""Inference streams (and training calls' streams: `rpc_forward_stream`, `rpc_backward_stream`) to a corolla server on
this machine over its unix socket (see `protocol.local_stream`) instead of through the two p2pd daemons.

`LocalInferenceStream` is one such stream on a raw non-blocking socket (`framed_socket.FramedSocketStream`): its
async methods run on the client loop, and between them its sync `exchange` may run in any one thread.
`responses_of` drives one as the p2p stub's stream does (an async iterator of `ExpertResponse`, `P2PHandlerError`
for the server's errors, end of iteration when the server closes). Any problem opening a stream means "use p2p"."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

from hivemind.p2p import P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.client.transport.framed_socket import FramedSocketStream
from corolla.client.transport.p2p_stream import InferenceStream
from corolla.protocol import local_stream as ls
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class SocketTurns:
    """Which of a server's handler-process sockets this process tries first for its next stream: each in turn, from
    a random start per server, so that the sessions of one process (an API server, the bench's client processes)
    spread evenly over the server's handler processes (the busiest one's turnaround sets every session's pace); of
    the turn's first two, the less loaded (`fewer_streams_first`), so that processes of one session each spread too."""

    MAX_PEERS = 1024  # servers remembered (only servers with several sockets on this machine are)

    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random()
        self._next: dict[str, int] = {}
        self._lock = threading.Lock()

    def order(self, peer_id: str, paths: list[Path]) -> list[Path]:
        """`paths` (a server's sockets, in `usable_sockets`' sorted order) in the order to try them for this
        process's next stream to `peer_id` (reads the first two sockets' load files)."""
        if len(paths) < 2:
            return paths
        with self._lock:
            turn = self._next.get(peer_id)
            if turn is None:
                if len(self._next) >= self.MAX_PEERS:
                    self._next.clear()
                turn = self._rng.randrange(len(paths))
            self._next[peer_id] = turn + 1
        start = turn % len(paths)
        return fewer_streams_first(paths[start:] + paths[:start])

    def reseed(self) -> None:
        """In a forked child: a random start of its own and no turns yet. A child inherits its parent's generator,
        so every worker forked from one parent (a forkserver, a pre-forking web server) would otherwise start at the
        same socket: 16 one-session processes landed 0 / 8 / 8 / 0 on 4 handler processes."""
        self._lock = threading.Lock()  # another thread of the parent may have held it at the fork
        self._rng.seed()
        self._next = {}


def fewer_streams_first(paths: list[Path]) -> list[Path]:
    """`paths` (sockets in the order to try them) with the first two swapped where the second's handler process
    serves fewer connections (both load files read): of two candidates, the less loaded (two random choices spread
    one-session clients nearly evenly, where one random choice puts ~20 of 64 on the busiest of 4 processes)."""
    if len(paths) < 2:
        return paths
    first, second = ls.read_load(paths[0]), ls.read_load(paths[1])
    if first is not None and second is not None and second < first:
        return [paths[1], paths[0], *paths[2:]]
    return paths


SOCKET_TURNS = SocketTurns()
os.register_at_fork(after_in_child=SOCKET_TURNS.reseed)


class LocalInferenceStream(FramedSocketStream):
    """One `rpc_inference` stream over a same-host server's socket (`protocol.local_stream` frames)."""

    path: Path | None = None  # the socket it connected to

    @classmethod
    async def open(
        cls, peer_id: str, *, timeout_s: float, directory: Path | None = None, rpc: str = "rpc_inference"
    ) -> LocalInferenceStream | None:
        """Connects and says hello for `rpc`; None when the server has no usable socket here or does not accept. A server
        with several handler processes has a socket per process: they are tried in `SOCKET_TURNS` order (the less
        loaded of the turn's first two first; a stale socket left by a dead process refuses the connection at once,
        and the next is tried)."""
        for path in SOCKET_TURNS.order(peer_id, ls.usable_sockets(peer_id, directory)):
            stream = await cls._open_at(path, peer_id, timeout_s, rpc)
            if stream is not None:
                return stream
        return None

    @classmethod
    async def _open_at(cls, path: Path, peer_id: str, timeout_s: float, rpc: str) -> LocalInferenceStream | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        stream = cls(sock, peer_id, rpc)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.sock_connect(sock, str(path)), timeout_s)
            await say_hello(stream, ls.LocalHello(rpc=rpc, peer_id=peer_id).to_bytes(), timeout_s)
        except (OSError, EOFError, ValueError, asyncio.TimeoutError) as e:
            logger.debug(f"local_transport.unavailable(peer=...{peer_id[-6:]}, path={path.name}, error={e!r})")
            stream.close()
            return None
        stream.path = path
        return stream

    # ---- framing

    def _request_frame(self, payload: bytes) -> bytes:
        return b"".join(ls.frame(ls.MESSAGE, payload))

    def _end_frame(self) -> bytes:
        return b"".join(ls.frame(ls.END))

    def _header(self, buffer: bytearray, max_payload_bytes: int) -> tuple[int, int]:
        return ls.parse_header(buffer, max_payload_bytes)

    def _response(self, kind: int, payload: bytes) -> runtime_pb2.ExpertResponse | None:
        return frame_response(kind, payload, self.peer_id, "local", self.rpc)


async def say_hello(stream: FramedSocketStream, hello: bytes, timeout_s: float) -> bytes:
    """Sends the HELLO frame `hello` (a `local_stream` or `direct_stream` handshake) and returns the server's ACCEPT
    payload (ConnectionError if it refuses)."""
    await asyncio.get_running_loop().sock_sendall(stream.sock, b"".join(ls.frame(ls.HELLO, hello)))
    kind, payload = await asyncio.wait_for(stream.receive_frame(ls.MAX_ERROR_BYTES), timeout_s)
    if kind != ls.ACCEPT:
        message = payload.decode(errors="replace") if kind == ls.ERROR else f"frame kind {kind}"
        raise ConnectionError(f"refused: {message}")
    return payload


def frame_response(
    kind: int, payload: bytes, peer_id: str, transport: str, rpc: str
) -> runtime_pb2.ExpertResponse | None:
    """The response a `local_stream` frame (payload opened, where sealed) carries: the message, None for the end of
    the stream, `P2PHandlerError` for the server's error (as over p2p), ConnectionError for any other kind."""
    if kind == ls.MESSAGE:
        return runtime_pb2.ExpertResponse.FromString(payload)
    if kind == ls.ERROR:
        message = payload.decode(errors="replace")
        raise P2PHandlerError(f"Failed to call handler `{rpc}` at ...{peer_id[-6:]} ({transport}): {message}")
    if kind == ls.END:
        return None
    raise ConnectionError(f"unexpected {transport} stream frame kind {kind} from ...{peer_id[-6:]}")


async def responses_of(
    stream: InferenceStream, requests: AsyncIterator[runtime_pb2.ExpertRequest], max_bytes: int
) -> AsyncGenerator[runtime_pb2.ExpertResponse, None]:
    """Sends `requests` (then END) in a task and yields the responses, each refused at its header past `max_bytes`
    (ConnectionError); closes the stream when done."""

    async def pump() -> None:
        async for request in requests:
            await stream.send(request)
        await stream.send_end()

    sending = asyncio.create_task(pump())
    try:
        while (response := await stream.receive(max_bytes)) is not None:
            yield response
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sending
        stream.close()
