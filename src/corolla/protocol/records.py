"""DHT records shared with Petals 2.x: `ServerState`, `ServerInfo` (stored as a `(state, throughput, extra)` tuple
under `"<prefix>.<i>"`/peer id), `ModelInfo` (under `"_petals.models"`/prefix) and the client-side span views."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

MODELS_INDEX_KEY = "_petals.models"
MAX_MODEL_BLOCKS = 4096  # no model has more layers; a record claiming more (e.g. 10**7) is refused, not iterated
MAX_SESSIONS_ACTIVE = 1 << 20  # far above what any server holds; a record claiming more is refused
MAX_TOKENS_SERVED = 1 << 62
MAX_NUM_MOVES = 1 << 20
# a record valid further ahead than this is nobody's (readers skip it; corolla DHT nodes refuse a signed one): servers
# re-announce every update_period_s and set 2x that, so a far expiration only keeps a ghost server alive (0133)
MAX_EXPIRATION_AHEAD_S = 24 * 3600.0
# a record is a few KiB (corolla stores at most 8 KiB, Petals' are smaller), but a reader decodes DHT values of up
# to 4 MiB: one that passed these would be kept in every reader's view (and read per hop by routing) while announced
MAX_INFO_STR_CHARS = 256  # public_name, version, torch_dtype, quant_type, each adapter's name, each next_pings peer
MAX_ADAPTERS = 64
MAX_NEXT_PINGS = 1024
# what the step rates mean (`inference_rps`, `forward_rps`: tokens/s of one block): a step of at most this many tokens
# is a decode step, timed as one (blocks / inference_rps, whatever its tokens); a longer one (a prompt, a replay) by its
# tokens (tokens x blocks / forward_rps). Clients time steps so (client.session.stalls), servers measure them so
# (server.core.step_rates)
DECODE_MAX_TOKENS = 8
RATE_FIELDS = ("inference_rps", "forward_rps")  # the step rates a server measures as it serves (decision 0165)
# corolla's optional load fields: left out of the tuple when None, so a record without them is what Petals writes
LOAD_FIELDS = ("sessions_active", "busy_fraction", "tokens_served", "num_moves", "moving_to")


class ServerState(IntEnum):
    OFFLINE = 0
    JOINING = 1
    ONLINE = 2


def _check_finite_rps(name: str, value: Any) -> float:
    # Petals uses `confloat(strict=True)`: ints and bools are rejected, only real floats pass.
    if not isinstance(value, float):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite float >= 0, got {value}")
    return value


def _check_nonneg_int(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_bounded_int(name: str, value: Any, limit: int) -> int | None:
    checked = _check_nonneg_int(name, value)
    if checked is not None and checked > limit:
        raise ValueError(f"{name} must be <= {limit}, got {checked}")
    return checked


def _check_fraction(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if not isinstance(value, float):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise ValueError(f"{name} must be a float in [0, 1], got {value}")
    return value


def _check_block_range(name: str, value: Any) -> tuple[int, int] | None:
    """A `[start, end)` pair of block indices (msgpack gives a list), 0 <= start < end <= MAX_MODEL_BLOCKS."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TypeError(f"{name} must be a [start, end) pair, got {value!r:.100}")
    start = _check_bounded_int(name, value[0], MAX_MODEL_BLOCKS)
    end = _check_bounded_int(name, value[1], MAX_MODEL_BLOCKS)
    assert start is not None and end is not None, "pair items are not None (checked as ints)"
    if end <= start:
        raise ValueError(f"{name} must have end > start, got {start}:{end}")
    return (start, end)


def _check_optional(name: str, value: Any, kind: type) -> Any:
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{name} must be {kind.__name__} or None, got {type(value).__name__}")
    return value


def _check_short(name: str, value: str) -> str:
    if len(value) > MAX_INFO_STR_CHARS:
        raise ValueError(f"{name} strings must be at most {MAX_INFO_STR_CHARS} characters, got {len(value)}")
    return value


@dataclass
class ServerInfo:
    """What a server announces for each block it holds; field names and types are Petals' exactly, plus corolla's
    optional load fields (`LOAD_FIELDS`: stock Petals peers ignore unknown keys, and their records lack them)."""

    state: ServerState
    throughput: float

    start_block: int | None = None
    end_block: int | None = None

    public_name: str | None = None
    version: str | None = None

    network_rps: float | None = None
    forward_rps: float | None = None
    inference_rps: float | None = None

    adapters: Sequence[str] = ()
    torch_dtype: str | None = None
    quant_type: str | None = None
    using_relay: bool | None = None
    cache_tokens_left: int | None = None
    next_pings: dict[str, float] | None = None

    sessions_active: int | None = None  # inference sessions open now
    busy_fraction: float | None = None  # share of the last announce period the server's device thread was busy
    tokens_served: int | None = None  # tokens its blocks processed since it started (every kind)
    num_moves: int | None = None  # rebalancing moves since it started
    # while it fetches the weights of the span it will move to and keeps serving its own: that span's [start, end)
    moving_to: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.state, bool) or not isinstance(self.state, int):
            raise TypeError(f"state must be an int, got {type(self.state).__name__}")
        self.state = ServerState(self.state)  # raises ValueError for unknown states
        self.throughput = _check_finite_rps("throughput", self.throughput)
        self.start_block = _check_nonneg_int("start_block", self.start_block)
        self.end_block = _check_nonneg_int("end_block", self.end_block)
        if self.start_block is not None and self.end_block is not None and self.end_block <= self.start_block:
            raise ValueError(f"end_block ({self.end_block}) must be > start_block ({self.start_block})")
        for name in ("network_rps", "forward_rps", "inference_rps"):
            if getattr(self, name) is not None:
                _check_finite_rps(name, getattr(self, name))
        for name in ("public_name", "version", "torch_dtype", "quant_type"):
            if _check_optional(name, getattr(self, name), str) is not None:
                _check_short(name, getattr(self, name))
        _check_optional("using_relay", self.using_relay, bool)
        self.cache_tokens_left = _check_nonneg_int("cache_tokens_left", self.cache_tokens_left)
        if isinstance(self.adapters, str) or not isinstance(self.adapters, Sequence):
            raise TypeError("adapters must be a sequence of strings")
        if not all(isinstance(a, str) for a in self.adapters):
            raise TypeError("adapters must be a sequence of strings")
        if len(self.adapters) > MAX_ADAPTERS:
            raise ValueError(f"adapters must name at most {MAX_ADAPTERS}, got {len(self.adapters)}")
        self.adapters = tuple(_check_short("adapters", a) for a in self.adapters)
        if self.next_pings is not None:
            if not isinstance(self.next_pings, Mapping):
                raise TypeError("next_pings must be a dict")
            if len(self.next_pings) > MAX_NEXT_PINGS:
                raise ValueError(f"next_pings must hold at most {MAX_NEXT_PINGS} entries, got {len(self.next_pings)}")
            pings = {}
            for peer, rtt in self.next_pings.items():
                if not isinstance(peer, str) or not isinstance(rtt, float) or not rtt >= 0:  # inf allowed, NaN not
                    raise ValueError(f"next_pings entries must be str -> float >= 0, got {peer!r:.80}: {rtt!r}")
                pings[_check_short("next_pings", peer)] = rtt
            self.next_pings = pings
        self.sessions_active = _check_bounded_int("sessions_active", self.sessions_active, MAX_SESSIONS_ACTIVE)
        self.busy_fraction = _check_fraction("busy_fraction", self.busy_fraction)
        self.tokens_served = _check_bounded_int("tokens_served", self.tokens_served, MAX_TOKENS_SERVED)
        self.num_moves = _check_bounded_int("num_moves", self.num_moves, MAX_NUM_MOVES)
        self.moving_to = _check_block_range("moving_to", self.moving_to)

    def to_tuple(self) -> tuple[int, float, dict[str, Any]]:
        extra = dataclasses.asdict(self)
        del extra["state"], extra["throughput"]
        for name in LOAD_FIELDS:
            if extra[name] is None:
                del extra[name]
        extra["adapters"] = tuple(self.adapters)
        return (int(self.state), self.throughput, extra)

    @classmethod
    def from_tuple(cls, source: Any) -> ServerInfo:
        """Parses a record as stored by corolla or Petals 2.x; unknown extra keys are ignored, 2-tuples accepted."""
        if not isinstance(source, (tuple, list)) or len(source) < 2:
            raise ValueError(f"ServerInfo record must be a tuple of 2 or 3 items, got {source!r:.200}")
        state, throughput = source[:2]
        extra = source[2] if len(source) > 2 else {}
        if not isinstance(extra, Mapping):
            raise TypeError(f"ServerInfo extra must be a dict, got {type(extra).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"state", "throughput"}
        kwargs = {k: v for k, v in extra.items() if k in known}
        return cls(state=state, throughput=throughput, **kwargs)


@dataclass
class ModelInfo:
    """Value of the `_petals.models` record for one DHT prefix."""

    num_blocks: int
    repository: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {self.num_blocks!r}")
        if self.num_blocks > MAX_MODEL_BLOCKS:
            raise ValueError(f"num_blocks must be <= {MAX_MODEL_BLOCKS}, got {self.num_blocks}")
        _check_optional("repository", self.repository, str)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, source: Any) -> ModelInfo:
        if not isinstance(source, Mapping):
            raise TypeError(f"ModelInfo must be a dict, got {type(source).__name__}")
        num_blocks: Any = source.get("num_blocks")  # hostile: checked in __post_init__
        return cls(num_blocks=num_blocks, repository=source.get("repository"))


@dataclass
class RemoteModuleInfo:
    """All servers announcing one block uid; keys are base58 peer ids."""

    uid: str
    servers: dict[str, ServerInfo] = field(default_factory=dict)


@dataclass
class RemoteSpanInfo:
    """One server's contiguous span `[start, end)` in block indices relative to the sequence's first uid."""

    peer_id: str
    start: int
    end: int
    server_info: ServerInfo

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def state(self) -> ServerState:
        return self.server_info.state

    @property
    def throughput(self) -> float:
        return self.server_info.throughput
