"""Inference streams to a corolla server on this machine over its unix socket (see `protocol.local_stream`) instead
of through the two p2pd daemons.

`LocalInferenceStream` is one such stream on a raw non-blocking socket: its async methods run on the client loop,
and between them its sync `exchange` may run in any one thread (the user's, so that a step costs no hop to the
loop thread and back: each hop is an idle thread's wake-up). `open_local_inference` wraps one as the p2p stub's
stream (an async iterator of `ExpertResponse`, `P2PHandlerError` for the server's errors, end of iteration when the
server closes). Any problem opening a stream means "use p2p"."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

from hivemind.p2p import P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.protocol import local_stream as ls
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_RESPONSE_FRAME_BYTES = 1 << 30  # a 2048-token bf16 prefill at hidden 16384 is 64 MiB: far below


class LocalInferenceStream:
    """One `rpc_inference` stream over a same-host server's socket. Not thread-safe: one caller at a time, either
    the client loop (`send`, `receive`) or one thread (`exchange`)."""

    def __init__(self, sock: socket.socket, peer_id: str):
        self.sock, self.peer_id = sock, peer_id
        self._buffer = bytearray()
        self.closed = False
        self.polled_responses = 0  # `exchange` responses that arrived while it polled (no sleep, no wake-up)

    # ---- opening

    @classmethod
    async def open(
        cls, peer_id: str, *, timeout_s: float, directory: Path | None = None
    ) -> LocalInferenceStream | None:
        """Connects and says hello; None when the server has no usable socket here or does not accept."""
        path = ls.usable_socket(peer_id, directory)
        if path is None:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        stream = cls(sock, peer_id)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.sock_connect(sock, str(path)), timeout_s)
            hello = ls.LocalHello(rpc="rpc_inference", peer_id=peer_id).to_bytes()
            await loop.sock_sendall(sock, b"".join(ls.frame(ls.HELLO, hello)))
            kind, payload = await asyncio.wait_for(stream._receive_frame(ls.MAX_ERROR_BYTES), timeout_s)
            if kind != ls.ACCEPT:
                message = payload.decode(errors="replace") if kind == ls.ERROR else f"frame kind {kind}"
                raise ConnectionError(f"refused: {message}")
        except (OSError, EOFError, ValueError, asyncio.TimeoutError) as e:
            logger.debug(f"local_transport.unavailable(peer=...{peer_id[-6:]}, error={e!r})")
            stream.close()
            return None
        return stream

    # ---- async side (client loop)

    async def send(self, request: runtime_pb2.ExpertRequest) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, _request_frame(request))

    async def send_end(self) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, b"".join(ls.frame(ls.END)))

    async def receive(self) -> runtime_pb2.ExpertResponse | None:
        """The next response; None once the server ended the stream (or went away)."""
        try:
            kind, payload = await self._receive_frame(MAX_RESPONSE_FRAME_BYTES)
        except (EOFError, ConnectionResetError, BrokenPipeError):
            return None
        return self._response(kind, payload)

    async def _receive_frame(self, max_payload_bytes: int) -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        while (parsed := self._parse_frame(max_payload_bytes)) is None:
            chunk = await loop.sock_recv(self.sock, 1 << 16)
            if not chunk:
                raise EOFError("the server closed the local stream")
            self._buffer += chunk
        return parsed

    # ---- sync side (any one thread)

    def exchange(
        self, request: runtime_pb2.ExpertRequest, *, timeout_s: float, poll_s: float = 0.0
    ) -> runtime_pb2.ExpertResponse:
        """Sends `request` and waits for its response in the calling thread: polling for up to `poll_s`, then
        sleeping in `poll(2)`. ConnectionError when the stream ends or breaks, TimeoutError past `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        data = memoryview(_request_frame(request))
        poller = select.poll()
        while data:
            try:
                data = data[self.sock.send(data) :]
            except BlockingIOError:
                poller.register(self.sock, select.POLLOUT)
                if not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                    raise TimeoutError(f"local stream to ...{self.peer_id[-6:]}: send timed out") from None
                poller.unregister(self.sock)
        poll_until = time.monotonic() + poll_s
        poller.register(self.sock, select.POLLIN)
        slept = False
        while (parsed := self._parse_frame(MAX_RESPONSE_FRAME_BYTES)) is None:
            try:
                chunk = self.sock.recv(1 << 16)
            except BlockingIOError:
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(f"no response from ...{self.peer_id[-6:]} within {timeout_s} s") from None
                if now >= poll_until:
                    poller.poll(max(0.0, deadline - now) * 1000)
                    slept = True
                continue
            if not chunk:
                raise ConnectionError(f"server ...{self.peer_id[-6:]} closed the local inference stream")
            self._buffer += chunk
        if poll_s > 0 and not slept:
            self.polled_responses += 1
        response = self._response(*parsed)
        if response is None:
            raise ConnectionError(f"server ...{self.peer_id[-6:]} ended the local inference stream")
        return response

    # ---- both

    def _parse_frame(self, max_payload_bytes: int) -> tuple[int, bytes] | None:
        buffer = self._buffer
        if len(buffer) < ls.HEADER_BYTES:
            return None
        try:
            kind, length = ls.parse_header(buffer, max_payload_bytes)
        except ValueError as e:  # the server broke the framing: this stream is unusable
            raise ConnectionError(f"local stream from ...{self.peer_id[-6:]}: {e}") from None
        end = ls.HEADER_BYTES + length
        if len(buffer) < end:
            return None
        with memoryview(buffer) as view:
            payload = bytes(view[ls.HEADER_BYTES : end])
        del buffer[:end]
        return kind, payload

    def _response(self, kind: int, payload: bytes) -> runtime_pb2.ExpertResponse | None:
        if kind == ls.MESSAGE:
            return runtime_pb2.ExpertResponse.FromString(payload)
        if kind == ls.ERROR:
            message = payload.decode(errors="replace")
            raise P2PHandlerError(
                f"Failed to call handler `rpc_inference` at ...{self.peer_id[-6:]} (local): {message}"
            )
        if kind == ls.END:
            return None
        raise ConnectionError(f"unexpected local stream frame kind {kind} from ...{self.peer_id[-6:]}")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


def _request_frame(request: runtime_pb2.ExpertRequest) -> bytes:
    return b"".join(ls.frame(ls.MESSAGE, request.SerializeToString()))


async def open_local_inference(
    peer_id: str,
    requests: AsyncIterator[runtime_pb2.ExpertRequest],
    *,
    timeout_s: float,
    directory: Path | None = None,
) -> AsyncIterator[runtime_pb2.ExpertResponse] | None:
    """The response stream of `rpc_inference` at the same-host server `peer_id`, sending `requests`; None when that
    server has no usable socket here or does not accept (then nothing was read from `requests`)."""
    stream = await LocalInferenceStream.open(peer_id, timeout_s=timeout_s, directory=directory)
    if stream is None:
        return None
    return responses_of(stream, requests)


async def responses_of(
    stream: LocalInferenceStream, requests: AsyncIterator[runtime_pb2.ExpertRequest]
) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """Sends `requests` (then END) in a task and yields the responses; closes the stream when done."""

    async def pump() -> None:
        async for request in requests:
            await stream.send(request)
        await stream.send_end()

    sending = asyncio.create_task(pump())
    try:
        while (response := await stream.receive()) is not None:
            yield response
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sending
        stream.close()
