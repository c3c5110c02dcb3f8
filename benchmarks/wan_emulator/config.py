"""The shape of an emulated link (`LinkConfig`), one per proxy, applied to each direction separately.

Loss: the proxy sits above TCP, whose bytes are never lost, so a lost segment shows up as what TCP makes of it: a
retransmission stall. Each chunk the proxy forwards is, with probability `stall_probability`, held `stall_ms` longer,
and every later chunk of that direction waits behind it (head-of-line blocking, as TCP's in-order delivery does)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

MAX_DELAY_MS = 10_000.0
MAX_STALL_MS = 60_000.0
MIN_IN_FLIGHT_BYTES = 1024
MAX_IN_FLIGHT_BYTES = 1 << 30
MAX_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class LinkConfig:
    """One direction's impairments (both directions get the same ones, except the bandwidth when
    `reply_bandwidth_bytes_per_s` is set: the server->client direction's cap, for asymmetric links).

    delay_ms: one-way delay added to every chunk. jitter_ms: extra delay drawn uniformly in [0, jitter_ms] per chunk
    (never reorders: a chunk leaves no earlier than the one before it). bandwidth_bytes_per_s: token-bucket rate cap
    (None = unlimited) with a bucket of `burst_bytes`. stall_probability / stall_ms: see the module docstring.
    max_in_flight_bytes: a direction stops reading from its source while it holds more than this (back-pressure).
    chunk_bytes: the most bytes read (and so forwarded as one unit) at a time. seed: the jitter and stall draws."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_bytes_per_s: float | None = None
    reply_bandwidth_bytes_per_s: float | None = None
    burst_bytes: int = 64 * 1024
    stall_probability: float = 0.0
    stall_ms: float = 200.0
    max_in_flight_bytes: int = 4 << 20
    chunk_bytes: int = 64 * 1024
    seed: int | None = None
    # a chunk of at least `large_bytes` (None: none) is held its size at `large_bytes_per_s` more: a link (or a
    # server behind it) that crawls on big messages only (an inference session's prompts and replays, in proportion
    # to their tokens, not its one-token steps)
    large_bytes: int | None = None
    large_bytes_per_s: float = math.inf

    def __post_init__(self) -> None:
        for name, limit in (("delay_ms", MAX_DELAY_MS), ("jitter_ms", MAX_DELAY_MS), ("stall_ms", MAX_STALL_MS)):
            value = getattr(self, name)
            if not 0.0 <= value <= limit:
                raise ValueError(f"{name} must be in [0, {limit:g}], got {value}")
        if self.bandwidth_bytes_per_s is not None and not self.bandwidth_bytes_per_s > 0:
            raise ValueError(
                f"bandwidth_bytes_per_s must be > 0 (or None for unlimited), got {self.bandwidth_bytes_per_s}"
            )
        if self.reply_bandwidth_bytes_per_s is not None and not self.reply_bandwidth_bytes_per_s > 0:
            raise ValueError(
                f"reply_bandwidth_bytes_per_s must be > 0 (or None: as bandwidth_bytes_per_s), "
                f"got {self.reply_bandwidth_bytes_per_s}"
            )
        if not 0.0 <= self.stall_probability <= 1.0:
            raise ValueError(f"stall_probability must be in [0, 1], got {self.stall_probability}")
        if not 1 <= self.burst_bytes <= MAX_IN_FLIGHT_BYTES:
            raise ValueError(f"burst_bytes must be in [1, {MAX_IN_FLIGHT_BYTES}], got {self.burst_bytes}")
        if not MIN_IN_FLIGHT_BYTES <= self.max_in_flight_bytes <= MAX_IN_FLIGHT_BYTES:
            raise ValueError(
                f"max_in_flight_bytes must be in [{MIN_IN_FLIGHT_BYTES}, {MAX_IN_FLIGHT_BYTES}], "
                f"got {self.max_in_flight_bytes}"
            )
        if self.large_bytes is not None and not self.large_bytes >= 1:
            raise ValueError(f"large_bytes must be >= 1 (or None: no chunk is large), got {self.large_bytes}")
        if not self.large_bytes_per_s > 0:
            raise ValueError(f"large_bytes_per_s must be > 0 (inf: no crawl), got {self.large_bytes_per_s}")
        if not 1 <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}], got {self.chunk_bytes}")

    def for_direction(self, *, to_target: bool) -> LinkConfig:
        """This config as one direction applies it (the reply direction takes `reply_bandwidth_bytes_per_s`)."""
        if to_target or self.reply_bandwidth_bytes_per_s is None:
            return self
        return replace(self, bandwidth_bytes_per_s=self.reply_bandwidth_bytes_per_s, reply_bandwidth_bytes_per_s=None)

    def describe(self) -> str:
        rate = "unlimited" if self.bandwidth_bytes_per_s is None else f"{self.bandwidth_bytes_per_s:.0f} B/s"
        if self.reply_bandwidth_bytes_per_s is not None:
            rate += f" (replies {self.reply_bandwidth_bytes_per_s:.0f} B/s)"
        return (
            f"delay_ms={self.delay_ms:g} jitter_ms={self.jitter_ms:g} bandwidth={rate} "
            f"stall_probability={self.stall_probability:g} stall_ms={self.stall_ms:g}"
        )
