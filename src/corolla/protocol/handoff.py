"""Wire records of the graceful drain with KV hand-off (corolla <-> corolla only; stock peers never send these keys and
ignore them): a draining server marks its responses (`DRAINING_KEY`), exports a session's cache on its stream when
asked (`EXPORT_KEY` -> `KV_HEADER_KEY` and part messages), and its client relays the parts, unread, to a replacement
(`IMPORT_KEY`). The exchange and the canonical layout (per block K then V, `[B, kv_heads, position, head_dim]` in the
block dtype): docs/contracts.md's `handoff`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hivemind.proto import runtime_pb2

from corolla.protocol.bounded_msgpack import is_number
from corolla.protocol.codecs import STREAM_CHUNK_BYTES, split_for_streaming
from corolla.protocol.metadata import encode_metadata

DRAINING_KEY = "corolla.draining"  # response metadata: {"deadline_s": seconds left before the server cuts sessions}
EXPORT_KEY = "corolla.export_kv"  # request metadata (open stream): {} -> the server streams the session's KV
KV_HEADER_KEY = "corolla.kv"  # response metadata of the export's first message: a KvHeader or {"error": str}
IMPORT_KEY = "corolla.import_kv"  # first request metadata of a new stream: a KvHeader, parts follow

MAX_MESSAGE_BYTES = STREAM_CHUNK_BYTES  # buffer bytes per part message, both directions
# a part's serialized bytes besides its buffer: field tags and lengths, shape, dtype, compression, chunks (< 100 for
# a 4-d record); a relayed part message holds its uid and parts, nothing else (`part_message_fits`)
PART_OVERHEAD_BYTES = 256
MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class DrainNotice:
    """What a draining server tells the client with each response: seconds left before it ends the session."""

    deadline_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"deadline_s": float(self.deadline_s)}

    @classmethod
    def from_dict(cls, value: Any) -> DrainNotice:
        if not isinstance(value, Mapping):
            raise ValueError(f"{DRAINING_KEY} must be a map, got {type(value).__name__}")
        deadline = value.get("deadline_s")
        if not is_number(deadline) or not math.isfinite(deadline):
            raise ValueError(f"{DRAINING_KEY}['deadline_s'] must be a finite number, got {deadline!r:.100}")
        return cls(max(0.0, float(deadline)))


def step_response(seconds_left: float | None) -> runtime_pb2.ExpertResponse:
    """An inference step's response, its output not yet in it (the caller adds the record in place, to its `tensors`:
    no copy of it); from a draining server (`seconds_left` before it ends the session, None while it does not
    drain) with its `DrainNotice`."""
    if seconds_left is None:
        return runtime_pb2.ExpertResponse()
    notice = DrainNotice(seconds_left)
    return runtime_pb2.ExpertResponse(metadata=encode_metadata({DRAINING_KEY: notice.to_dict()}))


def _nonneg_int(source: Mapping[str, Any], key: str, *, low: int = 0) -> int:
    value = source.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"KV header {key!r} must be an int >= {low}, got {value!r:.100}")
    return value


@dataclass(frozen=True)
class KvHeader:
    """Announces an exported session cache: `position` tokens of `batch_size` rows over blocks `[start, end)`, sent
    as `num_messages` part messages holding `total_bytes` buffer bytes in all."""

    position: int
    batch_size: int
    start_block: int
    end_block: int
    num_messages: int
    total_bytes: int

    def __post_init__(self) -> None:
        if self.position < 1 or self.batch_size < 1 or not 0 <= self.start_block < self.end_block:
            raise ValueError(f"invalid KV header {self}")
        if self.num_messages < 1 or self.total_bytes < 1:
            raise ValueError(f"invalid KV header {self}: no data")
        # every message holds at most MAX_MESSAGE_BYTES, and all but the last of a tensor's parts are full, so a
        # cache of k tensors never needs more than ceil(bytes / max) + k messages
        if self.num_messages > self.max_parts:
            raise ValueError(f"KV header announces {self.num_messages} messages for {self.total_bytes} bytes")

    @property
    def max_parts(self) -> int:
        """The most parts the export holds: all but each tensor's last are full (`pack_messages`), so no more than
        ceil(bytes / max) + k for k tensors (an empty part is a few bytes on the wire and an object where it is read)."""
        return math.ceil(self.total_bytes / MAX_MESSAGE_BYTES) + 2 * (self.end_block - self.start_block)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, value: Any) -> KvHeader:
        """Parses a header from hostile metadata: ValueError for anything but the six non-negative ints."""
        if not isinstance(value, Mapping):
            raise ValueError(f"KV header must be a map, got {type(value).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: _nonneg_int(value, name, low=0 if name == "start_block" else 1) for name in names})


def export_error(value: Any) -> str | None:
    """The refusal reason if an export's first message says it cannot export, else None."""
    if isinstance(value, Mapping) and "error" in value:
        return str(value["error"])[:MAX_ERROR_CHARS]
    return None


def pack_messages(
    tensors: Iterable[runtime_pb2.Tensor], max_message_bytes: int = MAX_MESSAGE_BYTES
) -> list[list[runtime_pb2.Tensor]]:
    """Splits serialized tensors into parts and packs consecutive parts into messages of <= `max_message_bytes`
    buffer bytes each (one part per message where a part alone is that big)."""
    messages: list[list[runtime_pb2.Tensor]] = []
    current: list[runtime_pb2.Tensor] = []
    size = 0
    for tensor in tensors:
        for part in split_for_streaming(tensor, max_message_bytes):
            part_bytes = len(part.buffer)
            if current and size + part_bytes > max_message_bytes:
                messages.append(current)
                current, size = [], 0
            current.append(part)
            size += part_bytes
    if current:
        messages.append(current)
    return messages


def message_bytes(parts: Iterable[runtime_pb2.Tensor]) -> int:
    return sum(len(part.buffer) for part in parts)


def part_message_fits(message: runtime_pb2.ExpertRequest, buffer_bytes: int) -> bool:
    """Whether a relayed part message (`buffer_bytes`: its parts' buffers) holds nothing but its uid and parts, each
    within `PART_OVERHEAD_BYTES` beside its buffer: its parts keep the whole message alive until the import has them
    all, so nothing else may ride along (metadata, a part's long shape)."""
    allowed = buffer_bytes + len(message.uid.encode()) + 16 + PART_OVERHEAD_BYTES * len(message.tensors)
    return not message.metadata and message.ByteSize() <= allowed
