"""One forward or backward call to one server span: over the server's unix socket where it runs on this machine, else
its direct TCP port where it offers one (no p2pd on either side: decision 0059), else through p2p (`rpc_forward`/
`rpc_backward`, their `_stream` variants past 1 MiB). A streamed reply that ends before its first message or inside
a tensor is a `ConnectionError`: hivemind ends a stream cut under it silently, and what came is not the answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch
from hivemind.proto import runtime_pb2

from corolla.client.calls.output_checks import BadServerOutput, check_inputs_fit, check_outputs, reply_limit_bytes
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.transport.direct_transport import open_direct
from corolla.client.transport.framed_socket import FramedSocketStream
from corolla.client.transport.local_transport import LocalInferenceStream, responses_of
from corolla.client.transport.p2p_stream import InferenceStream
from corolla.protocol.codecs import (
    combine_parts,
    deserialize_tensor,
    needs_streaming,
    serialize_tensor,
    stream_messages,
)
from corolla.protocol.metadata import encode_metadata
from corolla.protocol.packing import pack_args_kwargs
from corolla.protocol.records import RemoteSpanInfo

_NONE = runtime_pb2.CompressionType.NONE
_FLOAT16 = runtime_pb2.CompressionType.FLOAT16
# Petals' dummies: what a request carries for no deep prompts, and a step for no beam reordering (hypo_ids)
NO_PROMPTS, NO_HYPO_IDS = torch.empty(0), torch.empty(0, dtype=torch.int64)
# the serialized form of each empty tensor kind sent so far (every decode step sends two: no deep prompts, no
# hypo_ids); keyed by everything serialize_tensor writes for an empty tensor
_EMPTY_TENSORS: dict[tuple[torch.dtype, tuple[int, ...], bool], runtime_pb2.Tensor] = {}


def span_prompts(prompts: torch.Tensor | None, first: int, span: RemoteSpanInfo) -> torch.Tensor:
    """Deep prompts [blocks, B|1, P, H] given for blocks from `first` on, cut to `span`'s blocks (NO_PROMPTS: none)."""
    if prompts is None or not prompts.numel():
        return NO_PROMPTS
    return prompts[span.start - first : span.end - first]


def _serialize_empty(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    """`serialize_tensor(tensor, NONE)` of an empty tensor, made once per (dtype, shape, requires_grad)."""
    key = (tensor.dtype, tuple(tensor.shape), tensor.requires_grad)
    message = _EMPTY_TENSORS.get(key)
    if message is None:
        message = _EMPTY_TENSORS[key] = serialize_tensor(tensor, _NONE)
    return message


def serialize_activations(tensors: Sequence[torch.Tensor], compression: int) -> list[runtime_pb2.Tensor]:
    """Floating-point tensors in the server's requested `compression` (as Petals clients send them); integer and
    empty tensors, and bfloat16 where float16 was asked (it cannot carry bf16), stay uncompressed. The returned
    messages may be shared: copy before changing one (protobuf copies them into a request anyway)."""
    out = []
    for t in tensors:
        if t.numel() == 0:
            out.append(_serialize_empty(t))
        elif t.is_floating_point() and not (t.dtype == torch.bfloat16 and compression == _FLOAT16):
            out.append(serialize_tensor(t, compression))
        else:
            out.append(serialize_tensor(t, _NONE))
    return out


class ReplyParts:
    """Counts the parts of a streamed reply's tensors: `cut` where the stream ended before the last part its current
    tensor announced (`chunks` on its first part; a tensor whose first part announces none is taken as whole)."""

    def __init__(self) -> None:
        self.missing = 0  # parts still due for the current tensor

    def add(self, parts: Sequence[runtime_pb2.Tensor]) -> None:
        for part in parts:
            self.missing = max(part.chunks, 1) - 1 if part.dtype else self.missing - 1  # (dtype: a first part)

    @property
    def cut(self) -> bool:
        return self.missing > 0


async def _call(
    manager: RemoteSequenceManager,
    span: RemoteSpanInfo,
    method: str,
    tensors: Sequence[torch.Tensor],
    structure: Any,
    limit_bytes: int,
) -> list[torch.Tensor]:
    """The reply's tensors; BadServerOutput once its messages hold more than `limit_bytes` (`reply_limit_bytes`)."""
    stub = await manager.get_stub(span.peer_id)
    uid = manager.make_chain(span.start, span.end)
    metadata = encode_metadata({**manager.request_metadata(span.peer_id), "args_structure": structure})
    compression = await manager.input_compression(span.peer_id, manager.block_uids[span.start])
    serialized = serialize_activations(tensors, compression)
    config = manager.config

    async def _requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        for request in stream_messages(runtime_pb2.ExpertRequest, serialized, uid=uid, metadata=metadata):
            yield request

    framed: InferenceStream | None = await open_socket_stream(manager, span.peer_id, f"{method}_stream")
    if framed is None and not needs_streaming(tensors):
        request = runtime_pb2.ExpertRequest(uid=uid, tensors=serialized, metadata=metadata)
        response = await getattr(stub, method)(request, timeout=config.request_timeout_s)
        _check_size(span, method, response.ByteSize(), limit_bytes)
        return [deserialize_tensor(t) for t in response.tensors]
    if framed is None:  # not hivemind's stub: its reader takes one message at whatever length the server announces
        opening = manager.open_inference_stream(span.peer_id, f"{method}_stream")
        framed = await asyncio.wait_for(opening, config.connect_timeout_s)
    # each message at most the whole reply's bytes: a frame is buffered whole before its bytes are counted
    stream = responses_of(framed, _requests(), limit_bytes)
    reply = ReplyParts()
    parts: list[runtime_pb2.Tensor] = []
    replies = received = 0

    async def _read() -> None:
        nonlocal replies, received
        async for response in stream:
            replies += 1
            received += response.ByteSize()
            _check_size(span, method, received, limit_bytes)
            reply.add(response.tensors)
            parts.extend(response.tensors)

    try:
        await asyncio.wait_for(_read(), config.request_timeout_s)
    finally:
        await stream.aclose()  # its sending task ended and its stream closed, whatever happened
    if not replies:  # hivemind ends a stream closed under it silently: a broken connection, not a server's answer
        raise ConnectionError(f"{method}_stream of {span.peer_id} closed without a reply")
    if reply.cut:
        raise ConnectionError(f"{method}_stream of {span.peer_id} closed in the middle of its reply")
    return [deserialize_tensor(t) for t in combine_parts(parts)]


def _check_size(span: RemoteSpanInfo, method: str, received_bytes: int, limit_bytes: int) -> None:
    if received_bytes > limit_bytes:
        raise BadServerOutput(
            span.peer_id, f"{method} reply holds more than {limit_bytes} bytes, the most its request implies"
        )


async def open_socket_stream(manager: RemoteSequenceManager, peer_id: str, rpc: str) -> FramedSocketStream | None:
    """A stream of `rpc` over `peer_id`'s unix socket (a server on this machine), else its direct port; None: p2p."""
    config = manager.config
    stream: FramedSocketStream | None = None
    if config.local_transport:
        stream = await LocalInferenceStream.open(peer_id, timeout_s=config.connect_timeout_s, rpc=rpc)
    if stream is None and config.direct_transport:
        stream = await open_direct(manager.direct_offers, peer_id, timeout_s=config.direct_connect_timeout_s, rpc=rpc)
    return stream


async def run_remote_forward(
    manager: RemoteSequenceManager, span: RemoteSpanInfo, inputs: torch.Tensor, prompts: torch.Tensor
) -> torch.Tensor:
    """Outputs `[B, T, H]` of blocks `[span.start, span.end)` for `inputs [B, T, H]` (prompts: `[blocks, B|1, P, H]`
    or empty). InputsOutOfRange, nothing sent, where its server's announced float16 cannot hold them (0170)."""
    check_inputs_fit(span, inputs=inputs, prompts=prompts)
    tensors, structure = pack_args_kwargs(inputs, prompts)
    outputs = await _call(manager, span, "rpc_forward", tensors, structure, reply_limit_bytes(inputs.shape))
    if len(outputs) != 1:
        raise BadServerOutput(span.peer_id, f"rpc_forward returned {len(outputs)} tensors, expected 1")
    return check_outputs(
        outputs[0], expected_shape=inputs.shape, peer_id=span.peer_id, what="rpc_forward output", dtype=inputs.dtype
    )


async def run_remote_backward(
    manager: RemoteSequenceManager,
    span: RemoteSpanInfo,
    inputs: torch.Tensor,
    grad_outputs: torch.Tensor,
    prompts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad wrt inputs `[B, T, H]`, grad wrt this span's deep prompts or None). InputsOutOfRange, nothing sent,
    where its server's announced float16 cannot hold the tensors (0170)."""
    check_inputs_fit(span, inputs=inputs, grad_outputs=grad_outputs, prompts=prompts)
    tensors, structure = pack_args_kwargs(inputs, grad_outputs, prompts)
    limit_bytes = reply_limit_bytes(inputs.shape, prompts.shape)
    grads = await _call(manager, span, "rpc_backward", tensors, structure, limit_bytes)
    if not 1 <= len(grads) <= 2:
        raise BadServerOutput(span.peer_id, f"rpc_backward returned {len(grads)} tensors, expected 1 or 2")
    grad_inputs = check_outputs(
        grads[0], expected_shape=inputs.shape, peer_id=span.peer_id, what="input gradient", dtype=inputs.dtype
    )
    grad_prompts = grads[1] if len(grads) > 1 and grads[1].numel() > 0 else None
    if grad_prompts is not None:
        if prompts.numel() == 0:
            raise BadServerOutput(span.peer_id, "rpc_backward returned prompt gradients for a call without prompts")
        check_outputs(
            grad_prompts,
            expected_shape=prompts.shape,
            peer_id=span.peer_id,
            what="prompt gradient",
            dtype=prompts.dtype,
        )
    return grad_inputs, grad_prompts
