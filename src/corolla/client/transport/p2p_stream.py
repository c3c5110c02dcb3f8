"""`P2PInferenceStream`: an `rpc_inference` stream (or a training call's stream) through the client's p2pd, on a
connection to the daemon this module opens itself (STREAM_OPEN, as hivemind's `stream_open`) and then drives as a raw
socket (`framed_socket.FramedSocketStream`). Messages are framed as hivemind frames its protobuf streams, so stock
Petals servers read the bytes a hivemind stub sends; but each request is one write (hivemind's stub makes three, from
a writer task), a step may run in the caller's thread (`exchange`), and response lengths are bounded before anything
is allocated (hivemind's reader trusts the 8-byte length a peer sends)."""

from __future__ import annotations

import asyncio
import socket
from typing import Protocol

from hivemind.p2p import P2P, P2PHandlerError, PeerID
from hivemind.proto import p2pd_pb2, runtime_pb2
from hivemind.utils.multiaddr import Multiaddr, protocols

from corolla.client.transport.framed_socket import FramedSocketStream
from corolla.client.transport.link_probe import tcp_address
from corolla.protocol.codecs import varint
from corolla.protocol.rpc import handle_name
from corolla.protocol.stream_frames import (
    END_OF_STREAM_FRAME,
    ERROR_MARKER,
    FRAME_HEADER_BYTES,
    MESSAGE_MARKER,
    frame_header,
)

MAX_ERROR_BYTES = 1 << 16  # a server's error message
MAX_CONTROL_BYTES = 1 << 16  # p2pd's answer to STREAM_OPEN (peer id, address, protocol)
INFERENCE_HANDLE = handle_name("rpc_inference")


class InferenceStream(Protocol):
    """What a span session needs of an open `rpc_inference` stream (p2p, the local socket or a test's fake)."""

    closed: bool

    async def send(self, request: runtime_pb2.ExpertRequest) -> None: ...

    async def send_end(self) -> None: ...

    async def receive(self, max_bytes: int = ...) -> runtime_pb2.ExpertResponse | None: ...

    def close(self) -> None: ...


def request_frame(request: runtime_pb2.ExpertRequest | bytes) -> bytes:
    """The bytes hivemind's `P2P.send_protobuf` writes for `request` (a message or its serialized bytes; in three
    writes), as one buffer."""
    data = request if isinstance(request, bytes) else request.SerializeToString()
    return frame_header(MESSAGE_MARKER, len(data)) + data


async def _read_varint(loop: asyncio.AbstractEventLoop, sock: socket.socket, limit: int) -> int:
    result, shift = 0, 0
    while True:
        byte = await loop.sock_recv(sock, 1)
        if not byte:
            raise EOFError("p2pd closed the connection")
        result |= (byte[0] & 0x7F) << shift
        if result > limit:
            raise ConnectionError(f"p2pd announced a {result}-byte message (limit {limit})")
        if not byte[0] & 0x80:
            return result
        shift += 7


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = await loop.sock_recv(sock, count - len(data))
        if not chunk:
            raise EOFError("p2pd closed the connection")
        data += chunk
    return bytes(data)


def _daemon_socket(p2p: P2P) -> tuple[socket.socket, str | tuple[str, int]]:
    """A non-blocking socket for the daemon's control address (unix or tcp, as hivemind's DaemonConnector)."""
    maddr = p2p.daemon_listen_maddr
    codes = {p.code for p in maddr.protocols()}
    if protocols.P_UNIX in codes:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address: str | tuple[str, int] = maddr.value_for_protocol(protocols.P_UNIX)
    elif protocols.P_IP4 in codes and protocols.P_TCP in codes:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address = (maddr.value_for_protocol(protocols.P_IP4), int(maddr.value_for_protocol(protocols.P_TCP)))
    else:
        raise ValueError(f"p2pd control address {maddr} is neither unix nor ip4/tcp")
    sock.setblocking(False)
    return sock, address


class P2PInferenceStream(FramedSocketStream):
    """One `rpc_inference` stream through p2pd (see the module docstring). `remote_address`: the (host, port) of the
    daemon's connection to the server, where it is a direct TCP one (`client.transport.link_probe`)."""

    remote_address: tuple[str, int] | None = None
    header_bytes = FRAME_HEADER_BYTES

    @classmethod
    async def open(cls, p2p: P2P, peer_id: str, rpc: str = "rpc_inference") -> P2PInferenceStream:
        """Opens the stream of `rpc` (`rpc_inference`, or `rpc_forward_stream`/`rpc_backward_stream`: the same
        framing; the caller bounds the time); ConnectionError when p2pd cannot reach the server."""
        sock, address = _daemon_socket(p2p)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_connect(sock, address)
            open_request = p2pd_pb2.StreamOpenRequest(peer=PeerID.from_base58(peer_id).to_bytes())
            open_request.proto.append(handle_name(rpc))
            request = p2pd_pb2.Request(type=p2pd_pb2.Request.STREAM_OPEN, streamOpen=open_request).SerializeToString()
            await loop.sock_sendall(sock, varint(len(request)) + request)
            length = await _read_varint(loop, sock, MAX_CONTROL_BYTES)
            response = p2pd_pb2.Response.FromString(await _recv_exactly(loop, sock, length))
            if response.type == p2pd_pb2.Response.ERROR:
                raise ConnectionError(f"p2pd could not open a stream to ...{peer_id[-6:]}: {response.error.msg}")
            remote = Multiaddr(response.streamInfo.addr) if response.streamInfo.addr else None
        except BaseException:
            sock.close()
            raise
        stream = cls(sock, peer_id, rpc)
        stream.remote_address = tcp_address(remote)
        return stream

    def _request_frame(self, payload: bytes) -> bytes:
        return request_frame(payload)

    def _end_frame(self) -> bytes:
        return END_OF_STREAM_FRAME

    def _header(self, buffer: bytearray, max_payload_bytes: int) -> tuple[int, int]:
        marker, length = buffer[0], int.from_bytes(buffer[1:FRAME_HEADER_BYTES], "big")
        if marker not in (MESSAGE_MARKER, ERROR_MARKER):
            raise ValueError(f"unknown frame marker {marker}")
        limit = max_payload_bytes if marker == MESSAGE_MARKER else MAX_ERROR_BYTES
        if length > limit:
            raise ValueError(f"a frame of {length} bytes exceeds the limit of {limit} bytes")
        return marker, length

    def _response(self, kind: int, payload: bytes) -> runtime_pb2.ExpertResponse | None:
        if kind == MESSAGE_MARKER:
            return runtime_pb2.ExpertResponse.FromString(payload)
        error = p2pd_pb2.RPCError.FromString(payload)
        raise P2PHandlerError(f"Failed to call handler `{handle_name(self.rpc)}` at {self.peer_id}: {error.message}")
