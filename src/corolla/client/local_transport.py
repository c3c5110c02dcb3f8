"""Opening an inference stream to a corolla server on this machine over its unix socket (see
`protocol.local_stream`) instead of through the two p2pd daemons. The stream behaves like the one hivemind's stub
returns (an async iterator of `ExpertResponse`, `P2PHandlerError` for the server's errors, end of iteration when the
server closes), so `InferenceSession` drives both alike. Any problem opening it means "use p2p"."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from hivemind.p2p import P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.protocol import local_stream as ls
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_RESPONSE_FRAME_BYTES = 1 << 30  # a 2048-token bf16 prefill at hidden 16384 is 64 MiB: far below


async def open_local_inference(
    peer_id: str,
    requests: AsyncIterator[runtime_pb2.ExpertRequest],
    *,
    timeout_s: float,
    directory: Path | None = None,
) -> AsyncIterator[runtime_pb2.ExpertResponse] | None:
    """The response stream of `rpc_inference` at the same-host server `peer_id`, sending `requests`; None when that
    server has no usable socket here or does not accept (then nothing was read from `requests`)."""
    path = ls.usable_socket(peer_id, directory)
    if path is None:
        return None
    writer: asyncio.StreamWriter | None = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path), limit=1 << 16), timeout_s)
        writer.writelines(ls.frame(ls.HELLO, ls.LocalHello(rpc="rpc_inference", peer_id=peer_id).to_bytes()))
        kind, payload = await asyncio.wait_for(ls.read_frame(reader, ls.MAX_ERROR_BYTES), timeout_s)
        if kind != ls.ACCEPT:
            message = payload.decode(errors="replace") if kind == ls.ERROR else f"frame kind {kind}"
            raise ConnectionError(f"refused: {message}")
    except (OSError, EOFError, ValueError, asyncio.TimeoutError) as e:
        logger.debug(f"local_transport.unavailable(peer=...{peer_id[-6:]}, error={e!r})")
        if writer is not None:
            writer.close()
        return None
    return _responses(reader, writer, asyncio.create_task(_send(requests, writer)), peer_id)


async def _send(requests: AsyncIterator[runtime_pb2.ExpertRequest], writer: asyncio.StreamWriter) -> None:
    async for request in requests:
        writer.writelines(ls.frame(ls.MESSAGE, request.SerializeToString()))
        await writer.drain()
    writer.writelines(ls.frame(ls.END))
    await writer.drain()


async def _responses(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sending: asyncio.Task, peer_id: str
) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    try:
        while True:
            try:
                kind, payload = await ls.read_frame(reader, MAX_RESPONSE_FRAME_BYTES)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the server closed the stream (or died): as a closed p2p stream
            if kind == ls.MESSAGE:
                yield runtime_pb2.ExpertResponse.FromString(payload)
            elif kind == ls.ERROR:
                message = payload.decode(errors="replace")
                raise P2PHandlerError(f"Failed to call handler `rpc_inference` at ...{peer_id[-6:]} (local): {message}")
            elif kind == ls.END:
                return
            else:
                raise ConnectionError(f"unexpected local stream frame kind {kind} from ...{peer_id[-6:]}")
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sending
        writer.close()
