"""The framings `bench.handler_path --sockets --framing ...` drives a handler process's streams with, each through
the server code that serves it: `p2p` (hivemind's frames as p2pd hands a stream to the handler, through
`stream_guard`), `socket` (the same-host socket's frames through `stream_endpoint.serve_inference`) and `direct`
(the direct port's sealed frames through the same, with the stream byte budget and idle timeout a remote peer's
stream gets). Both processes of the bench derive the same fixed stream keys; no ticket is involved (the handshake
happens once per connection, not per step)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from hivemind.p2p import P2P, P2PContext

from corolla.protocol import direct_stream as ds
from corolla.protocol import local_stream as ls
from corolla.server.direct_endpoint import SealedFrames
from corolla.server.handler import TransformerConnectionHandler
from corolla.server.stream_endpoint import FrameCodec, PlainFrames, serve_inference
from corolla.server.stream_guard import StreamLease

FRAMINGS = ("p2p", "socket", "direct")
BENCH_PEER = "bench-peer"  # the direct stream's peer in the stream byte budget
_KEYS = ds.StreamKeys.derive(b"k" * ds.KEY_BYTES, b"c" * ds.NONCE_BYTES, b"s" * ds.NONCE_BYTES)
_HIVEMIND_END = P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)


def _check(framing: str) -> str:
    if framing not in FRAMINGS:
        raise ValueError(f"framing must be one of {', '.join(FRAMINGS)}, got {framing!r}")
    return framing


class ClientFraming:
    """One client stream's side: requests framed (and sealed) in order, replies read to their end."""

    def __init__(self, framing: str):
        self.framing = _check(framing)
        self._sealer = ds.Sealer(_KEYS.client_to_server) if framing == "direct" else None

    def request(self, hivemind_frame: bytes) -> bytes:
        """The bytes of one request given as hivemind frames it (`handler_path.session_messages`)."""
        if self.framing == "p2p":
            return hivemind_frame
        body = hivemind_frame[1 + P2P.HEADER_LEN :]
        return self._sealer.seal(ls.MESSAGE, body) if self._sealer else b"".join(ls.frame(ls.MESSAGE, body))

    def end(self) -> bytes:
        if self.framing == "p2p":
            return _HIVEMIND_END
        return self._sealer.seal(ls.END) if self._sealer else b"".join(ls.frame(ls.END))

    async def reply(self, reader: asyncio.StreamReader) -> bool:
        """Reads one reply; True unless it is an error."""
        if self.framing == "p2p":
            marker = await reader.readexactly(1)
            await reader.readexactly(int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER))
            return marker == P2P.MESSAGE_MARKER
        kind, length = ls.parse_header(await reader.readexactly(ls.HEADER_BYTES), 1 << 30)
        await reader.readexactly(length)
        return kind == ls.MESSAGE


ServeStream = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def server_streams(
    framing: str, handler: TransformerConnectionHandler, guarded: Callable[..., Awaitable[None]], origin: object
) -> ServeStream:
    """How the handler process serves one connection in `framing` (`guarded`: stream_guard's handler, for p2p)."""
    if _check(framing) == "p2p":
        return lambda reader, writer: guarded(origin, reader, writer)
    max_frame_bytes = int(handler.max_stream_bytes) + (1 << 20)
    budget = handler.stream_budget

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name="rpc_inference", local_id=None, remote_id=None)
        codec: FrameCodec = SealedFrames(_KEYS) if framing == "direct" else PlainFrames()
        if framing == "direct":  # a remote peer's stream: its bytes charged, its idle timeout kept
            lease = StreamLease(budget, BENCH_PEER)
            idle_s = budget.limits.stream_idle_timeout_s or None
            await serve_inference(handler, reader, writer, context, codec, max_frame_bytes, lease=lease, idle_s=idle_s)
        else:
            await serve_inference(handler, reader, writer, context, codec, max_frame_bytes)

    return serve
