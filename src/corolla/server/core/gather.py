"""The runtime's gather rule (docs/decisions/0009, 0002): after a merged forward, wait briefly for its sessions'
next steps before popping the next batch, so that sessions which stepped together keep stepping together instead of
splitting into cohorts that alternate.

The device thread waits until `quantile` of the finished forward's own sessions are back (`TaskQueue.watch` counts
them by session, not any step pushed after: with forwards launched back to back, the late sessions of the forward
before would read as this one's) or `fraction` of that forward's time has passed. The rule learns the time those
sessions take to come back and does not wait while it is longer than the budget (WAN clients never idle the device);
an observation counts for at most `MAX_RETURN_FORWARDS` forwards, so a pause between turns cannot keep it from
holding once the turns resume. The same learned return decides whether a batch queued behind a running forward
launches at once or as that forward is about to end (`holds_launch`): while sessions come back within a forward,
holding merges them into one forward of many rows.

`GatherRule` is pure bookkeeping driven by the runtime's thread (`Runtime._run`); it never blocks by itself."""

from __future__ import annotations

import math
from dataclasses import dataclass

EWMA_WEIGHT = 0.2  # weight of the newest observation of a learned time (`ewma`)
MAX_RETURN_FORWARDS = 2.0  # an observed return counts for at most this many of the last forward's seconds


def ewma(previous: float | None, observed: float) -> float:
    """A learned time after one more observation (the first observation stands alone): the runtime thread's
    estimates of return times, forwards' device seconds and launches' seconds."""
    return observed if previous is None else previous + EWMA_WEIGHT * (observed - previous)


@dataclass(frozen=True)
class GatherSettings:
    """`fraction`: the longest wait, as a fraction of the finished forward's seconds (0 disables the rule);
    `quantile`: the share of its sessions waited for."""

    fraction: float = 0.5
    quantile: float = 0.875

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"gather fraction must be in [0, 1], got {self.fraction}")
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"gather quantile must be in (0, 1], got {self.quantile}")


@dataclass
class _Cohort:
    """The sessions of one finished merged forward, on their way back."""

    finished_at_s: float
    seq: int  # steps pushed before it finished: the wait ends once `target` more were pushed
    target: int  # arrivals waited for
    budget_s: float


@dataclass(frozen=True)
class GatherWait:
    """Wait until `num_pushed` steps were pushed in all, at most `timeout_s`."""

    num_pushed: int
    timeout_s: float


class GatherRule:
    """Decides the wait before each pop and learns the clients' return time (see the module docstring)."""

    def __init__(self, settings: GatherSettings):
        self.settings = settings
        self.return_s: float | None = None  # learned: a finished forward's `quantile`-th own session back, s after it
        self.forward_s: float | None = None  # the last merged forward's seconds (of 2 steps or more)
        self._cohort: _Cohort | None = None
        self.num_skipped = 0  # cohorts not waited for (their return takes longer than the budget)

    def finished(self, *, size: int, forward_s: float, now_s: float, num_pushed: int) -> int | None:
        """A merged batch of `size` steps finished at `now_s` after `forward_s` seconds; `num_pushed` steps were
        pushed so far. Returns how many of its own sessions to watch for (`TaskQueue.watch`; None: no cohort).
        Steps, not tasks: a device channel's frame of steps is one task (`Task.steps`), its sessions still arrive
        one by one."""
        if size < 2 or self.settings.fraction <= 0.0:
            self._cohort = None
            return None
        self.forward_s = forward_s
        if self.return_s is not None:  # kept within MAX_RETURN_FORWARDS of this forward (see `_learn`)
            self.return_s = min(self.return_s, MAX_RETURN_FORWARDS * forward_s)
        target = max(1, math.ceil(self.settings.quantile * size))
        self._cohort = _Cohort(now_s, num_pushed, target, self.settings.fraction * forward_s)
        return target

    def learn(self, returns: list[tuple[float, float]], unreturned_s: float | None) -> None:
        """What came back since the last call (`TaskQueue.take_returns`): `returns` as (finished, back) times of
        watched forwards (the `target`-th of their own sessions back), exact; `unreturned_s`: how long a forward
        that never came back was waited for, a lower bound, learned only where it raises the estimate."""
        for finished_s, back_s in returns:
            self._learn(back_s - finished_s)
        if unreturned_s is not None and (self.return_s is None or unreturned_s > self.return_s):
            self._learn(unreturned_s)

    def wait(self, now_s: float, num_pushed: int) -> GatherWait | None:
        """The wait before the next pop, or None (no cohort, already back, or it would not come back in time)."""
        cohort = self._cohort
        if cohort is None or num_pushed >= cohort.seq + cohort.target:
            return None
        if self.return_s is not None and self.return_s > cohort.budget_s:
            self.num_skipped += 1
            return None
        timeout_s = cohort.finished_at_s + cohort.budget_s - now_s
        if timeout_s <= 0:
            return None
        return GatherWait(cohort.seq + cohort.target, timeout_s)

    def holds_launch(self) -> bool:
        """Whether a batch queued behind the running merged forward waits for its end (see the module docstring):
        while the learned return time is shorter than a forward (never before both are known, or with the rule
        off)."""
        return self.return_s is not None and self.forward_s is not None and self.return_s < self.forward_s

    def _learn(self, observed_s: float) -> None:
        observed_s = max(0.0, observed_s)
        if self.forward_s is not None:
            observed_s = min(observed_s, MAX_RETURN_FORWARDS * self.forward_s)
        self.return_s = ewma(self.return_s, observed_s)
