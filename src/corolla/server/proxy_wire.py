"""The channel between a handler process and the device process (`--num_handlers` > 1): compact frames over a
unix socketpair, tensors as raw bytes behind a dtype/shape record.

Frame: a 9-byte header (payload length: u32, kind: u8, request id: u32; big endian) and the payload. The reader
checks the length against the channel's `max_frame_bytes` before it reads (allocates) the payload, and every
tensor record's byte count against what is left of the payload before it copies. Both ends are processes of the
same server, but the sizes are still bounded: a bug on one side must fail a request, not exhaust memory.

Payload fields, in the order each message kind writes them (`Writer` / `Reader`): u8, u32, u64, f64, text (u16
length + utf-8), blob (u32 length), tensor (u8 dtype code, u8 ndim, u32 per dim, then the raw bytes; dtype code
255 = no tensor).

Batches: a handler process sends the steps that became ready in one loop iteration as one STEP_BATCH frame, and
the device answers the steps that one merged forward finished as one REPLY_BATCH frame per channel (one read, one
write and one wake-up per batch instead of per step). A batch payload is a u16 item count and, per item, the
item's kind (u8), request id (u32) and payload length (u32) then its payload; `split_batch` checks the count and
every item's length against what is left of the frame before it slices (views, no copies). A reply batch starts
with the device's state (three u64) once, its items carry none."""

from __future__ import annotations

import asyncio
import math
import struct

import torch

from corolla.server.executor import HandoffUnsupported
from corolla.server.limits import PeerLimitExceeded, ServerLimitExceeded, SessionEvicted
from corolla.server.refusals import BadRequest, Draining, Overloaded, RequestTimeout, TooLong
from corolla.server.runtime import RuntimeStopped
from corolla.utils.errors import AllocationFailed
from corolla.utils.tensor_bytes import view_bytes

# handler -> device
OPEN, CLOSE, STEP, FORWARD, BACKWARD, PUSH_IN, ROUTE_ADD, ROUTE_DEL, METRICS, READY = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10
STEP_BATCH = 11
# device -> handler
HELLO, STATE, REPLY_OPEN, REPLY_TENSORS, REPLY_CLOSED, REPLY_ERROR, EVICT, PUSH_OUT = 20, 21, 22, 23, 24, 25, 26, 27
REPLY_BATCH = 28
FRAME_KINDS = frozenset(
    (OPEN, CLOSE, STEP, FORWARD, BACKWARD, PUSH_IN, ROUTE_ADD, ROUTE_DEL, METRICS, READY, STEP_BATCH, HELLO, STATE)
    + (REPLY_OPEN, REPLY_TENSORS, REPLY_CLOSED, REPLY_ERROR, EVICT, PUSH_OUT, REPLY_BATCH)
)
BATCH_ITEM_KINDS = {STEP_BATCH: frozenset((STEP,)), REPLY_BATCH: frozenset((REPLY_TENSORS, REPLY_ERROR))}
MAX_BATCH_ITEMS = 4096

HEADER = struct.Struct(">IBI")
HEADER_BYTES = HEADER.size  # 9
MAX_TENSOR_DIMS = 8
MAX_STR_BYTES = 65535
NO_TENSOR = 255

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.uint8, torch.bool, torch.int8,
)  # fmt: skip
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_ITEM_BYTES = tuple(dtype.itemsize for dtype in _DTYPES)
# numpy has no bfloat16: its bytes leave through an int16 view (the other dtypes are numpy's own)
_NUMPY_VIEW = {torch.bfloat16: torch.int16}
_U8, _U32, _U64, _F64 = struct.Struct(">B"), struct.Struct(">I"), struct.Struct(">Q"), struct.Struct(">d")
_U16 = struct.Struct(">H")
_ITEM = struct.Struct(">BII")  # kind, request id, payload length
_STEP_HEAD = struct.Struct(">IIBH")  # a STEP's handle, prefix length, lone session, adapter length (then its utf-8)
_TENSOR_HEADS = tuple(struct.Struct(f">BB{ndim}I") for ndim in range(MAX_TENSOR_DIMS + 1))  # dtype code, ndim, dims


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
        data = (value or "").encode()
        if len(data) > MAX_STR_BYTES:
            raise FrameError(f"string of {len(data)} bytes exceeds {MAX_STR_BYTES}")
        self.parts.append(struct.pack(">H", len(data)) + data)
        return self

    def step_head(self, handle: int, prefix_length: int, lone_session: bool, adapter: str) -> Writer:
        """A STEP's leading fields in one pack: `u32(handle).u32(prefix_length).u8(lone_session).text(adapter)`,
        the same bytes (the per-step path)."""
        data = adapter.encode()
        if len(data) > MAX_STR_BYTES:
            raise FrameError(f"string of {len(data)} bytes exceeds {MAX_STR_BYTES}")
        self.parts.append(_STEP_HEAD.pack(handle, prefix_length, lone_session, len(data)) + data)
        return self

    def blob(self, value: bytes) -> Writer:
        self.parts.append(_U32.pack(len(value)))
        self.parts.append(value)
        return self

    def tensor(self, tensor: torch.Tensor | None) -> Writer:
        if tensor is None:
            self.parts.append(_U8.pack(NO_TENSOR))
            return self
        code = _DTYPE_CODES.get(tensor.dtype)
        shape = tensor.shape
        if code is None or len(shape) > MAX_TENSOR_DIMS:
            raise FrameError(f"can't send a {tensor.dtype} tensor of {len(shape)} dims")
        if tensor.requires_grad:
            tensor = tensor.detach()  # [any shape]
        if not tensor.is_cpu:
            tensor = tensor.cpu()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        self.parts.append(_TENSOR_HEADS[len(shape)].pack(code, len(shape), *shape))
        if tensor.numel():
            view = _NUMPY_VIEW.get(tensor.dtype)
            self.parts.append((tensor.view(view) if view is not None else tensor).numpy().data.cast("B"))  # flat
        return self

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

    def item(self, kind: int, request_id: int, body: Writer) -> Writer:
        """Appends `body` as one item of a batch payload (see the module docstring)."""
        self.parts.append(_ITEM.pack(kind, request_id, body.nbytes()))
        self.parts.extend(body.parts)
        return self


def batch(items: list[tuple[int, int, Writer]], head: Writer | None = None) -> Writer:
    """A batch payload of (kind, request id, body) items, after `head` (a reply batch's state)."""
    if not 0 < len(items) <= MAX_BATCH_ITEMS:
        raise FrameError(f"a batch holds 1 to {MAX_BATCH_ITEMS} items, got {len(items)}")
    out = head if head is not None else Writer()
    out.parts.append(_U16.pack(len(items)))
    for kind, request_id, body in items:
        out.item(kind, request_id, body)
    return out


def batch_frames(
    items: list[tuple[int, int, Writer]], batch_kind: int, max_frame_bytes: int, head: Writer | None = None
) -> list[bytes]:
    """Frames for `items` (kind, request id, body): one item alone is its own frame (with `head` before its body);
    several go into `batch_kind` frames, each within `max_frame_bytes` and `MAX_BATCH_ITEMS` (an item too large to
    share a frame goes alone). `head`: the device's state, once per frame."""
    frames: list[bytes] = []
    group: list[tuple[int, int, Writer]] = []
    head_bytes = head.nbytes() if head is not None else 0
    size = head_bytes + _U16.size

    def close_group() -> None:
        if len(group) == 1:
            kind, request_id, body = group[0]
            single = Writer()
            single.parts = [*(head.parts if head is not None else []), *body.parts]
            frames.append(single.frame(kind, request_id))
        elif group:
            framed = Writer()
            framed.parts = list(head.parts) if head is not None else []
            frames.append(batch(group, framed).frame(batch_kind, 0))

    for item in items:
        item_bytes = _ITEM.size + item[2].nbytes()
        if group and (size + item_bytes > max_frame_bytes or len(group) >= MAX_BATCH_ITEMS):
            close_group()
            group, size = [], head_bytes + _U16.size
        group.append(item)
        size += item_bytes
    close_group()
    return frames


def split_batch(reader: Reader, batch_kind: int) -> list[tuple[int, int, memoryview]]:
    """The (kind, request id, payload view) items of a batch frame's payload, from `reader`'s position; every
    count and length is checked against the frame before anything is sliced."""
    allowed = BATCH_ITEM_KINDS[batch_kind]
    (count,) = _U16.unpack(reader.take(2))
    if not 0 < count <= MAX_BATCH_ITEMS:
        raise FrameError(f"a batch holds 1 to {MAX_BATCH_ITEMS} items, got {count}")
    items = []
    for _ in range(count):
        kind, request_id, length = _ITEM.unpack(reader.take(_ITEM.size))
        if kind not in allowed:
            raise FrameError(f"frame kind {kind} can't be an item of batch kind {batch_kind}")
        items.append((kind, request_id, reader.take(length)))
    reader.done()
    return items


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
        (length,) = struct.unpack(">H", self.take(2))
        return bytes(self.take(length)).decode()

    def blob(self) -> bytes:
        return bytes(self.take(self.u32()))

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
        code = self.u8()
        if code == NO_TENSOR:
            return None
        if code >= len(_DTYPES):
            raise FrameError(f"unknown dtype code {code}")
        ndim = self.u8()
        if ndim > MAX_TENSOR_DIMS:
            raise FrameError(f"tensor of {ndim} dims exceeds {MAX_TENSOR_DIMS}")
        shape: tuple[int, ...] = struct.unpack(f">{ndim}I", self.take(4 * ndim))
        return _DTYPES[code], shape, self.take(math.prod(shape) * _ITEM_BYTES[code])

    def done(self) -> None:
        if self.offset != len(self.data):
            raise FrameError(f"{len(self.data) - self.offset} trailing bytes in a frame")


async def read_frame(reader: asyncio.StreamReader, max_frame_bytes: int) -> tuple[int, int, bytes]:
    """(kind, request id, payload) of the next frame; ChannelClosed at EOF, FrameError past the bounds."""
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise ChannelClosed("handler channel closed") from e
    length, kind, request_id = HEADER.unpack(header)
    if kind not in FRAME_KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    if length > max_frame_bytes:
        raise FrameError(f"frame of {length} bytes exceeds max_frame_bytes={max_frame_bytes}")
    try:
        payload = await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise ChannelClosed("handler channel closed mid-frame") from e
    return kind, request_id, payload


# ---- errors: the device's typed refusal crosses the channel as (code, reason, message) and is raised again as the
# same type in the handler process, so the handler counts and answers it exactly as in one process


def encode_error(error: BaseException) -> Writer:
    code, reason, value, limit = 0, "", 0, 0
    if isinstance(error, TooLong):
        code, value, limit = 2, error.value, error.limit
    elif isinstance(error, HandoffUnsupported):
        code = 9
    elif isinstance(error, BadRequest):
        code = 1
    elif isinstance(error, (PeerLimitExceeded, ServerLimitExceeded)):
        code, reason = (4 if isinstance(error, PeerLimitExceeded) else 5), error.reason
    elif isinstance(error, SessionEvicted):
        code = 11
    elif isinstance(error, AllocationFailed):
        code = 3
    elif isinstance(error, (TimeoutError, asyncio.TimeoutError)):
        code = 6
    elif isinstance(error, (Overloaded, RuntimeStopped)):
        code = 7
    elif isinstance(error, TypeError):
        code = 8
    elif isinstance(error, Draining):
        code = 10
    elif isinstance(error, ValueError):
        code = 1
    return Writer().u8(code).text(reason).u64(max(0, value)).u64(max(0, limit)).text(str(error)[:4096])


def decode_error(reader: Reader) -> Exception:
    code, reason, value, limit, message = reader.u8(), reader.text(), reader.u64(), reader.u64(), reader.text()
    if code == 1:
        return BadRequest(message)
    if code == 2:
        return TooLong(message, value=value, limit=limit)
    if code == 3:
        return AllocationFailed(message)
    if code == 4:
        return PeerLimitExceeded(message, reason=reason)
    if code == 5:
        return ServerLimitExceeded(message, reason=reason)
    if code == 6:
        return RequestTimeout(message)
    if code == 7:
        return Overloaded(message)
    if code == 8:
        return TypeError(message)
    if code == 9:
        return HandoffUnsupported(message)
    if code == 10:
        return Draining(message)
    if code == 11:
        return SessionEvicted(message)
    return RuntimeError(message)
