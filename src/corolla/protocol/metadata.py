"""Request metadata (`ExpertRequest.metadata`): msgpack exactly as hivemind's `MSGPackSerializer` (tuples as ext
type 0x40), decoded within `bounded_msgpack.METADATA_LIMITS`, and typed, validated views of the keys Petals uses
(reference section 7.4). Unknown keys are kept aside."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from corolla.protocol import bounded_msgpack
from corolla.protocol.bounded_msgpack import METADATA_LIMITS, is_number

TUPLE_EXT_TYPE = bounded_msgpack.TUPLE_EXT_TYPE
MAX_METADATA_BYTES = METADATA_LIMITS.max_bytes  # metadata is a handful of keys; anything bigger is a bad request

_COMPRESSION_VALUES = frozenset(runtime_pb2.CompressionType.values())
# a session's, a step's or a next hop's peer id: Petals' and corolla's clients send uuid4s (36 chars) and base58 peer
# ids (~52); a server keeps up to 4096 step ids and 64 next hops of every session (a str may take 16 KiB otherwise)
MAX_ID_CHARS = 128


def encode_metadata(metadata: Mapping[str, Any]) -> bytes:
    """Encodes a dict the way Petals peers do (hivemind's MSGPackSerializer)."""
    return MSGPackSerializer.dumps(dict(metadata))


def decode_metadata(data: bytes) -> dict[str, Any]:
    """Decodes request metadata (or an `rpc_info` reply) within `METADATA_LIMITS`; empty bytes -> `{}`; anything
    but a str-keyed map, or over a limit (bytes, depth, lengths, items) -> ValueError naming the limit."""
    if not data:
        return {}
    value = bounded_msgpack.small_map(data, METADATA_LIMITS)  # a step's metadata: one C unpack, `loads`'s value
    if value is not None:
        return value
    if len(data) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is {len(data)} bytes, more than the limit of {MAX_METADATA_BYTES}")
    try:
        value = bounded_msgpack.loads(data, METADATA_LIMITS)
    except ValueError as e:
        raise ValueError(f"metadata rejected: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"metadata must be a map with str keys, got {type(value).__name__}")
    for key in value:  # (a loop, not all() over a generator: this runs for every step)
        if not isinstance(key, str):
            raise ValueError(f"metadata must be a map with str keys, got a {type(key).__name__} key")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get_str(source: Mapping[str, Any], key: str, default: str | None) -> str | None:
    value = source.get(key, default)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"metadata[{key!r}] must be a str, got {type(value).__name__}")
    return value


def _get_id(source: Mapping[str, Any], key: str) -> str | None:
    """metadata[key] as an id (None where absent): ValueError unless a str of at most `MAX_ID_CHARS`."""
    value = _get_str(source, key, None)
    if value is not None and len(value) > MAX_ID_CHARS:
        raise ValueError(f"metadata[{key!r}] is {len(value)} chars, more than MAX_ID_CHARS={MAX_ID_CHARS}")
    return value


def _get_nonneg_int(source: Mapping[str, Any], key: str) -> int | None:
    value = source.get(key)
    if value is None:
        return None
    if not _is_int(value) or value < 0:
        raise ValueError(f"metadata[{key!r}] must be an int >= 0, got {value!r:.100}")
    return value


def _get_finite(source: Mapping[str, Any], key: str, minimum: float = -math.inf) -> float:
    """metadata[key] as a float (0.0 where absent or None); ValueError unless a finite number >= `minimum`."""
    value = source.get(key)
    if value is None:
        return 0.0
    if not is_number(value) or not math.isfinite(value) or value < minimum:
        at_least = "" if minimum == -math.inf else f" >= {minimum:g}"
        raise ValueError(f"metadata[{key!r}] must be a finite number{at_least}, got {value!r:.100}")
    return float(value)


def _get_bool(source: Mapping[str, Any], key: str) -> bool:
    value = source.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"metadata[{key!r}] must be a bool, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class NextServer:
    """One hop of `next_servers`: where to push this step's outputs (`[peer_id_b58, session_id, start, end]`)."""

    peer_id: str
    session_id: str
    start: int
    end: int

    def to_list(self) -> list[Any]:
        return [self.peer_id, self.session_id, self.start, self.end]


def _get_next_servers(source: Mapping[str, Any]) -> tuple[NextServer, ...]:
    value = source.get("next_servers")
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"metadata['next_servers'] must be a list, got {type(value).__name__}")
    hops = []
    for item in value:
        if (
            not isinstance(item, (list, tuple))
            or len(item) != 4
            or not isinstance(item[0], str)
            or not isinstance(item[1], str)
            or len(item[0]) > MAX_ID_CHARS
            or len(item[1]) > MAX_ID_CHARS
            or not _is_int(item[2])
            or not _is_int(item[3])
            or not 0 <= item[2] < item[3]
        ):
            raise ValueError(
                f"metadata['next_servers'] items must be [peer_id: str, session_id: str, start: int, end: int] "
                f"with 0 <= start < end, ids of at most {MAX_ID_CHARS} chars, got {item!r:.200}"
            )
        hops.append(NextServer(*item))
    return tuple(hops)


def _get_output_compression(source: Mapping[str, Any]) -> tuple[int, ...] | None:
    value = source.get("output_compression")
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(_is_int(v) and v in _COMPRESSION_VALUES for v in value):
        raise ValueError(
            f"metadata['output_compression'] must be a list of CompressionType ints "
            f"{sorted(_COMPRESSION_VALUES)}, got {value!r:.200}"
        )
    return tuple(value)


_INFERENCE_KEYS = frozenset(
    {"session_id", "step_id", "max_length", "points", "alloc_timeout", "active_adapter", "args_structure",
     "start_from_position", "next_servers", "pushed"}
)  # fmt: skip
# a decode step as Petals' client sends it, and corolla's (which repeats the session's `points` and `active_adapter`)
_STEP_KEYS = frozenset({"session_id", "step_id", "points", "active_adapter", "start_from_position", "args_structure"})
_NOT_STEP_KEYS = _INFERENCE_KEYS - _STEP_KEYS  # known keys a decode step does not carry
_STR_OR_NONE = (str, type(None))
_FORWARD_KEYS = frozenset({"points", "active_adapter", "args_structure", "output_compression"})


@dataclass(frozen=True)
class InferenceRequestMetadata:
    """Metadata of one `rpc_inference` step (or an `rpc_push`). Wire key `alloc_timeout` maps to `alloc_timeout_s`.

    `max_length` is required on a session's first request only; the handler checks it against its own limit."""

    session_id: str | None = None
    step_id: str | None = None
    max_length: int | None = None
    points: float = 0.0
    alloc_timeout_s: float = 0.0
    active_adapter: str = ""
    args_structure: Any = None
    start_from_position: int | None = None
    next_servers: tuple[NextServer, ...] = ()
    pushed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # keys we don't know, kept for extensions

    @classmethod
    def from_dict(cls, source: Mapping[str, Any]) -> InferenceRequestMetadata:
        # (a dict, every decoded step's, is told by its class: the abstract base class's check is 0.1-0.2 us)
        if source.__class__ is not dict and not isinstance(source, Mapping):
            raise ValueError(f"metadata must be a dict, got {type(source).__name__}")
        if _NOT_STEP_KEYS.isdisjoint(source):
            # a decode step as a Petals or corolla client sends it: only these keys are checked (in the general path's
            # order: the same first error), every other field keeps its default; built without the frozen init's
            # object.__setattr__ per field (~2.5 us a step)
            get = source.get
            session_id, step_id, points = get("session_id"), get("step_id"), get("points")
            adapter, position = get("active_adapter"), get("start_from_position")
            # the usual values (msgpack's exact types) taken as they are; any other goes through the checks, in the
            # general path's order (the same value, or the same first error)
            if not (
                (session_id is None or (session_id.__class__ is str and len(session_id) <= MAX_ID_CHARS))
                and (step_id is None or (step_id.__class__ is str and len(step_id) <= MAX_ID_CHARS))
                and (points is None or (points.__class__ is float and math.isfinite(points)))
                and adapter.__class__ in _STR_OR_NONE
                and (position is None or (position.__class__ is int and position >= 0))
            ):
                session_id, step_id = _get_id(source, "session_id"), _get_id(source, "step_id")
                points, adapter = _get_finite(source, "points"), _get_str(source, "active_adapter", "")
                position = _get_nonneg_int(source, "start_from_position")
            step = object.__new__(cls)
            step.__dict__.update(
                _STEP_DEFAULTS,
                session_id=session_id,
                step_id=step_id,
                points=0.0 if points is None else points,
                active_adapter=adapter or "",
                args_structure=get("args_structure"),
                start_from_position=position,
                extra={} if _STEP_KEYS.issuperset(source) else {k: v for k, v in source.items() if k not in _STEP_KEYS},
            )
            return step
        return cls(
            session_id=_get_id(source, "session_id"),
            step_id=_get_id(source, "step_id"),
            max_length=_get_nonneg_int(source, "max_length"),
            points=_get_finite(source, "points"),
            alloc_timeout_s=_get_finite(source, "alloc_timeout", 0.0),
            active_adapter=_get_str(source, "active_adapter", "") or "",
            args_structure=source.get("args_structure"),
            start_from_position=_get_nonneg_int(source, "start_from_position"),
            next_servers=_get_next_servers(source),
            pushed=_get_bool(source, "pushed"),
            extra={k: v for k, v in source.items() if k not in _INFERENCE_KEYS},
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> InferenceRequestMetadata:
        return cls.from_dict(decode_metadata(data))

    def to_dict(self) -> dict[str, Any]:
        """Only the keys that are set, as a Petals client would send them."""
        return _set_keys(
            self.extra,
            session_id=self.session_id,
            step_id=self.step_id,
            max_length=self.max_length,
            points=self.points or None,
            alloc_timeout=self.alloc_timeout_s or None,
            active_adapter=self.active_adapter or None,
            args_structure=self.args_structure,
            start_from_position=self.start_from_position,
            next_servers=[hop.to_list() for hop in self.next_servers] or None,
            pushed=True if self.pushed else None,
        )


def _set_keys(extra: Mapping[str, Any], **keys: Any) -> dict[str, Any]:
    """`extra`, then the `keys` that are set (not None), in their order (a Petals client's order: the bytes follow)."""
    out = dict(extra)
    out.update((key, value) for key, value in keys.items() if value is not None)
    return out


# every field's default but `extra`'s (a new dict per instance), for the decode step's shortcut in `from_dict`
_STEP_DEFAULTS = {f.name: f.default for f in fields(InferenceRequestMetadata) if f.default is not MISSING}


@dataclass(frozen=True)
class ForwardRequestMetadata:
    """Metadata of `rpc_forward`/`rpc_backward` (and their stream variants)."""

    points: float = 0.0
    active_adapter: str = ""
    args_structure: Any = None
    output_compression: tuple[int, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, source: Mapping[str, Any]) -> ForwardRequestMetadata:
        if not isinstance(source, Mapping):
            raise ValueError(f"metadata must be a dict, got {type(source).__name__}")
        return cls(
            points=_get_finite(source, "points"),
            active_adapter=_get_str(source, "active_adapter", "") or "",
            args_structure=source.get("args_structure"),
            output_compression=_get_output_compression(source),
            extra={k: v for k, v in source.items() if k not in _FORWARD_KEYS},
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> ForwardRequestMetadata:
        return cls.from_dict(decode_metadata(data))
