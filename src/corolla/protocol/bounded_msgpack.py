"""The one msgpack decoder for bytes from the network (request metadata, `rpc_info` replies, DHT values): hivemind's
`MSGPackSerializer` format decoded under explicit limits on bytes, depth, lengths and items. hivemind's own decoder
re-enters the C unpacker per nested tuple, so ~250 nested tuples crash the process; here every ext payload is decoded
with the caller's remaining depth. `install_bounded_serializer()` makes hivemind's `MSGPackSerializer.loads` this
decoder too (an undecodable value comes back as its bytes); encoding stays hivemind's."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import msgpack
from hivemind.utils.serializer import MSGPackSerializer

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

TUPLE_EXT_TYPE = 0x40  # hivemind: a tuple, payload = msgpack array
DICTIONARY_DHT_VALUE_EXT_TYPE = 0x50  # hivemind.dht.storage.DictionaryDHTValue: [maxsize, latest_exp, items]
BATCH_TENSOR_DESCRIPTOR_EXT_TYPE = 0x51  # hivemind.utils.tensor_descr.BatchTensorDescriptor: a dict of fields


class MsgpackLimitError(ValueError):
    """The bytes exceed a decoding limit (or are not msgpack); the message names the limit."""


def _step_structure_fits(limits: MsgpackLimits) -> bool:
    """True where the general path would decode the step structure's payload (its arrays and bins within limits)."""
    return limits.max_container_len >= 3 and limits.max_bin_bytes >= 4


@dataclass(frozen=True)
class MsgpackLimits:
    """Bounds on one decoded message. Each is checked before the corresponding object is allocated, except
    `max_items`, checked as each container completes (so at most one container's worth is built past it)."""

    max_bytes: int  # whole message
    max_depth: int = 32  # containers and ext payloads nested in each other (a tuple inside a list = 2)
    max_container_len: int = 4096  # elements of one array, pairs of one map
    max_str_bytes: int = 64 * 1024  # one str (utf-8 bytes)
    max_bin_bytes: int = 1 << 20  # one bin
    max_items: int = 1 << 16  # elements of all containers together (amplification bound: an empty list is 1 byte)
    # the longest message `small_map` decodes: none that short can pass a length, item or str/bin limit (each element,
    # pair and str/bin byte takes a byte of it); 0 where the step structure (3 deep) would not fit (its own checks)
    small_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_depth", "max_container_len", "max_str_bytes", "max_bin_bytes", "max_items"):
            if getattr(self, name) < 1:
                raise ValueError(f"MsgpackLimits.{name} must be >= 1, got {getattr(self, name)}")
        small = min(self.max_bytes, self.max_container_len, self.max_str_bytes, self.max_bin_bytes, self.max_items)
        object.__setattr__(self, "small_bytes", small if self.max_depth >= 3 and _step_structure_fits(self) else 0)


# Request metadata and rpc_info replies: a handful of keys (Petals sends < 1 KiB).
METADATA_LIMITS = MsgpackLimits(
    max_bytes=64 * 1024, max_depth=16, max_container_len=1024, max_str_bytes=16 * 1024, max_bin_bytes=64 * 1024,
    max_items=8192,
)  # fmt: skip
# DHT values: a block's DictionaryDHTValue holds one ServerInfo record per server (< 1 KiB each).
DHT_LIMITS = MsgpackLimits(
    max_bytes=4 << 20, max_depth=32, max_container_len=1 << 16, max_str_bytes=1 << 20, max_bin_bytes=4 << 20,
    max_items=1 << 18,
)  # fmt: skip
# One entry of a DictionaryDHTValue: [subkey, value bytes, expiration]; entries are decoded one by one, their number
# bounded by DHT_LIMITS.max_bytes only (a failing entry is skipped, not its dictionary).
DICTIONARY_ENTRY_LIMITS = MsgpackLimits(
    max_bytes=4 << 20, max_depth=8, max_container_len=1024, max_str_bytes=64 * 1024, max_bin_bytes=4 << 20,
    max_items=4096,
)  # fmt: skip


class _Budget:
    """Shared by one top-level decode and all ext payloads inside it."""

    __slots__ = ("containers", "items", "limits")

    def __init__(self, limits: MsgpackLimits):
        self.limits = limits
        self.items = 0
        self.containers = 0

    def charge(self, *, containers: int, items: int) -> None:
        """What `count` charges for `containers` completed containers holding `items` elements in all."""
        self.containers += containers
        self.items += items
        if self.items > self.limits.max_items:
            raise MsgpackLimitError(f"msgpack value has more than max_items={self.limits.max_items} elements")

    def count(self, container: Any) -> Any:
        """msgpack's list_hook/object_hook: called as each array/map completes (tuples are arrays first)."""
        self.containers += 1
        self.items += len(container)
        if self.items > self.limits.max_items:
            raise MsgpackLimitError(f"msgpack value has more than max_items={self.limits.max_items} elements")
        return container


def _check_depth(value: Any, depth_left: int, limits: MsgpackLimits) -> None:
    """Iterative walk (no recursion): containers nested deeper than `depth_left` -> MsgpackLimitError."""
    stack = [(value, depth_left)]
    while stack:
        node, left = stack.pop()
        if isinstance(node, (list, tuple)):
            children = node
        elif isinstance(node, dict):
            children = tuple(node.values())  # keys are str/bytes (strict_map_key)
        else:
            continue
        if left <= 0:
            raise MsgpackLimitError(f"msgpack value is nested deeper than max_depth={limits.max_depth}")
        for child in children:
            if isinstance(child, (list, tuple, dict)):
                stack.append((child, left - 1))


def _decode(data: bytes, budget: _Budget, reentries_left: int, *, top: bool = False) -> Any:
    """One (C) unpack. Ext payloads come back here with one re-entry less (each ext nests at least one level inside
    the value around it, except a value that is one ext: hence max_depth + 1 at the top), so the C unpacker is
    re-entered at most max_depth + 1 times. The exact depth of the whole value is checked once, at the top."""
    limits = budget.limits
    if reentries_left <= 0:
        raise MsgpackLimitError(f"msgpack value is nested deeper than max_depth={limits.max_depth}")

    def ext_hook(code: int, payload: bytes) -> Any:
        return _decode_ext(code, payload, budget, reentries_left - 1)

    value = msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=True,
        ext_hook=ext_hook,
        list_hook=budget.count,
        object_hook=budget.count,
        max_str_len=limits.max_str_bytes,
        max_bin_len=limits.max_bin_bytes,
        max_array_len=limits.max_container_len,
        max_map_len=limits.max_container_len,
        max_ext_len=limits.max_bytes,
    )
    if top and budget.containers > limits.max_depth:  # fewer containers than that cannot nest deeper (usual case)
        _check_depth(value, limits.max_depth, limits)
    return value


# hivemind's payload of the tuple ext holding Petals' per-step args_structure ((b"__T0", b"__T1", b"__T2"), {}),
# which every inference step's metadata carries: decoded here without re-entering the C unpacker twice
STEP_STRUCTURE_PAYLOAD = b"\x92\xc7\x13@\x93\xc4\x04__T0\xc4\x04__T1\xc4\x04__T2\x80"
_STEP_STRUCTURE_ARGS = (b"__T0", b"__T1", b"__T2")


def _decode_ext(code: int, payload: bytes, budget: _Budget, reentries_left: int) -> Any:
    if code == TUPLE_EXT_TYPE:
        if payload == STEP_STRUCTURE_PAYLOAD and reentries_left >= 2 and _step_structure_fits(budget.limits):
            # the value and the charges of the general path below
            budget.charge(containers=3, items=5)  # the args tuple (3), the outer tuple (2), the kwargs map (0)
            return (_STEP_STRUCTURE_ARGS, {})
        items = _decode(payload, budget, reentries_left)
        if not isinstance(items, list):
            raise MsgpackLimitError(f"tuple ext (0x40) must hold an array, got {type(items).__name__}")
        return tuple(items)
    if code == DICTIONARY_DHT_VALUE_EXT_TYPE:
        return _dictionary_dht_value(payload, budget, reentries_left)
    if code == BATCH_TENSOR_DESCRIPTOR_EXT_TYPE:
        return _batch_tensor_descriptor(_decode(payload, budget, reentries_left))
    logger.debug(f"msgpack.unknown_ext(code={code}, bytes={len(payload)}): left as bytes")
    return payload  # as hivemind does for codes it does not know


class _NotSmall(Exception):
    """`small_map` met an ext that only `loads` decodes (any but the step structure's)."""


def _small_ext(code: int, payload: bytes) -> Any:
    if code == TUPLE_EXT_TYPE and payload == STEP_STRUCTURE_PAYLOAD:
        return (_STEP_STRUCTURE_ARGS, {})
    raise _NotSmall


def small_map(data: bytes, limits: MsgpackLimits = METADATA_LIMITS) -> dict[str, Any] | None:
    """What `loads(data, limits)` returns for a str-keyed map of at most `limits.small_bytes` whose only ext is
    Petals' step structure (hivemind's tuple ext): every request's metadata, decoded in one C unpack with no Python
    hook (a message that short passes no length, item or str/bin limit; its depth is walked where it nests). None
    for anything else, nothing refused (the caller then calls `loads`, which decodes or refuses it: the refusals and
    their messages stay its own)."""
    if data.__class__ is not bytes or len(data) > limits.small_bytes:
        return None
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_small_ext)
    except Exception:  # (malformed, an ext `loads` decodes itself, ...): `loads` says what
        return None
    if value.__class__ is not dict:
        return None
    nested = False
    for key, item in value.items():  # (a tuple is the step structure, 2 deep: arrays decode as lists)
        if key.__class__ is not str:
            return None
        if item.__class__ is list or item.__class__ is dict:
            nested = True
    if nested:
        try:
            _check_depth(value, limits.max_depth, limits)
        except MsgpackLimitError:
            return None
    return value


def is_number(value: object) -> TypeGuard[int | float]:
    """A decoded int or float (msgpack's bools are ints to Python, and no number): every reader's check of one."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _dictionary_dht_value(payload: bytes, budget: _Budget, reentries_left: int) -> Any:
    """hivemind's `DictionaryDHTValue.unpackb` with each entry decoded on its own, under `DICTIONARY_ENTRY_LIMITS`:
    an entry that fails them or is malformed is skipped, not the whole dictionary (a block key's dictionary is every
    server of the block, written by anyone: one bad subkey must not drop an honest node's whole answer), and the
    number of entries is bounded by the bytes only."""
    from hivemind.dht.storage import DictionaryDHTValue

    unpacker = msgpack.Unpacker(max_buffer_size=max(len(payload), 1), raw=False, strict_map_key=True)
    unpacker.feed(payload)
    try:
        if unpacker.read_array_header() != 3:
            raise MsgpackLimitError("DictionaryDHTValue (0x50) must be [maxsize, latest_expiration_time, items]")
        fields = _decode(_next_object_bytes(unpacker, payload, 2), budget, reentries_left)
        num_items = unpacker.read_array_header()
        if not isinstance(fields, list) or not all(is_number(field) for field in fields):
            raise MsgpackLimitError("DictionaryDHTValue (0x50) fields have wrong types")
        maxsize, latest_expiration_time = fields
        skipped = 0
        with DictionaryDHTValue(maxsize).freeze() as value:
            for _ in range(num_items):
                entry = _next_object_bytes(unpacker, payload, 1)
                try:  # re-entries keep shrinking (a subkey may hold a dictionary ext): the C stack stays bounded
                    depth = min(reentries_left, DICTIONARY_ENTRY_LIMITS.max_depth + 1)
                    item = _decode(entry, _Budget(DICTIONARY_ENTRY_LIMITS), depth, top=True)
                    if not isinstance(item, list) or len(item) != 3 or not is_number(item[2]):
                        raise MsgpackLimitError("items must be [subkey, value, expiration_time]")
                    key, item_value, expiration_time = item
                    if not isinstance(key, str):  # the subkeys Petals and corolla write (peer ids, prefixes, keys);
                        # another type could be unhashable or, at an equal expiration, not comparable in the heap
                        raise MsgpackLimitError(f"subkey must be a str, got {type(key).__name__}")
                except MsgpackLimitError:
                    skipped += 1
                    continue
                value.store(key, item_value, expiration_time)
            if unpacker.tell() != len(payload):
                raise MsgpackLimitError("DictionaryDHTValue (0x50) has trailing bytes")
            value.latest_expiration_time = latest_expiration_time
    except MsgpackLimitError:
        raise
    except (msgpack.OutOfData, msgpack.UnpackException, ValueError) as e:  # framing: the answer itself is garbage
        raise MsgpackLimitError(f"DictionaryDHTValue (0x50) is malformed: {_describe(e)}") from None
    if skipped:
        logger.debug(f"msgpack.dictionary_entries_skipped(skipped={skipped}, kept={len(value)})")
    return value


def _next_object_bytes(unpacker: msgpack.Unpacker, payload: bytes, count: int) -> bytes:
    """The bytes of the next `count` objects (as one msgpack array of them if count > 1), without decoding them
    (msgpack's skip builds nothing and calls no ext hook)."""
    start = unpacker.tell()
    for _ in range(count):
        unpacker.skip()
    body = payload[start : unpacker.tell()]
    return body if count == 1 else bytes([0x90 | count]) + body


_DESCRIPTOR_KEYS = frozenset(
    {"size", "dtype", "layout", "device_type", "device_index", "requires_grad", "pin_memory", "compression"}
)


def _batch_tensor_descriptor(fields: Any) -> Any:
    """hivemind's `BatchTensorDescriptor.unpackb`, on an already bounded-decoded dict, with its fields checked."""
    import torch
    from hivemind.utils.tensor_descr import BatchTensorDescriptor

    if not isinstance(fields, dict) or set(fields) != _DESCRIPTOR_KEYS:
        raise MsgpackLimitError(f"BatchTensorDescriptor (0x51) must be a dict with keys {sorted(_DESCRIPTOR_KEYS)}")
    size = fields["size"]
    if (
        not isinstance(size, (list, tuple))
        or not 1 <= len(size) <= 16
        or not all(d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 0) for d in size)
    ):
        raise MsgpackLimitError(f"BatchTensorDescriptor (0x51) size must be a short list of ints, got {size!r:.100}")
    kwargs: dict[str, Any] = {}
    for key, kind in (("dtype", torch.dtype), ("layout", torch.layout)):
        name = fields[key]
        if name is None:
            kwargs[key] = None
            continue
        value = getattr(torch, name.split(".")[-1], None) if isinstance(name, str) and len(name) <= 64 else None
        if not isinstance(value, kind):
            raise MsgpackLimitError(f"BatchTensorDescriptor (0x51) {key} is not a torch {kind.__name__}: {name!r:.64}")
        kwargs[key] = value
    device_type, device_index = fields["device_type"], fields["device_index"]
    if device_type is None:
        kwargs["device"] = None
    else:
        if device_type not in ("cpu", "cuda", "mps", "meta") or not (
            device_index is None or isinstance(device_index, int)
        ):
            raise MsgpackLimitError(f"BatchTensorDescriptor (0x51) device is not valid: {device_type!r:.32}")
        kwargs["device"] = (
            torch.device(device_type) if device_index is None else torch.device(device_type, device_index)
        )
    for key in ("requires_grad", "pin_memory"):
        if not isinstance(fields[key], bool):
            raise MsgpackLimitError(f"BatchTensorDescriptor (0x51) {key} must be a bool")
        kwargs[key] = fields[key]
    if not isinstance(fields["compression"], int) or isinstance(fields["compression"], bool):
        raise MsgpackLimitError("BatchTensorDescriptor (0x51) compression must be an int")
    kwargs["compression"] = fields["compression"]
    return BatchTensorDescriptor(*size[1:], **kwargs)


def loads(data: bytes | bytearray | memoryview, limits: MsgpackLimits = METADATA_LIMITS) -> Any:
    """Decodes hivemind-msgpack bytes within `limits`; any violation or malformed input -> ValueError
    (`MsgpackLimitError` for limits and format errors)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MsgpackLimitError(f"expected bytes to decode, got {type(data).__name__}")
    if len(data) > limits.max_bytes:
        raise MsgpackLimitError(f"msgpack message is {len(data)} bytes, more than max_bytes={limits.max_bytes}")
    try:
        return _decode(bytes(data), _Budget(limits), limits.max_depth + 1, top=True)
    except MsgpackLimitError:
        raise
    except RecursionError as e:  # cannot happen within max_depth, but never let it escape as something else
        raise MsgpackLimitError(f"msgpack value is nested too deep: {e}") from None
    except Exception as e:  # msgpack and the ext constructors raise a zoo of types on garbage
        raise MsgpackLimitError(f"not valid msgpack: {_describe(e)}") from None


def _describe(error: Exception) -> str:
    """A short message; never the repr of what was decoded (msgpack's ExtraData holds the value: a repr of 1000
    nested lists raises RecursionError)."""
    try:
        return f"{type(error).__name__}: {str(error)[:200]}"
    except Exception:  # a hostile value inside the exception's str
        return type(error).__name__


# ---- hivemind integration ------------------------------------------------------------------------------------------

_install_lock = threading.Lock()


def _bounded_serializer_loads(cls: type, buf: bytes) -> Any:
    """hivemind's DHT decodes values where an exception would leave a search unfinished (its caller then times out)
    and one bad subkey would hide every other record of the key; so bytes that fail here come back undecoded, as
    hivemind does for ext codes it does not know, and corolla's record parsers skip them as malformed."""
    try:
        return loads(buf, DHT_LIMITS)
    except ValueError as e:
        # debug: a block key flooded with made-up subkeys would write one line per junk value on every read
        logger.debug(f"msgpack.dht_value_undecodable(bytes={len(buf)}): {e}")
        return bytes(buf)


def install_bounded_serializer() -> None:
    """Makes hivemind's `MSGPackSerializer.loads` (hence its DHT node, protocol, storage and validators) decode with
    `DHT_LIMITS`, returning undecodable bytes as they are. Idempotent; call before the DHT process forks so the
    child inherits it."""
    with _install_lock:
        if not bounded_serializer_installed():
            MSGPackSerializer.loads = classmethod(_bounded_serializer_loads)
            logger.debug("msgpack.bounded_serializer_installed()")


def bounded_serializer_installed() -> bool:
    current = MSGPackSerializer.__dict__["loads"]
    return isinstance(current, classmethod) and current.__func__ is _bounded_serializer_loads
