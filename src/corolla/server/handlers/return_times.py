"""How long a device channel's sessions take to come back: from a step's result (the runtime thread queues its
reply, `frame_steps.FrameIntake`) to the same session's next step reaching the intake thread, per session.

This is the turn the device cannot see inside: the reply's way out through the handler process, the client's
own step, and the next request's way back in. Whether a forward's sessions are back before the next forward
launches (and so ride in it, instead of one forward later) depends on it. Kept as a fixed histogram of 50 us
buckets up to 20 ms (then one overflow bucket); `done` runs in the runtime thread and `arrived` in the intake
thread, one dict operation each. A session's entry is dropped when its channel ends it (`forget`)."""

from __future__ import annotations

from collections.abc import Iterable

BUCKET_S = 50e-6  # the histogram's bucket width
NUM_BUCKETS = 400  # up to 20 ms; later returns land in the overflow bucket
# sessions awaited at once; past it the awaited ones are dropped (a step's result that came after its session was
# forgotten leaves an entry behind: this bounds them)
MAX_PENDING = 1 << 16


class ReturnTimes:
    """One channel's (or several channels' merged) return times; see the module docstring."""

    def __init__(self, counts: list[int] | None = None) -> None:
        self._done_at: dict[int, float] = {}  # session handle -> when its last step's result was queued (seconds)
        if counts is not None and len(counts) != NUM_BUCKETS + 1:
            raise ValueError(f"a return-time histogram has {NUM_BUCKETS + 1} buckets, got {len(counts)}")
        # the last bucket: NUM_BUCKETS x BUCKET_S or more
        self.counts = list(counts) if counts is not None else [0] * (NUM_BUCKETS + 1)

    def done(self, handle: int, now_s: float) -> None:
        """A step of session `handle` got its result at `now_s` (`time.perf_counter()`)."""
        if len(self._done_at) >= MAX_PENDING:
            self._done_at.clear()
        self._done_at[handle] = now_s

    def arrived(self, handle: int, now_s: float) -> None:
        """The next step of session `handle` reached the intake at `now_s`: counted if its previous one was timed."""
        done_s = self._done_at.pop(handle, None)
        if done_s is None:
            return
        self.counts[min(NUM_BUCKETS, max(0, int((now_s - done_s) / BUCKET_S)))] += 1

    def forget(self, handle: int) -> None:
        """Session `handle` ended."""
        self._done_at.pop(handle, None)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def quantile_s(self, q: float) -> float | None:
        """The `q`-quantile's bucket's upper edge in seconds (None before any return; 0 < q <= 1)."""
        if not 0.0 < q <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {q}")
        total = self.count
        if total == 0:
            return None
        rank, seen = q * total, 0
        for index, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                return (index + 1) * BUCKET_S
        return (NUM_BUCKETS + 1) * BUCKET_S

    def share_within(self, limit_s: float) -> float | None:
        """The share of returns shorter than `limit_s` (whole buckets below it; None before any return)."""
        total = self.count
        if total == 0:
            return None
        return sum(self.counts[: min(NUM_BUCKETS, int(limit_s / BUCKET_S))]) / total

    @classmethod
    def merged(cls, parts: Iterable[ReturnTimes]) -> ReturnTimes:
        """One histogram of several channels' counts (their pending sessions are not carried)."""
        total = [0] * (NUM_BUCKETS + 1)
        for part in parts:
            total = [a + b for a, b in zip(total, part.counts, strict=True)]
        return cls(total)

    def minus(self, earlier: list[int]) -> ReturnTimes:
        """The returns counted since `earlier` (a copy of `counts` taken then)."""
        return ReturnTimes([a - b for a, b in zip(self.counts, earlier, strict=True)])
