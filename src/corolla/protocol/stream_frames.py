"""hivemind's framing of a protobuf stream between a peer and its p2pd, which stock Petals peers read and write:
a marker byte (0: a message follows, 1: an `RPCError` follows; an empty one ends the caller's input), the body's
length as 8 bytes big-endian, the body. Corolla's client (`client.transport.p2p_stream`) and server
(`server.front.stream_guard`) write each frame as one buffer where hivemind's `P2P.send_protobuf` makes three writes."""

from __future__ import annotations

MESSAGE_MARKER = 0  # hivemind's P2P.MESSAGE_MARKER
ERROR_MARKER = 1  # hivemind's P2P.ERROR_MARKER
LENGTH_BYTES = 8  # hivemind's P2P.HEADER_LEN, big-endian
FRAME_HEADER_BYTES = 1 + LENGTH_BYTES


def frame_header(marker: int, length: int) -> bytes:
    """The marker byte and 8-byte length that come before a body of `length` bytes."""
    return bytes((marker,)) + length.to_bytes(LENGTH_BYTES, "big")


END_OF_STREAM_FRAME = frame_header(ERROR_MARKER, 0)  # hivemind's P2P.END_OF_STREAM: an empty RPCError
