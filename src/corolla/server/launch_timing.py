"""When the runtime launches the next merged batch behind one that is running on the device: just before the device
is expected to finish the running one.

Launched at once (as soon as the running batch is launched), the next batch holds only the steps queued at that
instant, and every step that arrives later waits behind two forwards, the running one and the one launched ahead
of it. Launched only after the running one finished, the batch takes every step that came meanwhile, but the device
idles while the runtime's thread stages and launches it. Launched `lead` seconds before the expected end, it takes
nearly every step that came during the running forward and the device goes straight on to it. With clients that
step again as soon as they have their reply, a step's wait is what sets its session's pace, so one forward less of
waiting per step is that much more throughput at the same batch sizes.

`LaunchTiming` learns two figures, each an exponential moving average: a launched batch's seconds on the device
(timed by the device itself, `PendingBatch.device_seconds`: a host clock would count the runtime's own hold in) and
the launcher's own seconds (the host's staging and launch). Where the launcher does not time its batches, the next
one is launched at once. It is pure bookkeeping driven by the runtime's thread (`Runtime._run`)."""

from __future__ import annotations

EWMA_WEIGHT = 0.2  # weight of the newest observation
MARGIN_S = 150e-6  # launched this much earlier again than the learned launch time (the thread may wake late)
MAX_HOLD_S = 0.02  # never holds a launch longer than this (a wrong estimate must not stall the device)


class LaunchTiming:
    """Says when to launch the batch behind a running one (see the module docstring)."""

    def __init__(self) -> None:
        self.device_s: float | None = None  # learned: a launched batch's seconds on the device
        self.launch_s: float | None = None  # learned: the launcher's own seconds
        self.num_held = 0  # launches held back to the expected end of the running batch

    def launched(self, seconds: float) -> None:
        """The launcher took `seconds` to queue a batch."""
        self.launch_s = _ewma(self.launch_s, seconds)

    def ran(self, device_s: float | None) -> None:
        """A launched batch ran `device_s` seconds on the device (None: not timed)."""
        if device_s is not None and device_s >= 0.0:
            self.device_s = _ewma(self.device_s, device_s)

    def launch_at(self, running_start_s: float) -> float | None:
        """When (a `time.perf_counter` value) to launch the batch behind one whose device work started at about
        `running_start_s`; None: at once (nothing learned yet)."""
        if self.device_s is None or self.launch_s is None:
            return None
        lead_s = self.launch_s + MARGIN_S
        return running_start_s + min(MAX_HOLD_S, max(0.0, self.device_s - lead_s))


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * new
