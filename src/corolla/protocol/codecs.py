"""Tensor (de)serialization through hivemind's codecs, as Petals peers expect it: bf16 raw (the legacy fp32 form still
decoded), large tensors split into 4 MiB stream parts. Decoding trusts nothing: before anything is allocated the header
is checked against `TensorLimits` and the buffer must be exactly the compression's layout for that shape (hivemind's
own decoders would `np.dtype()` any declared dtype). `check_castable` refuses values a cast would turn into inf."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import hivemind.compression.base
import numpy as np
import torch
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.streaming import split_for_streaming as _hivemind_split

from corolla.utils.tensor_bytes import TensorBytes

_Message = TypeVar("_Message", runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)

# Like Petals: raw bf16 on the wire unless the user explicitly asks for the legacy fp32 form.
if "USE_LEGACY_BFLOAT16" not in os.environ:
    hivemind.compression.base.USE_LEGACY_BFLOAT16 = False

CompressionType = runtime_pb2.CompressionType
# plain ints for the per-step paths: each `CompressionType.X` is a Python-level __getattr__ call
_NONE, _FLOAT16 = int(CompressionType.NONE), int(CompressionType.FLOAT16)

STREAM_CHUNK_BYTES = 4 * 1024 * 1024  # hivemind's DEFAULT_MAX_MSG_SIZE, used by Petals in both directions
MAX_UNARY_PAYLOAD_BYTES = 2 * 1024 * 1024  # unary messages stay well under p2pd's 4 MiB limit
STREAM_THRESHOLD_BYTES = 1024 * 1024  # send through `*_stream` handlers above this raw size (reference does too)
MAX_TENSOR_NDIM = 8
MAX_TENSOR_ELEMENTS = 1 << 28  # 256 Mi values: far above any hidden state a server accepts (it checks its own limit)
MAX_TENSOR_DECODED_BYTES = 1 << 30  # what one decoded tensor may occupy


@dataclass(frozen=True)
class TensorLimits:
    """Bounds checked on a serialized tensor's header before its buffer is decoded."""

    max_ndim: int = MAX_TENSOR_NDIM
    max_elements: int = MAX_TENSOR_ELEMENTS
    max_decoded_bytes: int = MAX_TENSOR_DECODED_BYTES

    def __post_init__(self) -> None:
        for name in ("max_ndim", "max_elements", "max_decoded_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"TensorLimits.{name} must be >= 1, got {getattr(self, name)}")


DEFAULT_TENSOR_LIMITS = TensorLimits()

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
_DTYPE_ITEMSIZES: dict[str, tuple[torch.dtype, int]] = {
    name: (dtype, _ITEMSIZES[dtype]) for name, dtype in _DTYPES.items()
}
_RAW_VIEWS = frozenset(_DTYPES.values())  # dtypes whose NONE form is built here (numpy can hold their bytes)
_COMPRESSION_VALUES = frozenset(CompressionType.values())
# dtype names each hivemind codec writes (numpy names, or "bfloat16"), so the only ones we decode
_FP16_CODEC_DTYPES = frozenset({"float16", "float32", "float64"})  # FLOAT16 and MEANSTD_16BIT refuse bf16
_8BIT_CODEC_DTYPES = frozenset({"float16", "float32", "float64", "bfloat16"})
_CODEC_DTYPES: dict[int, frozenset[str]] = {
    CompressionType.NONE: frozenset(_DTYPES),
    CompressionType.FLOAT16: _FP16_CODEC_DTYPES,
    CompressionType.MEANSTD_16BIT: _FP16_CODEC_DTYPES,
    CompressionType.QUANTILE_8BIT: _8BIT_CODEC_DTYPES,
    CompressionType.UNIFORM_8BIT: _8BIT_CODEC_DTYPES,
    CompressionType.BLOCKWISE_8BIT: _8BIT_CODEC_DTYPES,
}
_CODEBOOK_MAX_ENTRIES = 256  # 8-bit indices: hivemind's codebooks have 256 float32 entries
_BLOCKWISE_BLOCK_ELEMENTS = 4096  # hivemind's _BLOCKWISE_QUANTIZATION_BLOCKSIZE: one float32 absmax per block


def compression_from_name(name: str) -> int:
    """`"none"`/`"FLOAT16"`/... -> the CompressionType value; ValueError listing the valid names otherwise."""
    try:
        return CompressionType.Value(name.upper())
    except (ValueError, AttributeError) as e:
        raise ValueError(f"unknown compression {name!r}, expected one of {list(CompressionType.keys())}") from e


def serialize_tensor(
    tensor: torch.Tensor, compression: int = CompressionType.NONE, into: Any = None
) -> runtime_pb2.Tensor:
    """Serializes one tensor (moved to CPU if needed). Non-float tensors always go uncompressed, as in Petals.
    `into`: a message's repeated `tensors` field; the record is added to it (the NONE codec's built there in place:
    no second copy of it into the message) and returned."""
    if compression not in _COMPRESSION_VALUES:
        raise ValueError(f"unknown compression type {compression!r}")
    if not tensor.dtype.is_floating_point:
        compression = _NONE
    if tensor.dtype == torch.bfloat16 and compression == _FLOAT16:
        raise ValueError("FLOAT16 compression cannot carry bfloat16 tensors; use NONE or MEANSTD_16BIT")
    if not tensor.is_cpu:  # (is_cpu: a flag; device.type builds a device object, ~1 us per step)
        tensor = tensor.cpu()
    if compression == _NONE and tensor.dtype in _RAW_VIEWS:
        return _serialize_raw(tensor, into)
    return _added(serialize_torch_tensor(tensor, compression), into)


def _added(record: runtime_pb2.Tensor, into: Any) -> runtime_pb2.Tensor:
    """`record`, or its copy added to `into` (a repeated `tensors` field) where given."""
    if into is None:
        return record
    into.append(record)
    return into[-1]


def serialize_tensor_bytes(
    output: TensorBytes, compression: int = CompressionType.NONE, into: Any = None
) -> runtime_pb2.Tensor:
    """`serialize_tensor(output.tensor(), compression)` without building the tensor where the NONE codec writes the
    bytes as they are (a launched decode step's reply: its bytes copied once into the message, no torch call).
    `into`: as `serialize_tensor`'s."""
    dtype = output.dtype
    if (
        compression == _NONE
        and dtype in _RAW_VIEWS
        and not (dtype == torch.bfloat16 and hivemind.compression.base.USE_LEGACY_BFLOAT16)
    ):
        return _raw_message(bytes(output.data), output.shape, dtype, requires_grad=False, into=into)
    return serialize_tensor(output.tensor(), compression, into)


def varint(value: int) -> bytes:
    """Protobuf's base-128 varint of `value` >= 0."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


MAX_RECORD_FRAMES = 64  # (shape, dtype) pairs whose `record_frame` is kept (a server's steps have a few)
_record_frames: dict[tuple[tuple[int, ...], torch.dtype], tuple[bytes, bytes, int]] = {}


def record_frame(
    shape: tuple[int, ...], dtype: torch.dtype, compression: int = CompressionType.NONE
) -> tuple[bytes, bytes, int] | None:
    """(head, tail, offset): `ExpertResponse(tensors=[record])`'s serialized bytes are `head + values + tail` for
    the NONE record of `dtype` values of `shape` (`serialize_tensor_bytes`'s, values in their wire form), and its
    record's bytes begin at `offset`; the same bytes as `SerializeToString()` (upb writes fields in number order and
    leaves proto3's defaults out: no requires_grad, compression NONE, no chunks). None where that record is not the
    raw one (another compression, a dtype not built raw, legacy bf16) or has no values."""
    if compression != _NONE or (dtype == torch.bfloat16 and hivemind.compression.base.USE_LEGACY_BFLOAT16):
        return None
    key = (shape, dtype)
    frame = _record_frames.get(key)
    if frame is not None:
        return frame
    if dtype not in _RAW_VIEWS:
        return None
    nbytes = math.prod(shape) * _ITEMSIZES[dtype]
    if nbytes <= 0:
        return None
    sizes = b"".join(varint(dim) for dim in shape)
    name = _DTYPE_NAMES[dtype].encode()
    tail = (b"\x12" + varint(len(sizes)) + sizes if sizes else b"") + b"\x22" + varint(len(name)) + name
    record_head = b"\x0a" + varint(nbytes)  # field 1 (buffer), field 2 (size, packed), field 4 (dtype)
    record_bytes = len(record_head) + nbytes + len(tail)
    head = b"\x12" + varint(record_bytes) + record_head  # ExpertResponse field 2 (tensors), one record
    frame = (head, tail, len(head) - len(record_head))
    if len(_record_frames) >= MAX_RECORD_FRAMES:
        _record_frames.clear()
    _record_frames[key] = frame
    return frame


def _serialize_raw(tensor: torch.Tensor, into: Any = None) -> runtime_pb2.Tensor:
    """The bytes hivemind's NONE codec writes (raw bf16 unless legacy mode), built directly: one copy, no registry
    lookups (the per-step output path)."""
    requires_grad = tensor.requires_grad
    data = tensor.detach() if requires_grad else tensor
    if data.dtype == torch.bfloat16 and hivemind.compression.base.USE_LEGACY_BFLOAT16:
        data = data.float()
    elif data.dtype == torch.bfloat16:
        data = data.view(torch.int16)  # numpy has no bfloat16: same bytes as a 2-byte integer type
    return _raw_message(data.numpy().tobytes(), tensor.shape, tensor.dtype, requires_grad=requires_grad, into=into)


def _raw_message(
    buffer: bytes, shape: Sequence[int], dtype: torch.dtype, *, requires_grad: bool, into: Any = None
) -> runtime_pb2.Tensor:
    """The NONE codec's message around bytes already in their wire form (both raw serializers); added to `into` (a
    repeated `tensors` field) where given."""
    make = runtime_pb2.Tensor if into is None else into.add
    return make(compression=_NONE, buffer=buffer, size=shape, dtype=_DTYPE_NAMES[dtype], requires_grad=requires_grad)


def _int64_at(buffer: bytes, offset: int) -> int:
    if len(buffer) < offset + 8:
        raise ValueError(f"tensor buffer has {len(buffer)} bytes, too short for its codebook header")
    return int.from_bytes(buffer[offset : offset + 8], "little", signed=True)


def _expected_buffer_bytes(compression: int, shape: Sequence[int], numel: int, buffer: bytes) -> int:
    """The exact buffer length hivemind's codec `compression` writes for this shape (quantized codecs: using the
    codebook sizes at the start of the buffer, themselves checked). ValueError if the layout cannot hold."""
    if compression == CompressionType.FLOAT16:
        return 2 * numel  # fp16 values
    if compression == CompressionType.MEANSTD_16BIT:
        if not shape:
            raise ValueError("MEANSTD_16BIT tensors need at least one dimension")
        rows = math.prod(shape[:-1])
        return 2 * numel + 2 * 4 * rows  # fp16 values, then fp32 means and stds per row
    if compression in (CompressionType.QUANTILE_8BIT, CompressionType.UNIFORM_8BIT):
        codebook = _int64_at(buffer, 0)
        if not 1 <= codebook <= _CODEBOOK_MAX_ENTRIES:
            raise ValueError(f"codebook has {codebook} entries, expected 1..{_CODEBOOK_MAX_ENTRIES}")
        return 8 + 4 * codebook + numel  # int64 size, fp32 codebook, uint8 indices
    if compression == CompressionType.BLOCKWISE_8BIT:
        absmax, codebook = _int64_at(buffer, 0), _int64_at(buffer, 8)
        blocks = -(-numel // _BLOCKWISE_BLOCK_ELEMENTS)
        if absmax != blocks or not 1 <= codebook <= _CODEBOOK_MAX_ENTRIES:
            raise ValueError(
                f"blockwise header says {absmax} blocks and {codebook} codebook entries, expected {blocks} "
                f"and 1..{_CODEBOOK_MAX_ENTRIES}"
            )
        return 16 + 4 * (absmax + codebook) + numel  # int64 sizes, fp32 absmax per block, fp32 codebook, indices
    raise ValueError(f"unknown tensor compression {compression}")


def _check_shape(serialized: runtime_pb2.Tensor, limits: TensorLimits) -> tuple[list[int], int]:
    """Header checks that need no buffer: compression, dtype whitelist, ndim, element count, decoded bytes."""
    compression = serialized.compression
    allowed = _CODEC_DTYPES.get(compression)
    if allowed is None:
        raise ValueError(f"unknown tensor compression {compression}")
    if serialized.dtype not in allowed:
        raise ValueError(
            f"unsupported tensor dtype {serialized.dtype[:40]!r} for compression "
            f"{CompressionType.Name(compression)}, expected one of {sorted(allowed)}"
        )
    if len(serialized.size) > limits.max_ndim:
        raise ValueError(f"tensor has {len(serialized.size)} dims, more than the limit of {limits.max_ndim}")
    shape = list(serialized.size)
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor shape {shape} has a negative dimension")
    numel = math.prod(shape)  # Python ints: no overflow
    if numel > limits.max_elements:
        raise ValueError(f"tensor of shape {shape} has {numel} elements, more than the limit of {limits.max_elements}")
    decoded_bytes = numel * _ITEMSIZES[_DTYPES[serialized.dtype]]
    if decoded_bytes > limits.max_decoded_bytes:
        raise ValueError(
            f"tensor {serialized.dtype}{shape} would take {decoded_bytes} bytes, more than the limit of "
            f"{limits.max_decoded_bytes}"
        )
    return shape, numel


def _check_header(serialized: runtime_pb2.Tensor, limits: TensorLimits = DEFAULT_TENSOR_LIMITS) -> torch.Size:
    shape, numel = _check_shape(serialized, limits)
    buffer = serialized.buffer
    if serialized.compression == CompressionType.NONE:
        expected = numel * _ITEMSIZES[_DTYPES[serialized.dtype]]
        legacy_bf16 = serialized.dtype == "bfloat16" and len(buffer) == numel * 4
        if len(buffer) != expected and not legacy_bf16:
            raise ValueError(
                f"tensor buffer has {len(buffer)} bytes, expected {expected} for {serialized.dtype}{shape}"
            )
    else:
        expected = _expected_buffer_bytes(serialized.compression, shape, numel, buffer)
        if len(buffer) != expected:
            raise ValueError(
                f"tensor buffer has {len(buffer)} bytes, expected {expected} for {serialized.dtype}{shape} "
                f"compressed as {CompressionType.Name(serialized.compression)}"
            )
    return torch.Size(shape)


def _max_buffer_bytes(header: runtime_pb2.Tensor, limits: TensorLimits) -> int:
    """An upper bound on the buffer of a tensor with this (first stream part's) header, from its shape alone."""
    shape, numel = _check_shape(header, limits)
    compression = header.compression
    if compression == CompressionType.NONE:
        return numel * max(_ITEMSIZES[_DTYPES[header.dtype]], 4 if header.dtype == "bfloat16" else 0)
    if compression in (CompressionType.FLOAT16, CompressionType.MEANSTD_16BIT):
        return 2 * numel + (8 * math.prod(shape[:-1]) if shape else 0)
    blocks = -(-numel // _BLOCKWISE_BLOCK_ELEMENTS)
    return 16 + 4 * (blocks + _CODEBOOK_MAX_ENTRIES) + numel


_FINITE_MAX: dict[torch.dtype, float] = {}


def _finite_max(dtype: torch.dtype) -> float:
    value = _FINITE_MAX.get(dtype)
    if value is None:
        value = _FINITE_MAX[dtype] = torch.finfo(dtype).max
    return value


def check_castable(
    tensor: torch.Tensor, dtype: torch.dtype, *, name: str = "tensor", finite_checked: bool = False
) -> None:
    """ValueError if casting float `tensor` to float `dtype` would yield inf or NaN: non-finite values, or values
    beyond `dtype`'s finite range (e.g. float64 1e300 into a float32/bf16 block, 1e5 into float16). One pass over
    the tensor only when `dtype` is narrower; otherwise only the finiteness check (skipped if `finite_checked`)."""
    if not tensor.dtype.is_floating_point or not dtype.is_floating_point:
        return
    target_max = _finite_max(dtype)
    if tensor.dtype == dtype or _finite_max(tensor.dtype) <= target_max:  # a finite value stays finite
        if not finite_checked and tensor.numel() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{name} contains NaN or infinite values")
        return
    if tensor.numel() == 0:
        return
    low_t, high_t = torch.aminmax(tensor.detach())  # NaN propagates into both; inf shows up as one of them
    low, high = float(low_t), float(high_t)
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"{name} contains NaN or infinite values")
    if high > target_max or low < -target_max:
        raise ValueError(
            f"{name} has values in [{low:.3g}, {high:.3g}], outside the finite range of {dtype} "
            f"(+-{target_max:.3g}) it is cast to"
        )


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


def _deserialize_codebook(serialized: runtime_pb2.Tensor, shape: torch.Size) -> torch.Tensor:
    """hivemind's QUANTILE_8BIT/UNIFORM_8BIT decoding (`codebook[indices]`) on a checked buffer; done here because
    hivemind 1.1.12's own `Quantization.extract` fails under numpy 2 (`int()` of a 1-element array)."""
    buffer = serialized.buffer
    codebook_size = _int64_at(buffer, 0)
    codebook = np.frombuffer(buffer, dtype=np.float32, count=codebook_size, offset=8)
    indices = np.frombuffer(buffer, dtype=np.uint8, offset=8 + 4 * codebook_size)
    if indices.size and int(indices.max()) >= codebook_size:
        raise ValueError(f"tensor has codebook index {int(indices.max())}, codebook has {codebook_size} entries")
    dtype = _DTYPES[serialized.dtype]
    table = torch.from_numpy(codebook.copy()).to(dtype)
    tensor = table[torch.from_numpy(indices.astype(np.int64))].reshape(shape)
    return tensor.requires_grad_(serialized.requires_grad)


def plain_record(
    serialized: runtime_pb2.Tensor, limits: TensorLimits = DEFAULT_TENSOR_LIMITS
) -> tuple[torch.dtype, tuple[int, ...], bytes] | None:
    """(dtype, shape, buffer) of a record that `deserialize_tensor` decodes through its per-step case (NONE
    compression, a whitelisted dtype, no grad, buffer exactly numel * itemsize, every bound of `limits` held),
    without decoding it; None for anything else (which the general path decodes or refuses with its precise error).
    The buffer is the record's raw values in native byte order."""
    if serialized.compression != _NONE or serialized.requires_grad:
        return None
    typed = _DTYPE_ITEMSIZES.get(serialized.dtype)
    if typed is None:
        return None
    dtype, itemsize = typed
    shape = tuple(serialized.size[:])  # (its slice is one C copy; iterating the repeated field costs 0.5 us more)
    if len(shape) > limits.max_ndim or (shape and min(shape) < 0):
        return None
    numel = math.prod(shape)
    if numel > limits.max_elements or numel * itemsize > limits.max_decoded_bytes:
        return None
    buffer = serialized.buffer  # (a copy per access: read once)
    if len(buffer) != numel * itemsize:
        return None  # includes the legacy fp32-coded bf16 form
    return dtype, shape, buffer


def _deserialize_plain(serialized: runtime_pb2.Tensor, limits: TensorLimits) -> torch.Tensor | None:
    """The per-step case (`plain_record`) decoded with the fewest Python steps; None for anything else."""
    record = plain_record(serialized, limits)
    if record is None:
        return None
    dtype, shape, buffer = record
    if not buffer:  # no elements (every itemsize is >= 1)
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(buffer), dtype=dtype).view(shape)  # [*shape], writable, its own memory


def is_plain_empty(serialized: runtime_pb2.Tensor, limits: TensorLimits = DEFAULT_TENSOR_LIMITS) -> bool:
    """True if `deserialize_tensor` would decode this record as an empty tensor through its per-step case (NONE,
    a whitelisted dtype, no grad, a shape within `limits` with a zero dimension, no buffer bytes): a Petals step's
    dummy prompts and hypo_ids, which a caller that treats every empty tensor as absent need not build."""
    if serialized.compression != _NONE or serialized.requires_grad or serialized.buffer:
        return False
    if serialized.dtype not in _DTYPES:
        return False
    shape = serialized.size
    if len(shape) > limits.max_ndim:
        return False
    return 0 in shape and min(shape) >= 0


def deserialize_tensor(serialized: runtime_pb2.Tensor, limits: TensorLimits = DEFAULT_TENSOR_LIMITS) -> torch.Tensor:
    """Restores a tensor; malformed input (dtype outside the compression's whitelist, shape over `limits`, buffer
    not exactly the codec's layout, corrupt payload) -> ValueError, raised before the payload is decoded."""
    plain = _deserialize_plain(serialized, limits)
    if plain is not None:
        return plain
    shape = _check_header(serialized, limits)
    if serialized.compression == CompressionType.NONE:
        return _deserialize_raw(serialized, shape)
    if serialized.compression in (CompressionType.QUANTILE_8BIT, CompressionType.UNIFORM_8BIT):
        return _deserialize_codebook(serialized, shape)
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


def stream_messages(
    message_type: type[_Message], tensors: Iterable[runtime_pb2.Tensor], chunk_bytes: int = STREAM_CHUNK_BYTES,
    **fields: Any,
) -> list[_Message]:  # fmt: skip
    """One `message_type` (an ExpertRequest or ExpertResponse, `fields` set on each) per stream part of each tensor:
    the messages `message_type(**fields, tensors=[part])` over `split_for_streaming`'s parts make, byte for byte, built
    in place: upb copies a 4 MiB part given to a message's constructor at ~20 ms, adding it to the field at ~1 ms."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    messages = []
    for tensor in tensors:
        buffer = tensor.buffer  # a copy of the field's bytes: read once
        num_chunks = len(range(0, len(buffer), chunk_bytes))
        if num_chunks <= 1:
            message = message_type(**fields)
            part = message.tensors.add()
            part.CopyFrom(tensor)
            part.chunks = num_chunks
            messages.append(message)
            continue
        view = memoryview(buffer)
        for start in range(0, len(view), chunk_bytes):
            message = message_type(**fields)
            part = message.tensors.add()
            if start == 0:  # the header, as hivemind's first part carries it
                part.compression, part.dtype, part.requires_grad = (
                    tensor.compression,
                    tensor.dtype,
                    tensor.requires_grad,
                )
                part.size.extend(tensor.size)
                part.chunks = num_chunks
            part.buffer = view[start : start + chunk_bytes].tobytes()
            messages.append(message)
    return messages


def combine_parts(
    parts: Iterable[runtime_pb2.Tensor], limits: TensorLimits = DEFAULT_TENSOR_LIMITS
) -> list[runtime_pb2.Tensor]:
    """Groups stream parts back into whole serialized tensors (a part with a dtype starts a new tensor). Each
    tensor's header is checked on its first part, and its parts may not add up to more than its shape allows."""
    tensors: list[runtime_pb2.Tensor] = []
    current: list[runtime_pb2.Tensor] = []
    budget = 0
    for part in parts:
        if part.dtype and current:
            tensors.append(_combined(current))
            current = []
        if not current:
            if not part.dtype:
                raise ValueError("stream part without a header (dtype) where a new tensor should start")
            budget = _max_buffer_bytes(part, limits)
        budget -= len(part.buffer)
        if budget < 0:
            raise ValueError(f"stream parts of tensor {part.dtype or current[0].dtype} exceed its declared shape")
        current.append(part)
    if current:
        tensors.append(_combined(current))
    return tensors


def _combined(parts: list[runtime_pb2.Tensor]) -> runtime_pb2.Tensor:
    """One tensor's parts as one record; a lone part is that record already (hivemind's combining copies its buffer
    three times: ~20 ms for 4 MiB)."""
    return parts[0] if len(parts) == 1 else combine_from_streaming(parts)


def needs_streaming(tensors: Iterable[torch.Tensor]) -> bool:
    """True if these tensors should travel through a `*_stream` handler rather than a unary call."""
    return sum(t.numel() * t.element_size() for t in tensors) > STREAM_THRESHOLD_BYTES
