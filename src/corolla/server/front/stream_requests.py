"""Reading a whole `rpc_*_stream` request (uid and metadata from its first message, tensor parts from all) and
splitting a reply into stream messages. Byte budgets and stalled peers are `stream_guard`'s; this bounds the
message count, the total size and the whole request's time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from hivemind.proto import runtime_pb2

from corolla.protocol.codecs import STREAM_CHUNK_BYTES, stream_messages
from corolla.protocol.codecs import combine_parts as combine_tensor_parts

MAX_STREAM_MESSAGES = 4096


async def gather_stream(
    requests: AsyncIterator[runtime_pb2.ExpertRequest], *, request_timeout_s: float, max_stream_bytes: int
) -> tuple[str, list[runtime_pb2.Tensor], bytes]:
    """uid, combined serialized tensors and metadata of a stream request; the uid must be equal in all parts."""
    uid: str | None = None
    metadata = b""
    parts: list[runtime_pb2.Tensor] = []
    total_bytes = 0
    deadline = time.monotonic() + request_timeout_s
    iterator = requests.__aiter__()
    for count in range(MAX_STREAM_MESSAGES + 1):
        remaining = deadline - time.monotonic()
        try:
            message = await asyncio.wait_for(iterator.__anext__(), max(remaining, 0.001))
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise ValueError(f"stream request not complete within request_timeout={request_timeout_s} s") from None
        if count == MAX_STREAM_MESSAGES:
            raise ValueError(f"stream request has more than {MAX_STREAM_MESSAGES} messages")
        if uid is None:
            uid, metadata = message.uid, message.metadata
        elif message.uid != uid:
            raise ValueError("all messages of a stream request must carry the same uid")
        total_bytes += sum(len(t.buffer) for t in message.tensors)
        if total_bytes > max_stream_bytes:
            raise ValueError(f"stream request is larger than the limit of {max_stream_bytes} bytes")
        parts.extend(message.tensors)
    if uid is None:
        raise ValueError("stream request is empty: expected at least one message with uid and tensors")
    return uid, combine_tensor_parts(parts), metadata


def stream_response(tensors: Sequence[runtime_pb2.Tensor]) -> list[runtime_pb2.ExpertResponse]:
    return stream_messages(runtime_pb2.ExpertResponse, tensors, STREAM_CHUNK_BYTES)
