"""A usual inference step's request as bytes (`step_payload`): exactly what `ExpertRequest(uid=..., tensors=
serialize_activations([inputs, prompts, hypo_ids], compression), metadata=...).SerializeToString()` writes, built
without the messages (the uid's field once per session, the empty prompts' and hypo_ids' records once per process):
a client's stepping thread builds it cold after each wait, where each torch, numpy or protobuf call costs 5-10 us
(`benchmarks.users.client_cpu`). It also hands back the values as sent, which the span's history keeps."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from hivemind.proto import runtime_pb2

from corolla.client.calls.remote_forward_backward import serialize_activations
from corolla.protocol.codecs import record_frame, varint

_NONE = int(runtime_pb2.CompressionType.NONE)
_UID_TAG, _TENSOR_TAG, _METADATA_TAG = b"\x0a", b"\x12", b"\x1a"  # ExpertRequest's fields 1, 2 and 3
MAX_EMPTY_FIELDS = 64  # (dtype, shape, requires_grad) of the empty tensors whose field is kept
_empty_fields: dict[tuple[torch.dtype, tuple[int, ...], bool], bytes] = {}


def uid_field(uid: str) -> bytes:
    """The request's uid field (none for an empty uid: proto3 leaves it out)."""
    data = uid.encode()
    return _UID_TAG + varint(len(data)) + data if data else b""


def _empty_field(tensor: torch.Tensor) -> bytes:
    """The tensors field of an empty tensor's record, made once per (dtype, shape, requires_grad)."""
    key = (tensor.dtype, tuple(tensor.shape), tensor.requires_grad)
    field = _empty_fields.get(key)
    if field is None:
        record = serialize_activations([tensor], _NONE)[0].SerializeToString()
        if len(_empty_fields) >= MAX_EMPTY_FIELDS:
            _empty_fields.clear()
        field = _empty_fields[key] = _TENSOR_TAG + varint(len(record)) + record
    return field


def step_payload(
    uid: bytes, tensors: Sequence[torch.Tensor], compression: int, metadata: bytes
) -> tuple[bytes, bytes] | None:
    """(the request's bytes, the inputs' values as sent) for `uid` (its field: `uid_field`), `tensors` (the inputs,
    then the empty prompts and hypo_ids) and encoded `metadata`; None where the step is not the usual one: a
    compression, inputs that are not a contiguous CPU tensor of values without grad sent raw (`record_frame`: not
    legacy bf16, some values), or other tensors than two empty ones after them."""
    if compression != _NONE or len(tensors) != 3:
        return None
    inputs, prompts, hypo_ids = tensors
    if prompts.numel() or hypo_ids.numel() or inputs.requires_grad or not inputs.is_cpu or not inputs.is_contiguous():
        return None
    frame = record_frame(tuple(inputs.shape), inputs.dtype)
    if frame is None:
        return None
    head, tail, _ = frame
    values = ctypes.string_at(inputs.data_ptr(), inputs.nbytes)  # one copy of the contiguous values
    fields = [uid, head, values, tail, _empty_field(prompts), _empty_field(hypo_ids)]
    if metadata:  # (proto3 leaves an empty field out)
        fields += (_METADATA_TAG, varint(len(metadata)), metadata)
    return b"".join(fields), values
