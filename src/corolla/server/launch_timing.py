"""When the runtime launches the next merged batch behind one that is running on the device: just before the device
is expected to finish the running one.

Launched at once (as soon as the running batch is launched), the next batch holds only the steps queued at that
instant, and every step that arrives later waits behind two forwards, the running one and the one launched ahead
of it. Launched only after the running one finished, the batch takes every step that came meanwhile, but the device
idles while the runtime's thread stages and launches it. Launched `lead` seconds before the expected end, it takes
nearly every step that came during the running forward and the device goes straight on to it. With clients that
step again as soon as they have their reply, a step's wait is what sets its session's pace, so one forward less of
waiting per step is that much more throughput at the same batch sizes.

`LaunchTiming` learns two figures, each an exponential moving average: a launched batch's device seconds (from the
waits for its results that actually blocked: those end when the device does) and the launcher's own seconds (the
host's staging and launch). It is pure bookkeeping driven by the runtime's thread (`Runtime._run`)."""

from __future__ import annotations

EWMA_WEIGHT = 0.2  # weight of the newest observation
BLOCKED_WAIT_S = 50e-6  # a wait for results at least this long blocked: it ended when the device finished
MARGIN_S = 150e-6  # launched this much earlier again than the learned launch time (the thread may be late)
MAX_DELAY_S = 0.05  # never holds a launch longer than this (a wrong estimate must not stall the device)


class LaunchTiming:
    """Says when to launch the batch behind a running one (see the module docstring)."""

    def __init__(self) -> None:
        self.device_s: float | None = None  # learned: a launched batch's seconds on the device
        self.launch_s: float | None = None  # learned: the launcher's own seconds
        self.num_held = 0  # launches held back to the expected end of the running batch

    def launched(self, seconds: float) -> None:
        """The launcher took `seconds` to queue a batch."""
        self.launch_s = _ewma(self.launch_s, seconds)

    def waited(self, *, device_s: float, wait_s: float) -> None:
        """A launched batch's results came `device_s` after its device work could start (its launch, or the end of
        the batch before it) and the runtime's thread waited `wait_s` for them. A wait that blocked ended with the
        device's work, so `device_s` is that work's length; one that did not only bounds it from above."""
        if wait_s >= BLOCKED_WAIT_S:
            self.device_s = _ewma(self.device_s, device_s)
        elif self.device_s is not None and device_s < self.device_s:
            self.device_s = device_s

    def launch_at(self, running_start_s: float) -> float | None:
        """When (a `time.perf_counter` value) to launch the batch behind one whose device work started at
        `running_start_s`; None: at once (nothing learned yet)."""
        if self.device_s is None or self.launch_s is None:
            return None
        lead_s = self.launch_s + MARGIN_S
        return running_start_s + min(MAX_DELAY_S, max(0.0, self.device_s - lead_s))


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * new
