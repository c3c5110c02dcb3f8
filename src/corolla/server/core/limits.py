"""Fair-use limits of one server (`PeerLimits`, flags with defaults; a session's `SessionTimeouts`), the typed errors a limit raises and their
reason labels (`refusals.rejection_reason` maps any refusal to its label). Peers are keyed by their
authenticated libp2p id; every same-host unix-socket client counts as the one peer `LOCAL_PEER`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hivemind.p2p import P2PContext

from corolla.utils.errors import AllocationFailed

LOCAL_PEER = "local"  # every client of the same-host unix socket (one user: the socket dir is private to it)
KiB = 1 << 10
MiB = 1 << 20
T = TypeVar("T")


@dataclass(frozen=True)
class MessagePace:
    """The minimum rate of a message in flight (`PeerLimits.min_stream_rate_kib_s`): a message of n bytes, from when
    the server waits for it (a request) or writes it (a reply), may take `grace_s + n / min_bytes_per_s`."""

    min_bytes_per_s: float
    grace_s: float

    def allowed_s(self, nbytes: int) -> float:
        return self.grace_s + nbytes / self.min_bytes_per_s

    def __str__(self) -> str:
        """The rule as a refusal states it (the flags a peer's operator would look up)."""
        return f"min_stream_rate_kib_s={self.min_bytes_per_s / KiB:g} after {self.grace_s:g} s"


@dataclass(frozen=True)
class SessionTimeouts:
    """How long an inference session may wait for its next step (counted from its last token), live in all, and how
    long one request may take."""

    step_timeout_s: float
    session_timeout_s: float
    request_timeout_s: float


def _flag(default: T, help: str) -> T:
    """A `PeerLimits` field: its default and its flag's help (`add_limit_flags`)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class PeerLimits:
    """Caps that keep one peer (or a crowd of them) from starving the others. 0 or None disables a cap. Each field
    is also a flag of the same name (`add_limit_flags`)."""

    max_sessions_per_peer: int = _flag(64, "open inference sessions one peer may hold (0 = unlimited)")
    max_sessions_total: int = _flag(1024, "open inference sessions of all peers together (0 = unlimited)")
    max_kv_fraction_per_peer: float = _flag(0.5, "share of the KV cache one peer may reserve, in (0, 1]")
    session_idle_evict_s: float = _flag(
        60.0, "end a session idle this long (no token processed) when a new one needs its cache (0 = never)"
    )
    kv_promise_idle_s: float = _flag(
        5.0,
        "under memory pressure, give the unused promised cache of a session idle this long to a new one (it "
        "keeps what it holds and runs on; its next token asks the promise back; 0 = never)",
    )
    first_token_grace_s: float = _flag(
        2.0,
        "a session with no token processed yields at once under pressure when its opening request brought "
        "none, after its second step, or this long after it opened",
    )
    evict_wait_s: float = _flag(5.0, "how long a new session waits for evicted sessions to free their cache")
    # streamed requests' bytes received and not yet processed; None: derived from the span (`with_stream_defaults`),
    # a message may hold one step of max_batch_size tokens in float32 (hivemind would buffer any declared length),
    # a received message is briefly held twice while parsed (on the demo model a crowd of stalled streams then stays
    # within ~256 MiB of RSS)
    max_stream_message_bytes: int | None = _flag(
        None, "largest message of a streamed request (unset: max_batch_size x hidden x 4 + 1 MiB)"
    )
    max_stream_bytes_per_peer: int | None = _flag(
        None, "bytes of unfinished streamed requests of one peer (unset: max(96 MiB, 2 x message))"
    )
    max_stream_bytes_total: int | None = _flag(
        None,
        "bytes of unfinished streamed requests of all peers (unset: max(128 MiB, 3 x message)); its top message (at "
        "most half) only for peers within their fair share",
    )
    stream_idle_timeout_s: float = _flag(
        10.0, "cut a stream whose peer sends nothing for this long mid-message or mid-request (0 = off)"
    )
    # a message in flight, either way, must move at >= this rate once its grace is over: a trickle that stays under
    # every idle timeout otherwise holds a stream and its charged bytes for as long as it likes. 4 KiB/s is 1/8 of a
    # 256 kbit/s uplink; a decode step's message is done within the grace at any rate
    min_stream_rate_kib_s: float = _flag(
        4.0, "cut a stream whose message in flight moves slower than this (after min_stream_rate_grace_s; 0 = off)"
    )
    min_stream_rate_grace_s: float = _flag(
        10.0, "a message may take this long plus its bytes at min_stream_rate_kib_s to arrive (or to be taken)"
    )
    # a p2p inference stream waits up to the step timeout for its first request: each holds a p2pd stream and a socket.
    # As many as max_sessions_per_peer: a client (an API gateway, say) that opens all its sessions at once is not refused
    max_opening_streams_per_peer: int = _flag(
        64, "p2p inference streams of one peer whose session is not open yet; more are refused (0 = unlimited)"
    )
    # a KV hand-off import's parts are read into host memory whole before the cache is written (a session's whole cache:
    # up to its peer's KV share, which cheap identities multiply, on a card's cache larger than the host's memory); an
    # honest client moves at most its `kv_handoff_max_bytes` (1 GiB) a session
    max_import_bytes_per_peer: int = _flag(
        1 << 30, "bytes of KV hand-off imports one peer may have in flight (held in host memory); more are refused"
    )
    max_import_bytes_total: int = _flag(
        4 << 30, "bytes of KV hand-off imports of all peers in flight (held in host memory); more are refused"
    )
    max_forwards_per_peer: int = _flag(
        2, "concurrent forward/backward requests of one peer; the rest wait (0 = unlimited)"
    )
    forward_chunk_tokens: int = _flag(
        2048,
        "forwards longer than this run as one-block tasks of at most this many tokens; shorter ones as one "
        "task per block, merged with other clients' (0 = never chunked)",
    )

    def __post_init__(self) -> None:
        for name in ("max_sessions_per_peer", "max_sessions_total", "max_stream_message_bytes",
                     "max_stream_bytes_per_peer", "max_stream_bytes_total", "max_opening_streams_per_peer",
                     "max_import_bytes_per_peer", "max_import_bytes_total", "max_forwards_per_peer",
                     "forward_chunk_tokens"):  # fmt: skip
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = unlimited), got {getattr(self, name)}")
        if not 0 < self.max_kv_fraction_per_peer <= 1:
            raise ValueError(f"max_kv_fraction_per_peer must be in (0, 1], got {self.max_kv_fraction_per_peer}")
        for name in ("session_idle_evict_s", "kv_promise_idle_s", "first_token_grace_s", "evict_wait_s",
                     "stream_idle_timeout_s", "min_stream_rate_kib_s", "min_stream_rate_grace_s"):  # fmt: skip
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def message_pace(self) -> MessagePace | None:
        """How long a message may take on the wire (None: no minimum rate)."""
        if not self.min_stream_rate_kib_s:
            return None
        return MessagePace(self.min_stream_rate_kib_s * KiB, self.min_stream_rate_grace_s)

    def with_stream_defaults(self, step_bytes: int) -> PeerLimits:
        """These limits with each unset stream budget derived from `step_bytes` (the largest valid step)."""
        message = step_bytes + MiB if self.max_stream_message_bytes is None else self.max_stream_message_bytes
        per_peer = self.max_stream_bytes_per_peer
        per_peer = max(96 * MiB, 2 * message) if per_peer is None else per_peer
        total = max(128 * MiB, 3 * message) if self.max_stream_bytes_total is None else self.max_stream_bytes_total
        return dataclasses.replace(
            self, max_stream_message_bytes=message, max_stream_bytes_per_peer=per_peer, max_stream_bytes_total=total
        )


class LimitExceeded(AllocationFailed):
    """A fair-use limit refused the request; `reason` is its metrics label."""

    def __init__(self, message: str, *, reason: str):
        super().__init__(message)
        self.reason = reason


class PeerLimitExceeded(LimitExceeded):
    """One peer asked for more than its share (sessions, KV cache, stream bytes, concurrent forwards)."""


class ServerLimitExceeded(LimitExceeded):
    """All peers together reached a global cap and nothing could be evicted."""


class SessionEvicted(AllocationFailed):
    """This idle session was ended to free its KV cache for another user."""

    reason = "evicted"


class StreamStalled(ValueError):
    """The peer stopped sending in the middle of a streamed request."""

    reason = "stream_stalled"


class StreamTooSlow(StreamStalled):
    """A message in flight arrived slower than `min_stream_rate_kib_s` once its grace was over (a trickle: a byte every
    few seconds stays under the idle timeout)."""

    reason = "stream_too_slow"


class ReplyStalled(StreamStalled):
    """The peer took a reply's bytes slower than `min_stream_rate_kib_s` once its grace was over: what waits to go
    out is dropped and the stream cut (a peer that never reads would hold the reply, and the stream, for good)."""

    reason = "reply_stalled"


class DuplicateStep(ValueError):
    """A step whose `step_id` this session already processed (and whose output is no longer the last one)."""

    reason = "duplicate_step"


def peer_key(context: P2PContext | None) -> str:
    """The peer a request counts against: its authenticated libp2p id, or `LOCAL_PEER` for the unix socket (no
    context, or one without a remote peer)."""
    remote = context.remote_id if context is not None else None
    return LOCAL_PEER if remote is None else remote.to_base58()


def add_limit_flags(parser: Any) -> None:
    """Adds one `--<field>` flag per `PeerLimits` field to an argparse-like parser (default None = the field's)."""
    for f in dataclasses.fields(PeerLimits):
        kind = float if isinstance(f.default, float) else int  # None defaults: byte counts
        parser.add_argument(f"--{f.name}", type=kind, default=None, help=f"{f.metadata['help']} [{f.default}]")
