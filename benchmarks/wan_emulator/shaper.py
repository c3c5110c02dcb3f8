"""When each chunk of one direction may leave the proxy: `Shaper.release_time(size, now)` applies the token bucket,
the delay and jitter (and a large chunk's extra delay), and the stalls, and never returns a time earlier than the previous chunk's (byte order holds
even under jitter: release = max(previous release, pass time + delay + jitter + stall)). Pure arithmetic on seconds
of a monotonic clock; no I/O, so unit tests drive it with a fake clock."""

from __future__ import annotations

import random

from benchmarks.wan_emulator.config import LinkConfig


class Shaper:
    """One direction's schedule. `config` may be swapped between chunks (`set_config`); the bucket keeps its level."""

    def __init__(self, config: LinkConfig):
        self.config = config
        self._rng = random.Random(config.seed)
        self._last_release_s = float("-inf")
        self._tokens = float(config.burst_bytes)
        self._tokens_at_s: float | None = None
        self.stalls = 0

    def set_config(self, config: LinkConfig) -> None:
        self.config = config
        self._tokens = min(self._tokens, float(config.burst_bytes))

    def _bucket_pass_time(self, size_bytes: int, now_s: float) -> float:
        """When a chunk of `size_bytes` arriving at `now_s` has paid for itself. The bucket may go into debt (a chunk
        larger than the bucket still passes, later), so a stream's long-run rate is exactly the configured one."""
        rate = self.config.bandwidth_bytes_per_s
        if rate is None:
            return now_s
        if self._tokens_at_s is not None and now_s > self._tokens_at_s:
            self._tokens = min(float(self.config.burst_bytes), self._tokens + (now_s - self._tokens_at_s) * rate)
        self._tokens_at_s = max(now_s, self._tokens_at_s or now_s)
        self._tokens -= size_bytes
        if self._tokens >= 0:
            return self._tokens_at_s
        return self._tokens_at_s + (-self._tokens) / rate

    def release_time(self, size_bytes: int, now_s: float) -> float:
        """The monotonic time (seconds) at which a chunk of `size_bytes` read at `now_s` is written onward."""
        c = self.config
        extra_s = c.delay_ms / 1000.0
        if c.jitter_ms > 0:
            extra_s += self._rng.uniform(0.0, c.jitter_ms) / 1000.0
        if c.large_bytes is not None and size_bytes >= c.large_bytes:
            extra_s += size_bytes / c.large_bytes_per_s
        if c.stall_probability > 0 and self._rng.random() < c.stall_probability:
            extra_s += c.stall_ms / 1000.0
            self.stalls += 1
        release = max(self._last_release_s, self._bucket_pass_time(size_bytes, now_s) + extra_s)
        self._last_release_s = release
        return release
