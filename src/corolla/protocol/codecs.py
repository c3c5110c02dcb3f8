"""Tensor (de)serialization through hivemind's codecs, as Petals peers expect it: bf16 goes raw (2 bytes/value),
the legacy fp32 form is still decoded; large tensors are split into 4 MiB stream parts. Decoding validates input."""

from __future__ import annotations

import os
from collections.abc import AsyncIterable, Iterable, Iterator, Sequence

import hivemind.compression.base
import torch
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.streaming import split_for_streaming as _hivemind_split

# Like Petals: raw bf16 on the wire unless the user explicitly asks for the legacy fp32 form.
if "USE_LEGACY_BFLOAT16" not in os.environ:
    hivemind.compression.base.USE_LEGACY_BFLOAT16 = False

CompressionType = runtime_pb2.CompressionType

STREAM_CHUNK_BYTES = 4 * 1024 * 1024  # hivemind's DEFAULT_MAX_MSG_SIZE, used by Petals in both directions
MAX_UNARY_PAYLOAD_BYTES = 2 * 1024 * 1024  # unary messages stay well under p2pd's 4 MiB limit
STREAM_THRESHOLD_BYTES = 1024 * 1024  # send through `*_stream` handlers above this raw size (reference does too)
MAX_TENSOR_NDIM = 8

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}
_ITEMSIZES: dict[torch.dtype, int] = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _DTYPES.values()}
_RAW_VIEWS = frozenset(_DTYPES.values())  # dtypes whose NONE form is built here (numpy can hold their bytes)
_COMPRESSION_VALUES = frozenset(CompressionType.values())
_FLOAT_ONLY = frozenset(
    {
        CompressionType.FLOAT16,
        CompressionType.MEANSTD_16BIT,
        CompressionType.QUANTILE_8BIT,
        CompressionType.UNIFORM_8BIT,
    }
)


def compression_from_name(name: str) -> int:
    """`"none"`/`"FLOAT16"`/... -> the CompressionType value; ValueError listing the valid names otherwise."""
    try:
        return CompressionType.Value(name.upper())
    except (ValueError, AttributeError) as e:
        raise ValueError(f"unknown compression {name!r}, expected one of {list(CompressionType.keys())}") from e


def serialize_tensor(tensor: torch.Tensor, compression: int = CompressionType.NONE) -> runtime_pb2.Tensor:
    """Serializes one tensor (moved to CPU if needed). Non-float tensors always go uncompressed, as in Petals."""
    if compression not in _COMPRESSION_VALUES:
        raise ValueError(f"unknown compression type {compression!r}")
    if not tensor.dtype.is_floating_point:
        compression = CompressionType.NONE
    if tensor.dtype == torch.bfloat16 and compression == CompressionType.FLOAT16:
        raise ValueError("FLOAT16 compression cannot carry bfloat16 tensors; use NONE or MEANSTD_16BIT")
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if compression == CompressionType.NONE and tensor.dtype in _RAW_VIEWS:
        return _serialize_raw(tensor)
    return serialize_torch_tensor(tensor, compression)


def _serialize_raw(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    """The bytes hivemind's NONE codec writes (raw bf16 unless legacy mode), built directly: one copy, no registry
    lookups (the per-step output path)."""
    requires_grad = tensor.requires_grad
    data = tensor.detach()
    if data.dtype == torch.bfloat16 and hivemind.compression.base.USE_LEGACY_BFLOAT16:
        data = data.float()
    elif data.dtype == torch.bfloat16:
        data = data.view(torch.int16)  # numpy has no bfloat16: same bytes as a 2-byte integer type
    return runtime_pb2.Tensor(
        compression=CompressionType.NONE,
        buffer=data.numpy().tobytes(),
        size=tensor.shape,
        dtype=_DTYPE_NAMES[tensor.dtype],
        requires_grad=requires_grad,
    )


def serialize_tensors(
    tensors: Sequence[torch.Tensor], compressions: int | Sequence[int] = CompressionType.NONE
) -> list[runtime_pb2.Tensor]:
    """Serializes a list of tensors with one compression for all or one per tensor."""
    if isinstance(compressions, int):
        compressions = [compressions] * len(tensors)
    if len(compressions) != len(tensors):
        raise ValueError(f"got {len(compressions)} compressions for {len(tensors)} tensors")
    return [serialize_tensor(t, c) for t, c in zip(tensors, compressions, strict=True)]


def _check_header(serialized: runtime_pb2.Tensor) -> torch.Size:
    if serialized.compression not in _COMPRESSION_VALUES:
        raise ValueError(f"unknown tensor compression {serialized.compression}")
    if len(serialized.size) > MAX_TENSOR_NDIM:
        raise ValueError(f"tensor has {len(serialized.size)} dims, more than the limit of {MAX_TENSOR_NDIM}")
    shape = torch.Size(serialized.size)
    if serialized.compression == CompressionType.NONE:
        dtype = _DTYPES.get(serialized.dtype)
        if dtype is None:
            raise ValueError(f"unsupported tensor dtype {serialized.dtype!r}, expected one of {sorted(_DTYPES)}")
        expected = shape.numel() * _ITEMSIZES[dtype]
        legacy_bf16 = dtype == torch.bfloat16 and len(serialized.buffer) == shape.numel() * 4
        if len(serialized.buffer) != expected and not legacy_bf16:
            raise ValueError(
                f"tensor buffer has {len(serialized.buffer)} bytes, expected {expected} for {serialized.dtype}{list(shape)}"
            )
    return shape


def _deserialize_raw(serialized: runtime_pb2.Tensor, shape: torch.Size) -> torch.Tensor:
    """hivemind's NONE decoding (raw values, or legacy fp32-coded bf16), straight from the (checked) buffer into a
    writable tensor of its own: one copy, no numpy round trip (the per-step input path)."""
    dtype = _DTYPES[serialized.dtype]
    numel = shape.numel()
    if numel == 0:
        tensor = torch.empty(shape, dtype=dtype)
    elif dtype == torch.bfloat16 and len(serialized.buffer) == numel * 4:  # legacy form: fp32 values
        tensor = torch.frombuffer(bytearray(serialized.buffer), dtype=torch.float32).to(torch.bfloat16).view(shape)
    else:
        tensor = torch.frombuffer(bytearray(serialized.buffer), dtype=dtype).view(shape)
    if serialized.requires_grad:
        if not dtype.is_floating_point:
            raise ValueError(f"cannot decode tensor ({serialized.dtype}{list(shape)}): only float tensors require grad")
        tensor.requires_grad_(True)
    return tensor


def deserialize_tensor(serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """Restores a tensor; malformed input (bad dtype, size mismatch, corrupt payload) -> ValueError."""
    shape = _check_header(serialized)
    if serialized.compression == CompressionType.NONE:
        return _deserialize_raw(serialized, shape)
    try:
        tensor = deserialize_torch_tensor(serialized)
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"cannot decode tensor ({serialized.dtype}{list(shape)}): {e!r:.200}") from e
    if tensor.shape != shape:
        raise ValueError(f"decoded tensor has shape {list(tensor.shape)}, header says {list(shape)}")
    return tensor


def split_for_streaming(
    serialized: runtime_pb2.Tensor, chunk_bytes: int = STREAM_CHUNK_BYTES
) -> Iterator[runtime_pb2.Tensor]:
    """Splits one serialized tensor into parts; the first carries the header, the rest only buffer bytes."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    return _hivemind_split(serialized, chunk_bytes)


def combine_parts(parts: Iterable[runtime_pb2.Tensor]) -> list[runtime_pb2.Tensor]:
    """Groups stream parts back into whole serialized tensors (a part with a dtype starts a new tensor)."""
    tensors: list[runtime_pb2.Tensor] = []
    current: list[runtime_pb2.Tensor] = []
    for part in parts:
        if part.dtype and current:
            tensors.append(combine_from_streaming(current))
            current = []
        if not current and not part.dtype:
            raise ValueError("stream part without a header (dtype) where a new tensor should start")
        current.append(part)
    if current:
        tensors.append(combine_from_streaming(current))
    return tensors


async def deserialize_tensor_stream(stream: AsyncIterable[Iterable[runtime_pb2.Tensor]]) -> list[torch.Tensor]:
    """Collects the tensor parts of every message of a stream and decodes the whole tensors."""
    parts: list[runtime_pb2.Tensor] = []
    async for message_parts in stream:
        parts.extend(message_parts)
    return [deserialize_tensor(t) for t in combine_parts(parts)]


def raw_size_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def needs_streaming(tensors: Iterable[torch.Tensor]) -> bool:
    """True if these tensors should travel through a `*_stream` handler rather than a unary call."""
    return raw_size_bytes(tensors) > STREAM_THRESHOLD_BYTES
