"""When a server re-announces before its update period: its free KV cache moved by a large part of its capacity since
the record it last stored. Records are otherwise up to an update period old (60 s) when read, and clients that read
them every period pile onto servers that announced room they no longer have (decision 0020). Rate-bounded: never
sooner than `min_interval_s` after the last announcement, so a busy server stores at most
update_period_s / min_interval_s times more records than Petals' heartbeat. Pure: the server's announcer and
`benchmarks.sim` both call `EarlyAnnounce.due`."""

from __future__ import annotations

from dataclasses import dataclass

EARLY_CHECK_PERIOD_S = 2.0  # how often the announcer compares its free cache with the one it announced


@dataclass(frozen=True)
class EarlyAnnounce:
    """min_change: the share of the server's cache capacity its free cache must have moved (either way);
    min_interval_s: the least time between two announcements (the rate bound)."""

    min_change: float = 0.10
    min_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.min_change <= 1:
            raise ValueError(f"min_change must be in (0, 1], got {self.min_change}")
        if not self.min_interval_s > 0:
            raise ValueError(f"min_interval_s must be > 0, got {self.min_interval_s}")

    def due(self, *, announced_left: int | None, left_now: int, capacity: int, since_last_s: float) -> bool:
        """Whether to announce now. announced_left: the `cache_tokens_left` of the last stored record (None: none
        stored); left_now: the free cache now; capacity: the most it can be (same unit); since_last_s: seconds since
        the last announcement."""
        if since_last_s < self.min_interval_s:
            return False
        if announced_left is None:
            return True
        return abs(left_now - announced_left) >= self.min_change * max(capacity, 1)


DEFAULT_EARLY_ANNOUNCE = EarlyAnnounce()
