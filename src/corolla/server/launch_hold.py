"""When the runtime launches the next merged forward behind the one the device is running (`Runtime.launch_ahead`):
just before the running one ends, not at once.

A batch launched behind a running forward takes only the steps queued at its launch; the sessions of the forward
that just finished come back one turn later (their replies out, the clients' next steps in: ~1-2 ms through the
handler processes on a GPU host) and wait for the launch after that. Launched at once, the next batch is popped
right after the finished forward's replies leave, when few of those sessions can be back, so the sessions split
into ~3-4 cohorts of small batches where the device could run ~2 large ones. Holding the pop until just before the
running forward's expected end lets every step that arrives meanwhile ride the next forward, while the device
still never idles: the hold ends the learned launch time (pop to launch returned), the learned wake-up delay of
the timed wait and a margin before that end.

The running forward's end is predicted from when its device work could start (the forward before it finished, or
its own launch returned, whichever is later) plus the device time of recent forwards (CUDA events:
`PendingBatch.device_s`); without device times (a CPU launcher) there is no hold. `LaunchHold` is bookkeeping
driven by the runtime's thread (`Runtime._run`); it never blocks by itself."""

from __future__ import annotations

from dataclasses import dataclass

EWMA_WEIGHT = 0.2  # weight of the newest observation


@dataclass(frozen=True)
class HoldSettings:
    """`enabled`: hold at all; `margin_s`: lead kept besides the learned launch and wake-up times;
    `max_fraction`: the longest hold, as a share of a forward."""

    enabled: bool = True
    margin_s: float = 100e-6
    max_fraction: float = 0.9

    def __post_init__(self) -> None:
        if not 0.0 <= self.margin_s <= 0.01:
            raise ValueError(f"launch hold margin must be in [0, 0.01] s, got {self.margin_s}")
        if not 0.0 <= self.max_fraction <= 1.0:
            raise ValueError(f"launch hold max_fraction must be in [0, 1], got {self.max_fraction}")


def _ewma(previous: float | None, observed: float) -> float:
    return observed if previous is None else previous + EWMA_WEIGHT * (observed - previous)


class LaunchHold:
    """Learns a forward's device time, a launch's host time and the timed wait's wake-up delay; says how long to
    hold the next launch (see the module docstring)."""

    def __init__(self, settings: HoldSettings | None = None):
        self.settings = settings if settings is not None else HoldSettings()
        self.forward_s: float | None = None  # a merged forward's device time (learned)
        self.launch_s: float | None = None  # from the end of a hold to the launch returning (learned)
        self.late_s: float | None = None  # how much later than asked a timed wait wakes (learned)
        self.num_holds = 0
        self.held_s = 0.0  # seconds held in all

    def finished(self, device_s: float | None) -> None:
        """A launched forward's device time (None: not measured)."""
        if device_s is not None and device_s > 0.0:
            self.forward_s = _ewma(self.forward_s, device_s)

    def launched(self, seconds: float) -> None:
        """A pop and launch took `seconds` of the runtime thread."""
        self.launch_s = _ewma(self.launch_s, max(0.0, seconds))

    def hold_s(self, *, now_s: float, previous_done_s: float, running_launched_s: float) -> float:
        """How long to wait before popping the next batch behind the running forward (0: pop now). The running
        forward was launched (its launch returned) at `running_launched_s`; the one before it finished at
        `previous_done_s` (perf_counter seconds)."""
        settings = self.settings
        if not settings.enabled or self.forward_s is None or self.launch_s is None:
            return 0.0
        expected_end_s = max(previous_done_s, running_launched_s) + self.forward_s
        hold_s = expected_end_s - self.launch_s - (self.late_s or 0.0) - settings.margin_s - now_s
        return min(hold_s, settings.max_fraction * self.forward_s) if hold_s > 0.0 else 0.0

    def woke(self, asked_s: float, slept_s: float) -> None:
        """A hold of `asked_s` returned after `slept_s` (a wake-up by a push or a stop is not learned from)."""
        self.num_holds += 1
        self.held_s += slept_s
        if slept_s >= asked_s:
            self.late_s = _ewma(self.late_s, slept_s - asked_s)
