"""The device side's hot codec for the handler channel (`proxy_wire` frames, byte for byte the same format): a
STEP_BATCH frame parsed in one pass, and the replies of one merged forward encoded as REPLY_BATCH frames in one join.

`parse_steps` reads every item's fields with `struct.unpack_from` at offsets (each length checked against what is
left of its item before anything is sliced or allocated, as `proxy_wire.Reader` does), then copies the hidden
states of all the items that share one dtype and shape out of the receive buffer at once (one `bytearray.join`, one
copy for the group) and hands each step a view of that copy: a few torch calls per group instead of several per
step, so the reader thread rarely gives the GIL to the runtime thread and waits to get it back. Prompts and beam ids (rare) are read
by `proxy_wire.Reader`.

`reply_frames` builds exactly what `proxy_wire.batch_frames(items, REPLY_BATCH, max_frame_bytes, head=state)`
builds for a list of step results (same grouping, same bounds), from a cached per-(dtype, shape) record header and
the outputs' bytes (given with the results where a forward collected them, else read in place or copied by one
`torch.cat` per group of equal shapes), joined once per frame; a merged forward's usual list (one dtype and shape,
no refusal) takes one pack per item (`_uniform_frames`). A frame's hidden states of one dtype and shape share one
copy (`engine.step_request.HiddenRows`: one tensor for all of them where the engine needs tensors)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from corolla.engine.step_request import HiddenRows
from corolla.server import proxy_wire as wire
from corolla.utils.tensor_bytes import view_bytes

# the channel's tensor record encoding (proxy_wire's dtype codes and item sizes)
_DTYPES = wire._DTYPES
_ITEM_BYTES = wire._ITEM_BYTES
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_STEP_HEAD = struct.Struct(">IIBH")  # handle, prefix length, lone, adapter name length
_ITEM = struct.Struct(">BII")  # a batch item: kind, request id, payload length
_U16 = struct.Struct(">H")
_RECORD_HEAD = struct.Struct(">BB")  # dtype code, ndim
# a usual step item's fields up to its hidden states' data: handle, prefix length, lone, adapter name length (0),
# dtype code, ndim (3), dims
_USUAL = struct.Struct(">IIBHBB3I")
_SHAPES = tuple(struct.Struct(f">{ndim}I") for ndim in range(wire.MAX_TENSOR_DIMS + 1))  # a record's dims
_REPLY_RECORDS_KEPT = 256  # distinct (dtype, shape) reply record headers cached


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
    error: wire.FrameError


def parse_steps(payload: memoryview) -> list[ParsedStep | BadStep]:
    """The steps of a STEP_BATCH payload, in order; an item whose fields break the format is a `BadStep` in its
    place. A malformed batch (count, item kinds or lengths, trailing bytes) raises FrameError, as
    `proxy_wire.split_batch` does: every item's header and length is checked before any item is read.

    The usual item (no adapter name, hidden states of 3 dims, neither prompts nor beam ids) is read with one
    `unpack_from` at its offset in the payload, its length checked to be exactly those fields; any other goes
    through the general reader (`_parse_item`)."""
    size = len(payload)
    if size < _U16.size:
        raise wire.FrameError(f"field of {_U16.size} bytes runs past the payload ({size} left)")
    (count,) = _U16.unpack_from(payload, 0)
    if not 0 < count <= wire.MAX_BATCH_ITEMS:
        raise wire.FrameError(f"a batch holds 1 to {wire.MAX_BATCH_ITEMS} items, got {count}")
    bounds: list[tuple[int, int, int]] = []  # request id, start, length
    offset = _U16.size
    for _ in range(count):  # counts, kinds and lengths, before anything is sliced
        if offset + _ITEM.size > size:
            raise wire.FrameError(f"field of {_ITEM.size} bytes runs past the payload ({size - offset} left)")
        kind, request_id, length = _ITEM.unpack_from(payload, offset)
        if kind != wire.STEP:
            raise wire.FrameError(f"frame kind {kind} can't be an item of batch kind {wire.STEP_BATCH}")
        start = offset + _ITEM.size
        offset = start + length
        if offset > size:
            raise wire.FrameError(f"field of {length} bytes runs past the payload ({size - start} left)")
        bounds.append((request_id, start, length))
    if offset != size:
        raise wire.FrameError(f"{size - offset} unexpected trailing bytes in the payload")
    out: list[ParsedStep | BadStep] = []
    groups: dict[tuple[int, tuple[int, ...]], list[tuple[int, memoryview, int]]] = {}  # (code, shape) -> hiddens
    usual, codes, item_bytes, no_tensor = _USUAL, len(_DTYPES), _ITEM_BYTES, wire.NO_TENSOR
    for request_id, start, length in bounds:
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
        except wire.FrameError as e:
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
        raise wire.FrameError(f"a step item of {size} bytes is shorter than its fixed fields")
    handle, prefix_length, lone, name_bytes = _STEP_HEAD.unpack_from(item, 0)
    offset = _STEP_HEAD.size + name_bytes
    if offset > size:
        raise wire.FrameError(f"adapter name of {name_bytes} bytes runs past the step item")
    adapter = bytes(item[_STEP_HEAD.size : offset]).decode() if name_bytes else ""
    hidden_at, offset = _record(item, offset)
    if offset == size - 2 and item[offset] == wire.NO_TENSOR and item[offset + 1] == wire.NO_TENSOR:
        prompts = hypo_ids = None  # the usual step: neither deep prompts nor beam ids
    else:
        fields = wire.Reader(item)
        fields.offset = offset
        prompts, hypo_ids = fields.tensor(), fields.tensor()
        fields.done()
    return ParsedStep(request_id, handle, prefix_length, bool(lone), adapter, prompts, hypo_ids), hidden_at


def _record(item: memoryview, offset: int) -> tuple[tuple[int, tuple[int, ...], int] | None, int]:
    """The tensor record at `offset`: ((code, shape, data offset) or None for no tensor, the offset after it)."""
    if offset + 1 > len(item):
        raise wire.FrameError("a tensor record runs past the step item")
    code = item[offset]
    if code == wire.NO_TENSOR:
        return None, offset + 1
    if code >= len(_DTYPES):
        raise wire.FrameError(f"unknown dtype code {code}")
    if offset + 2 > len(item):
        raise wire.FrameError("a tensor record runs past the step item")
    ndim = item[offset + 1]
    if ndim > wire.MAX_TENSOR_DIMS:
        raise wire.FrameError(f"tensor of {ndim} dims exceeds {wire.MAX_TENSOR_DIMS}")
    start = offset + 2 + 4 * ndim
    if start > len(item):
        raise wire.FrameError("a tensor record's shape runs past the step item")
    shape = _SHAPES[ndim].unpack_from(item, offset + 2)
    nbytes = _ITEM_BYTES[code]
    for dim in shape:
        nbytes *= dim
    if start + nbytes > len(item):  # bounded by the item before anything is allocated
        raise wire.FrameError(f"field of {nbytes} bytes runs past the payload ({len(item) - start} left)")
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
    results: list[tuple[int, torch.Tensor | BaseException, memoryview | None]], head: bytes, max_frame_bytes: int
) -> list[bytes]:
    """What `proxy_wire.batch_frames` makes of these step results (REPLY_TENSORS for a tensor [B, T, H], REPLY_ERROR
    for a refusal), with `head` (the device's state) once per frame. A tensor's bytes, where given (C order, flat:
    what the tensor views, e.g. `StepRequest.output_bytes`), are sent as they are (no torch call for that reply)."""
    uniform = _uniform_frames(results, head, max_frame_bytes) if results else None
    if uniform is not None:
        return uniform
    encoded: list[tuple[int, int, list[bytes | memoryview], int]] = []  # kind, request id, body parts, body bytes
    groups: dict[tuple[torch.dtype, tuple[int, ...]], list[tuple[int, torch.Tensor]]] = {}
    for request_id, result, raw in results:
        if isinstance(result, BaseException):
            body = wire.encode_error(result)
            encoded.append((wire.REPLY_ERROR, request_id, body.parts, body.nbytes()))
            continue
        dims: tuple[int, ...] = result.shape  # a torch.Size: a tuple, no copy
        if result.is_cpu and result.dtype in _CODES and 0 < len(dims) <= wire.MAX_TENSOR_DIMS:
            if raw is not None:
                prefix, nbytes = _reply_record(result.dtype, dims)
                if raw.nbytes == nbytes:
                    encoded.append((wire.REPLY_TENSORS, request_id, [prefix, raw], len(prefix) + nbytes))
                    continue
            groups.setdefault((result.dtype, dims), []).append((len(encoded), result))
        else:  # elsewhere than the CPU, or a dtype the channel can't carry (the writer raises FrameError for it)
            body = wire.Writer().u8(1).tensor(result)
            encoded.append((wire.REPLY_TENSORS, request_id, body.parts, body.nbytes()))
            continue
        encoded.append((wire.REPLY_TENSORS, request_id, [], 0))  # its body is filled in below, with its group's
    for (dtype, shape), members in groups.items():
        prefix, nbytes = _reply_record(dtype, shape)
        data = _group_bytes(dtype, [t for _, t in members], nbytes) if nbytes else None
        for i, (index, _) in enumerate(members):
            kind, request_id, _, _ = encoded[index]
            parts: list[bytes | memoryview] = [prefix] if data is None else [prefix, data[i]]
            encoded[index] = (kind, request_id, parts, len(prefix) + nbytes)
    frames: list[bytes] = []
    head_bytes = len(head)
    group_start, size = 0, head_bytes + _U16.size
    for i, (_, _, _, body_bytes) in enumerate(encoded):
        item_bytes = _ITEM.size + body_bytes
        if i > group_start and (size + item_bytes > max_frame_bytes or i - group_start >= wire.MAX_BATCH_ITEMS):
            frames.append(_frame(encoded[group_start:i], head))
            group_start, size = i, head_bytes + _U16.size
        size += item_bytes
    if group_start < len(encoded):
        frames.append(_frame(encoded[group_start:], head))
    return frames


def _uniform_frames(
    results: list[tuple[int, torch.Tensor | BaseException, memoryview | None]], head: bytes, max_frame_bytes: int
) -> list[bytes] | None:
    """`reply_frames` of a merged forward's usual replies: every result a CPU tensor of one dtype and shape (not
    empty), as one frame task's outputs are. The same bytes, with one pack per item (its header and record prefix)
    and the frames' item counts computed once; None (nothing done) for any other list."""
    first = results[0][1]
    if isinstance(first, BaseException) or not first.is_cpu:
        return None
    dtype, dims = first.dtype, first.shape
    if dtype not in _CODES or not 0 < len(dims) <= wire.MAX_TENSOR_DIMS:
        return None
    prefix, nbytes = _reply_record(dtype, dims)
    if nbytes == 0:
        return None
    data: list[bytes | memoryview] = []
    loose: list[int] = []  # results without their bytes: read from their tensors
    tensors: list[torch.Tensor] = []
    for _, result, raw in results:
        if isinstance(result, BaseException) or result.dtype is not dtype or result.shape != dims or not result.is_cpu:
            return None
        if raw is None or raw.nbytes != nbytes:
            loose.append(len(data))
            tensors.append(result)
            data.append(b"")  # filled in below
        else:
            data.append(raw)
    if loose:
        for index, read in zip(loose, _group_bytes(dtype, tensors, nbytes), strict=True):
            data[index] = read
    body_bytes = len(prefix) + nbytes
    item_head = _item_heads.get(len(prefix))
    if item_head is None:
        item_head = _item_heads[len(prefix)] = struct.Struct(f">BII{len(prefix)}s")  # an item's header + prefix
    # items per frame: as many as fit the bound after the state and count (at least one), as `reply_frames` groups
    per_frame = max(
        1, min(wire.MAX_BATCH_ITEMS, (max_frame_bytes - len(head) - _U16.size) // (_ITEM.size + body_bytes))
    )
    frames: list[bytes] = []
    for start in range(0, len(results), per_frame):
        end = min(start + per_frame, len(results))
        if end - start == 1:  # alone: its own frame, the state before its body
            frames.append(b"".join([wire.HEADER.pack(len(head) + body_bytes, wire.REPLY_TENSORS, results[start][0]),
                                    head, prefix, data[start]]))  # fmt: skip
            continue
        total = len(head) + _U16.size + (end - start) * (_ITEM.size + body_bytes)
        joined: list[bytes | memoryview] = [wire.HEADER.pack(total, wire.REPLY_BATCH, 0), head, _U16.pack(end - start)]
        for i in range(start, end):
            joined.append(item_head.pack(wire.REPLY_TENSORS, results[i][0], body_bytes, prefix))
            joined.append(data[i])
        frames.append(b"".join(joined))
    return frames


_item_heads: dict[int, struct.Struct] = {}  # by record prefix length: a REPLY_BATCH item's header and prefix


def _frame(group: list[tuple[int, int, list[bytes | memoryview], int]], head: bytes) -> bytes:
    if len(group) == 1:  # alone: its own frame, the state before its body
        kind, request_id, parts, body_bytes = group[0]
        return b"".join([wire.HEADER.pack(len(head) + body_bytes, kind, request_id), head, *parts])
    joined: list[bytes | memoryview] = [b"", head, _U16.pack(len(group))]
    total = len(head) + _U16.size
    for kind, request_id, parts, body_bytes in group:
        joined.append(_ITEM.pack(kind, request_id, body_bytes))
        joined.extend(parts)
        total += _ITEM.size + body_bytes
    joined[0] = wire.HEADER.pack(total, wire.REPLY_BATCH, 0)
    return b"".join(joined)


_reply_records: dict[tuple[torch.dtype, tuple[int, ...]], tuple[bytes, int]] = {}


def _reply_record(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, int]:
    """A REPLY_TENSORS body's bytes before the data (`Writer().u8(1).tensor(t)`'s) and the data's byte count."""
    key = (dtype, shape)
    record = _reply_records.get(key)
    if record is None:
        code = _CODES[dtype]
        count = 1
        for dim in shape:
            count *= dim
        prefix = b"\x01" + _RECORD_HEAD.pack(code, len(shape)) + struct.pack(f">{len(shape)}I", *shape)
        record = (prefix, count * _ITEM_BYTES[code])
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
    numel = nbytes // _ITEM_BYTES[_CODES[dtype]]
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
