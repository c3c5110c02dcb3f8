"""The frames of the channel between a handler process and the device process (`--num_handlers` > 1): a 9-byte header
(payload length u32, kind u8, request id u32; big endian) and the payload, tensors as raw bytes behind a dtype/shape
record, every size bounded before it is read (a bug on one side fails a request, not the memory). Everything but a
step crosses as a CALL (answered by REPLY_VALUE or REPLY_ERROR) or a one-way NOTE: a name and tagged values
(`named` / `read_named`); steps and their replies cross in batches (STEP_BATCH, REPLY_BATCH). This codec knows no
server type: `server.handlers` gives the frames their meaning."""

from __future__ import annotations

import asyncio
import json
import math
import struct
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from corolla.utils.tensor_bytes import HiddenRows, TensorBytes, as_tensor, view_bytes

# handler -> device: a call of the core (a reply comes back: REPLY_VALUE or REPLY_ERROR), a step, a frame of steps
CALL, STEP, STEP_BATCH = 1, 3, 11
# either way, nothing waits for it: a named note (`Writer.note`), e.g. a push routed, a session evicted, a refusal
NOTE = 2
# device -> handler
HELLO, STATE, REPLY_VALUE, REPLY_TENSORS, REPLY_ERROR, REPLY_BATCH = 20, 21, 22, 23, 25, 28
FRAME_KINDS = frozenset(
    (CALL, NOTE, STEP, STEP_BATCH, HELLO, STATE, REPLY_VALUE, REPLY_TENSORS, REPLY_ERROR, REPLY_BATCH)
)
BATCH_ITEM_KINDS = {STEP_BATCH: frozenset((STEP,)), REPLY_BATCH: frozenset((REPLY_TENSORS, REPLY_ERROR))}
MAX_BATCH_ITEMS = 4096

HEADER = struct.Struct(">IBI")
HEADER_BYTES = HEADER.size  # 9
MAX_TENSOR_DIMS = 8
MAX_STR_BYTES = 65535
NO_TENSOR = 255
# a value's tag (`Writer.value`): what a call, a note or a call's reply carries
V_NONE, V_FALSE, V_TRUE, V_INT, V_FLOAT, V_TEXT, V_BLOB, V_TENSOR, V_SEQ = range(9)
MAX_VALUE_DEPTH = 4  # sequences inside sequences
T = TypeVar("T")

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.uint8, torch.bool, torch.int8,
)  # fmt: skip
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_ITEM_BYTES = tuple(dtype.itemsize for dtype in _DTYPES)
_U8, _U32, _U64, _F64 = struct.Struct(">B"), struct.Struct(">I"), struct.Struct(">Q"), struct.Struct(">d")
_U16 = struct.Struct(">H")
_TAGGED_INT, _TAGGED_FLOAT = struct.Struct(">Bq"), struct.Struct(">Bd")
_ITEM = struct.Struct(">BII")  # kind, request id, payload length
_STEP_HEAD = struct.Struct(">IIBH")  # a STEP's handle, prefix length, lone session, adapter length (then its utf-8)
_TENSOR_HEADS = tuple(struct.Struct(f">BB{ndim}I") for ndim in range(MAX_TENSOR_DIMS + 1))  # dtype code, ndim, dims
# a usual step item's fields up to its hidden states' data: handle, prefix length, lone, adapter name length (0),
# dtype code, ndim (3), dims
_USUAL = struct.Struct(">IIBHBB3I")
_SHAPES = tuple(struct.Struct(f">{ndim}I") for ndim in range(MAX_TENSOR_DIMS + 1))  # a record's dims
_REPLY_RECORDS_KEPT = 256  # distinct (dtype, shape) reply record headers cached


@dataclass(frozen=True)
class DeviceInfo:
    """What the device process tells a handler process once (the HELLO frame)."""

    path: str
    max_frame_bytes: int
    block_bytes_per_token: dict[int, int]  # KV bytes of one token of one sequence, per block
    # KV hand-off: each block's canonical tensors for one sequence of one token ([1, heads, 1, dim] shape, dtype name),
    # the same for every block; empty where the executor can't hand off (`handoff_refused` says why)
    handoff_shapes: tuple[tuple[tuple[int, ...], str], ...] = ()
    handoff_refused: str = ""

    def to_json(self) -> bytes:
        fields = dict(self.__dict__, block_bytes_per_token={str(k): v for k, v in self.block_bytes_per_token.items()})
        return json.dumps(fields).encode()

    @classmethod
    def from_json(cls, data: bytes) -> DeviceInfo:
        fields = json.loads(data)
        table = {int(k): int(v) for k, v in dict(fields.pop("block_bytes_per_token")).items()}
        shapes = tuple((tuple(int(n) for n in shape), str(dtype)) for shape, dtype in fields.pop("handoff_shapes", ()))
        return cls(block_bytes_per_token=table, handoff_shapes=shapes, **fields)

    def cache_bytes_per_token(self, block_indices: tuple[int, ...]) -> int:
        return sum(self.block_bytes_per_token[i] for i in block_indices)


class ChannelClosed(ConnectionError):
    """The other end of the handler <-> device channel is gone."""


class FrameError(ValueError):
    """A frame or field that breaks the channel's format or bounds."""


class Writer:
    """Builds one payload."""

    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []

    def u8(self, value: int) -> Writer:
        self.parts.append(_U8.pack(value))
        return self

    def u32(self, value: int) -> Writer:
        self.parts.append(_U32.pack(value))
        return self

    def u64(self, value: int) -> Writer:
        self.parts.append(_U64.pack(value))
        return self

    def f64(self, value: float | None) -> Writer:
        self.parts.append(_F64.pack(math.nan if value is None else value))
        return self

    def text(self, value: str | None) -> Writer:
        data = _utf8(value or "")
        self.parts.append(_U16.pack(len(data)) + data)
        return self

    def step_head(self, handle: int, prefix_length: int, lone_session: bool, adapter: str) -> Writer:
        """A STEP's leading fields in one pack: `u32(handle).u32(prefix_length).u8(lone_session).text(adapter)`,
        the same bytes (the per-step path)."""
        data = _utf8(adapter)
        self.parts.append(_STEP_HEAD.pack(handle, prefix_length, lone_session, len(data)) + data)
        return self

    def blob(self, value: bytes) -> Writer:
        self.parts.append(_U32.pack(len(value)))
        self.parts.append(value)
        return self

    def value(self, value: object) -> Writer:
        """One tagged value: None, a bool, an int (64 bits), a float, a str, bytes, a tensor, or a tuple or list of
        values (read back as a tuple); FrameError for anything else."""
        if value is None or isinstance(value, bool):
            self.parts.append(_U8.pack(V_NONE if value is None else V_TRUE if value else V_FALSE))
        elif isinstance(value, int):
            self.parts.append(_TAGGED_INT.pack(V_INT, value))
        elif isinstance(value, float):
            self.parts.append(_TAGGED_FLOAT.pack(V_FLOAT, value))
        elif isinstance(value, str):
            self.u8(V_TEXT).text(value)
        elif isinstance(value, bytes):
            self.u8(V_BLOB).blob(value)
        elif isinstance(value, torch.Tensor):
            self.u8(V_TENSOR).tensor(value)
        elif isinstance(value, (tuple, list)) and len(value) <= 0xFFFF:
            self.parts.append(_U8.pack(V_SEQ) + _U16.pack(len(value)))
            for item in value:
                self.value(item)
        else:
            raise FrameError(f"can't send a value of type {type(value).__name__}")
        return self

    def tensor(self, tensor: torch.Tensor | None) -> Writer:
        if tensor is None:
            self.parts.append(_U8.pack(NO_TENSOR))
            return self
        if tensor.dtype not in _DTYPE_CODES or tensor.dim() > MAX_TENSOR_DIMS:
            raise FrameError(f"can't send a {tensor.dtype} tensor of {tensor.dim()} dims")
        if tensor.requires_grad or not tensor.is_cpu or not tensor.is_contiguous():
            tensor = tensor.detach().cpu().contiguous()  # [any shape]
        return self.record(tensor.dtype, tuple(tensor.shape), _raw(tensor.dtype, tensor) if tensor.numel() else b"")

    def record(self, dtype: torch.dtype, shape: tuple[int, ...], data: bytes | memoryview) -> Writer:
        """`tensor(t)`'s bytes for a CPU tensor `t` of `dtype` and `shape` that holds `data` (its values in C order,
        flat), from the bytes (no tensor)."""
        code = _DTYPE_CODES.get(dtype)
        if code is None or len(shape) > MAX_TENSOR_DIMS:
            raise FrameError(f"can't send a {dtype} tensor of {len(shape)} dims")
        if len(data) != math.prod(shape) * _ITEM_BYTES[code]:
            raise FrameError(f"{len(data)} bytes can't hold a {dtype} tensor of shape {list(shape)}")
        self.parts.append(_TENSOR_HEADS[len(shape)].pack(code, len(shape), *shape))
        if len(data):
            self.parts.append(data)
        return self

    def frame(self, kind: int, request_id: int) -> bytes:
        payload = b"".join(self.parts)
        return HEADER.pack(len(payload), kind, request_id) + payload

    def nbytes(self) -> int:
        return sum(len(part) for part in self.parts)


def batch_frames(
    items: list[tuple[int, int, Writer]], batch_kind: int, max_frame_bytes: int, head: Writer | None = None
) -> list[bytes]:
    """Frames for `items` (kind, request id, body): one item alone is its own frame (with `head` before its body);
    several go into `batch_kind` frames, each within `max_frame_bytes` and `MAX_BATCH_ITEMS` (an item too large to
    share a frame goes alone). `head`: the device's state, once per frame."""
    encoded = [(kind, request_id, body.parts, body.nbytes()) for kind, request_id, body in items]
    return _frames(encoded, b"".join(head.parts) if head is not None else b"", max_frame_bytes, batch_kind)


def split_batch(reader: Reader, batch_kind: int) -> list[tuple[int, int, memoryview]]:
    """The (kind, request id, payload view) items of a batch frame's payload, from `reader`'s position; every
    count and length is checked against the frame before anything is sliced (`_batch_items`)."""
    items = _batch_items(reader.data, reader.offset, batch_kind)
    reader.offset = len(reader.data)
    return [(kind, request_id, reader.data[start : start + length]) for kind, request_id, start, length in items]


def _batch_items(payload: memoryview, offset: int, batch_kind: int) -> list[tuple[int, int, int, int]]:
    """(kind, request id, start, length) of each item of the batch at `offset`: its count, every item's kind and
    length and the payload's end checked before anything is sliced."""
    allowed, size = BATCH_ITEM_KINDS[batch_kind], len(payload)
    if offset + _U16.size > size:
        raise FrameError(f"field of {_U16.size} bytes runs past the payload ({size - offset} left)")
    (count,) = _U16.unpack_from(payload, offset)
    if not 0 < count <= MAX_BATCH_ITEMS:
        raise FrameError(f"a batch holds 1 to {MAX_BATCH_ITEMS} items, got {count}")
    items = []
    offset += _U16.size
    for _ in range(count):
        if offset + _ITEM.size > size:
            raise FrameError(f"field of {_ITEM.size} bytes runs past the payload ({size - offset} left)")
        kind, request_id, length = _ITEM.unpack_from(payload, offset)
        if kind not in allowed:
            raise FrameError(f"frame kind {kind} can't be an item of batch kind {batch_kind}")
        start = offset + _ITEM.size
        offset = start + length
        if offset > size:
            raise FrameError(f"field of {length} bytes runs past the payload ({size - start} left)")
        items.append((kind, request_id, start, length))
    if offset != size:
        raise FrameError(f"{size - offset} unexpected trailing bytes in the payload")
    return items


def _utf8(value: str) -> bytes:
    data = value.encode()
    if len(data) > MAX_STR_BYTES:
        raise FrameError(f"string of {len(data)} bytes exceeds {MAX_STR_BYTES}")
    return data


class Reader:
    """Reads the fields of one payload in order, each bounded by what is left of it."""

    def __init__(self, payload: bytes | memoryview):
        self.data = memoryview(payload)
        self.offset = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.offset + n > len(self.data):
            raise FrameError(f"field of {n} bytes runs past the payload ({len(self.data) - self.offset} left)")
        chunk = self.data[self.offset : self.offset + n]
        self.offset += n
        return chunk

    def u8(self) -> int:
        return int(_U8.unpack(self.take(1))[0])

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack(self.take(8))[0])

    def f64(self) -> float | None:
        value = float(_F64.unpack(self.take(8))[0])
        return None if math.isnan(value) else value

    def text(self) -> str:
        (length,) = _U16.unpack(self.take(2))
        return bytes(self.take(length)).decode()

    def blob(self) -> bytes:
        return bytes(self.take(self.u32()))

    def value(self, depth: int = 0) -> object:
        """The next tagged value (`Writer.value`), every length bounded by the payload, sequences at most
        `MAX_VALUE_DEPTH` deep."""
        tag = self.u8()
        if tag in (V_NONE, V_FALSE, V_TRUE):
            return None if tag == V_NONE else tag == V_TRUE
        if tag == V_INT:
            return int(struct.unpack(">q", self.take(8))[0])
        if tag == V_FLOAT:
            return float(_F64.unpack(self.take(8))[0])
        if tag == V_TEXT:
            return self.text()
        if tag == V_BLOB:
            return self.blob()
        if tag == V_TENSOR:
            return self.tensor()
        if tag != V_SEQ:
            raise FrameError(f"unknown value tag {tag}")
        if depth >= MAX_VALUE_DEPTH:
            raise FrameError(f"values nested deeper than {MAX_VALUE_DEPTH}")
        (count,) = _U16.unpack(self.take(2))
        if count > len(self.data) - self.offset:  # every item takes a byte at least
            raise FrameError(f"a sequence of {count} values runs past the payload")
        return tuple(self.value(depth + 1) for _ in range(count))

    def tensor(self) -> torch.Tensor | None:
        """The next tensor record as a tensor of its own (a writable copy of the bytes), None for no tensor."""
        record = self.record()
        if record is None:
            return None
        dtype, shape, raw = record
        return view_bytes(memoryview(bytearray(raw)), dtype, shape)

    def record(self) -> tuple[torch.dtype, tuple[int, ...], memoryview] | None:
        """The next tensor record as (dtype, shape, its bytes: a view of the payload, no copy), None for no tensor;
        every length bounded by the payload before anything is allocated."""
        found, end = _record(self.data, self.offset)
        self.offset = end
        if found is None:
            return None
        code, shape, start = found
        return _DTYPES[code], shape, self.data[start:end]

    def done(self) -> None:
        if self.offset != len(self.data):
            raise FrameError(f"{len(self.data) - self.offset} trailing bytes in a frame")


def named(name: str, args: tuple[object, ...]) -> Writer:
    """A CALL's or a NOTE's body: its name and its arguments."""
    return Writer().text(name).value(args)


def read_named(payload: bytes | memoryview) -> tuple[str, tuple[object, ...]]:
    """(name, arguments) of a CALL's or a NOTE's body (FrameError if malformed)."""
    reader = Reader(payload)
    name, args = reader.text(), reader.value()
    reader.done()
    if not isinstance(args, tuple):
        raise FrameError(f"the arguments of {name!r:.40} are no sequence")
    return name, args


def matches(value: object, kind: Any) -> bool:
    """Whether `value`, as `Reader.value` gives it, is of `kind`: a class (an int is a float too, a bool no int),
    `A | None`, `tuple[A, B]` or `tuple[A, ...]`."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(matches(item, args[0]) for item in value)
        return len(value) == len(args) and all(matches(item, a) for item, a in zip(value, args, strict=True))
    if origin is typing.Union or origin is types.UnionType:
        return any(matches(value, a) for a in args)
    if kind is None or kind is type(None):
        return value is None
    if kind is float or kind is int:
        return isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    return isinstance(value, kind)


def dispatch(table: Mapping[str, tuple[Any, Callable[..., T]]], name: str, args: tuple[object, ...]) -> T:
    """Runs the function `table` names `name` on `args`, once they are of its declared type (`matches`); FrameError
    for a name the table lacks or arguments of other types."""
    entry = table.get(name)
    if entry is None or not matches(args, entry[0]):
        raise FrameError(f"no call {name!r:.40} takes these arguments")
    return entry[1](*args)


def check_header(length: int, kind: int, max_frame_bytes: int) -> None:
    """FrameError for an unknown frame kind or a payload over `max_frame_bytes` (before anything is read for it)."""
    if kind not in FRAME_KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    if length > max_frame_bytes:
        raise FrameError(f"frame of {length} bytes exceeds max_frame_bytes={max_frame_bytes}")


async def read_frame(reader: asyncio.StreamReader, max_frame_bytes: int) -> tuple[int, int, bytes]:
    """(kind, request id, payload) of the next frame; ChannelClosed at EOF, FrameError past the bounds."""
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise ChannelClosed("handler channel closed") from e
    length, kind, request_id = HEADER.unpack(header)
    check_header(length, kind, max_frame_bytes)
    try:
        payload = await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise ChannelClosed("handler channel closed mid-frame") from e
    return kind, request_id, payload


# ---- the device side's hot paths: a STEP_BATCH in one pass, a merged forward's replies in one join per frame


@dataclass(eq=False, slots=True)
class ParsedStep:
    """One STEP item of a STEP_BATCH: its fields and its hidden states' bytes (a slice of the frame's one copy), with
    their dtype and shape; `hidden` builds a tensor viewing them on first use (a launched forward stages the bytes
    and never needs one: no torch call per step in the reader thread)."""

    request_id: int
    handle: int
    prefix_length: int
    lone: bool
    adapter: str
    prompts: torch.Tensor | None
    hypo_ids: torch.Tensor | None
    raw: memoryview | None = None  # the hidden states' bytes, flat (None: the item had no hidden states)
    dtype: torch.dtype | None = None  # the hidden states' dtype and shape (None: the item had no hidden states)
    shape: tuple[int, ...] | None = None
    rows: tuple[HiddenRows, int] | None = None  # `raw` as a row of the frame's steps of this dtype and shape, if two+
    _tensor: torch.Tensor | None = None

    @property
    def hidden(self) -> torch.Tensor | None:
        """The hidden states [B, T, H] (a writable view of `raw`, built once), or None if the item had none."""
        if self._tensor is None and self.raw is not None and self.dtype is not None and self.shape is not None:
            self._tensor = view_bytes(self.raw, self.dtype, self.shape)
        return self._tensor


@dataclass(frozen=True, slots=True)
class BadStep:
    """A STEP item whose fields break the format: refused, failing only its caller."""

    request_id: int
    error: FrameError


def parse_steps(payload: memoryview) -> list[ParsedStep | BadStep]:
    """The steps of a STEP_BATCH payload, in order; an item whose fields break the format is a `BadStep` in its
    place. A malformed batch (count, item kinds or lengths, trailing bytes) raises FrameError, as
    `split_batch` does: every item's header and length is checked before any item is read.

    The usual item (no adapter name, hidden states of 3 dims, neither prompts nor beam ids) is read with one
    `unpack_from` at its offset in the payload, its length checked to be exactly those fields; any other goes
    through the general reader (`_parse_item`)."""
    out: list[ParsedStep | BadStep] = []
    groups: dict[tuple[int, tuple[int, ...]], list[tuple[int, memoryview, int]]] = {}  # (code, shape) -> hiddens
    usual, codes, item_bytes, no_tensor = _USUAL, len(_DTYPES), _ITEM_BYTES, NO_TENSOR
    for _, request_id, start, length in _batch_items(payload, 0, STEP_BATCH):
        if length >= usual.size:  # the usual step: [handle, prefix, lone, name length 0, code, 3, dims x 3]
            handle, prefix_length, lone, name_bytes, code, ndim, d0, d1, d2 = usual.unpack_from(payload, start)
            if name_bytes == 0 and ndim == 3 and code < codes:
                data = start + usual.size
                end = data + item_bytes[code] * d0 * d1 * d2
                if end + 2 == start + length and payload[end] == no_tensor and payload[end + 1] == no_tensor:
                    groups.setdefault((code, (d0, d1, d2)), []).append((len(out), payload, data))
                    out.append(ParsedStep(request_id, handle, prefix_length, bool(lone), "", None, None))
                    continue
        try:  # anything else (or a usual-looking item whose lengths disagree): field by field, bounded
            step, hidden_at = _parse_item(request_id, payload[start : start + length])
        except FrameError as e:
            out.append(BadStep(request_id, e))
            continue
        if hidden_at is not None:
            code, shape, at = hidden_at
            groups.setdefault((code, shape), []).append((len(out), payload[start : start + length], at))
        out.append(step)
    for (code, shape), members in groups.items():
        dtype = _DTYPES[code]
        copy, views = _copy_group(code, shape, members)
        rows = HiddenRows(copy, dtype, shape, len(members)) if len(members) > 1 else None
        for k, ((index, _, _), raw) in enumerate(zip(members, views, strict=True)):
            parsed = out[index]
            assert isinstance(parsed, ParsedStep)
            parsed.raw, parsed.dtype, parsed.shape = raw, dtype, shape
            if rows is not None:
                parsed.rows = (rows, k)
    return out


def parse_step(request_id: int, payload: memoryview) -> ParsedStep:
    """A lone STEP frame's step (FrameError if its fields break the format)."""
    step, hidden_at = _parse_item(request_id, payload)
    if hidden_at is not None:
        code, shape, offset = hidden_at
        step.raw, step.dtype, step.shape = _copy_group(code, shape, [(0, payload, offset)])[1][0], _DTYPES[code], shape
    return step


def _parse_item(request_id: int, item: memoryview) -> tuple[ParsedStep, tuple[int, tuple[int, ...], int] | None]:
    """A step's fields; the hidden states' (dtype code, shape, byte offset in `item`) to copy later."""
    size = len(item)
    if size < _STEP_HEAD.size:
        raise FrameError(f"a step item of {size} bytes is shorter than its fixed fields")
    handle, prefix_length, lone, name_bytes = _STEP_HEAD.unpack_from(item, 0)
    offset = _STEP_HEAD.size + name_bytes
    if offset > size:
        raise FrameError(f"adapter name of {name_bytes} bytes runs past the step item")
    adapter = bytes(item[_STEP_HEAD.size : offset]).decode() if name_bytes else ""
    hidden_at, offset = _record(item, offset)
    if offset == size - 2 and item[offset] == NO_TENSOR and item[offset + 1] == NO_TENSOR:
        prompts = hypo_ids = None  # the usual step: neither deep prompts nor beam ids
    else:
        fields = Reader(item)
        fields.offset = offset
        prompts, hypo_ids = fields.tensor(), fields.tensor()
        fields.done()
    return ParsedStep(request_id, handle, prefix_length, bool(lone), adapter, prompts, hypo_ids), hidden_at


def _record(item: memoryview, offset: int) -> tuple[tuple[int, tuple[int, ...], int] | None, int]:
    """The tensor record at `offset`: ((code, shape, data offset) or None for no tensor, the offset after it); every
    length bounded by `item` before anything is allocated."""
    if offset + 1 > len(item):
        raise FrameError("a tensor record runs past the payload")
    code = item[offset]
    if code == NO_TENSOR:
        return None, offset + 1
    if code >= len(_DTYPES):
        raise FrameError(f"unknown dtype code {code}")
    if offset + 2 > len(item):
        raise FrameError("a tensor record runs past the payload")
    ndim = item[offset + 1]
    if ndim > MAX_TENSOR_DIMS:
        raise FrameError(f"tensor of {ndim} dims exceeds {MAX_TENSOR_DIMS}")
    start = offset + 2 + 4 * ndim
    if start > len(item):
        raise FrameError("a tensor record's shape runs past the payload")
    shape = _SHAPES[ndim].unpack_from(item, offset + 2)
    nbytes = _ITEM_BYTES[code]
    for dim in shape:
        nbytes *= dim
    if start + nbytes > len(item):  # bounded by the item before anything is allocated
        raise FrameError(f"field of {nbytes} bytes runs past the payload ({len(item) - start} left)")
    return (code, shape, start), start + nbytes


def _copy_group(
    code: int, shape: tuple[int, ...], members: list[tuple[int, memoryview, int]]
) -> tuple[memoryview, list[memoryview]]:
    """One writable copy of the group's hidden states (bounds checked by `_record`), [n, *shape], flat, and each
    one's bytes in it (flat memoryviews, empty for zero elements): no torch call."""
    nbytes = _ITEM_BYTES[code]
    for dim in shape:
        nbytes *= dim
    if len(members) == 1:  # a lone step (most frames under light load): its own copy
        _, item, offset = members[0]
        data = memoryview(bytearray(item[offset : offset + nbytes]))
        return data, [data]
    data = memoryview(bytearray().join([item[offset : offset + nbytes] for _, item, offset in members]))  # one copy
    return data, [data[i * nbytes : (i + 1) * nbytes] for i in range(len(members))]


def reply_frames(
    results: list[tuple[int, torch.Tensor | TensorBytes | BaseException, memoryview | None]],
    head: bytes,
    max_frame_bytes: int,
    encode_error: Callable[[BaseException], Writer],
) -> list[bytes]:
    """What `batch_frames` makes of these step results (REPLY_TENSORS for a tensor [B, T, H], REPLY_ERROR
    for a refusal, its body written by `encode_error`: the refusals are the server's), with `head` (the device's
    state) once per frame. A tensor's bytes, where given (C order, flat:
    what the tensor views, e.g. `StepRequest.output_bytes`), are sent as they are (no torch call for that reply)."""
    encoded: list[tuple[int, int, list[bytes | memoryview], int]] = []  # kind, request id, body parts, body bytes
    groups: dict[tuple[torch.dtype, tuple[int, ...]], list[tuple[int, torch.Tensor]]] = {}
    last: tuple[torch.dtype | None, tuple[int, ...]] = (None, ())  # a merged forward's replies share one record
    prefix, nbytes = b"", 0
    for request_id, result, raw in results:
        if isinstance(result, BaseException):
            body = encode_error(result)
            encoded.append((REPLY_ERROR, request_id, body.parts, body.nbytes()))
            continue
        dims: tuple[int, ...] = result.shape  # a torch.Size: a tuple, no copy
        dtype = result.dtype
        if result.is_cpu and dtype in _DTYPE_CODES and 0 < len(dims) <= MAX_TENSOR_DIMS:
            if raw is not None:
                if last[0] is not dtype or last[1] != dims:
                    last, (prefix, nbytes) = (dtype, dims), _reply_record(dtype, dims)
                if raw.nbytes == nbytes:
                    encoded.append((REPLY_TENSORS, request_id, [prefix, raw], len(prefix) + nbytes))
                    continue
            groups.setdefault((dtype, dims), []).append((len(encoded), as_tensor(result)))
        else:  # elsewhere than the CPU, or a dtype the channel can't carry (the writer raises FrameError for it)
            body = Writer().u8(1).tensor(as_tensor(result))
            encoded.append((REPLY_TENSORS, request_id, body.parts, body.nbytes()))
            continue
        encoded.append((REPLY_TENSORS, request_id, [], 0))  # its body is filled in below, with its group's
    for (dtype, shape), members in groups.items():
        prefix, nbytes = _reply_record(dtype, shape)
        data = _group_bytes(dtype, [t for _, t in members], nbytes) if nbytes else None
        for i, (index, _) in enumerate(members):
            kind, request_id, _, _ = encoded[index]
            parts: list[bytes | memoryview] = [prefix] if data is None else [prefix, data[i]]
            encoded[index] = (kind, request_id, parts, len(prefix) + nbytes)
    return _frames(encoded, head, max_frame_bytes, REPLY_BATCH)


def _frames(
    encoded: list[tuple[int, int, list[bytes | memoryview], int]], head: bytes, max_frame_bytes: int, batch_kind: int
) -> list[bytes]:
    """The frames of `encoded` items (kind, request id, body parts, body bytes), in order: as many per `batch_kind`
    frame as fit `max_frame_bytes` and `MAX_BATCH_ITEMS` (an item too large to share a frame goes alone), `head` once
    per frame."""
    frames: list[bytes] = []
    group_start, size = 0, len(head) + _U16.size
    for i, (_, _, _, body_bytes) in enumerate(encoded):
        item_bytes = _ITEM.size + body_bytes
        if i > group_start and (size + item_bytes > max_frame_bytes or i - group_start >= MAX_BATCH_ITEMS):
            frames.append(_frame(encoded[group_start:i], head, batch_kind))
            group_start, size = i, len(head) + _U16.size
        size += item_bytes
    if group_start < len(encoded):
        frames.append(_frame(encoded[group_start:], head, batch_kind))
    return frames


def _frame(group: list[tuple[int, int, list[bytes | memoryview], int]], head: bytes, batch_kind: int) -> bytes:
    if len(group) == 1:  # alone: its own frame, the state before its body
        kind, request_id, parts, body_bytes = group[0]
        return b"".join([HEADER.pack(len(head) + body_bytes, kind, request_id), head, *parts])
    joined: list[bytes | memoryview] = [b"", head, _U16.pack(len(group))]
    total = len(head) + _U16.size
    for kind, request_id, parts, body_bytes in group:
        joined.append(_ITEM.pack(kind, request_id, body_bytes))
        joined.extend(parts)
        total += _ITEM.size + body_bytes
    joined[0] = HEADER.pack(total, batch_kind, 0)
    return b"".join(joined)


_reply_records: dict[tuple[torch.dtype, tuple[int, ...]], tuple[bytes, int]] = {}


def _reply_record(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, int]:
    """A REPLY_TENSORS body's bytes before the data (`Writer().u8(1).tensor(t)`'s) and the data's byte count."""
    key = (dtype, shape)
    record = _reply_records.get(key)
    if record is None:
        code = _DTYPE_CODES[dtype]
        prefix = b"\x01" + _TENSOR_HEADS[len(shape)].pack(code, len(shape), *shape)
        record = (prefix, math.prod(shape) * _ITEM_BYTES[code])
        if len(_reply_records) >= _REPLY_RECORDS_KEPT:
            _reply_records.clear()
        _reply_records[key] = record
    return record


def _group_bytes(dtype: torch.dtype, tensors: list[torch.Tensor], nbytes: int) -> list[memoryview]:
    """The raw bytes (`nbytes` each) of equal-shape CPU tensors. Tensors that lie one after another in one storage
    (a merged forward's outputs are views of one buffer, split per request) are read in place, one view per such
    run; the others are copied together by one cat."""
    out: list[memoryview | None] = [None] * len(tensors)
    loose: list[int] = []  # not in a run: copied
    numel = nbytes // _ITEM_BYTES[_DTYPE_CODES[dtype]]
    start = 0
    while start < len(tensors):
        first = tensors[start]
        end = start + 1
        contiguous = first.is_contiguous()
        if contiguous:
            ptr, storage = first.data_ptr(), first.untyped_storage()
            # a run never reads past the first tensor's storage: what lies inside it, at the next tensor's address,
            # is that tensor's memory (live allocations don't overlap), so one storage check per run suffices
            limit = min(len(tensors), start + (storage.data_ptr() + storage.nbytes() - ptr) // nbytes)
            while (
                end < limit and tensors[end].data_ptr() == ptr + (end - start) * nbytes and tensors[end].is_contiguous()
            ):
                end += 1
        if contiguous:  # [n, numel] over the run's storage, no copy
            run = first.detach().as_strided((end - start, numel), (numel, 1), first.storage_offset())
            data = _raw(dtype, run)
            for k in range(start, end):
                out[k] = data[(k - start) * nbytes : (k - start + 1) * nbytes]
        else:
            loose.append(start)
        start = end
    if loose:
        with torch.no_grad():
            joined = torch.cat([tensors[k].reshape(1, numel) for k in loose])  # [n, numel]
        data = _raw(dtype, joined)
        for i, k in enumerate(loose):
            out[k] = data[i * nbytes : (i + 1) * nbytes]
    return out  # type: ignore[return-value]


def _raw(dtype: torch.dtype, tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, flat (bfloat16, which numpy lacks, as its 16-bit words)."""
    if dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy().data.cast("B")
