"""Where a decode step's time goes inside a handler process, for the many-users bench: per step of a same-host
socket or direct-port stream, four `time.monotonic_ns` stamps (its request frame read, the step handed to the
device channel, the device's reply back, the response written), kept per stream and appended to
`<dir>/timeline-<pid>.jsonl` when the stream ends. Off unless `COROLLA_STEP_TIMELINE` names a directory when the
process imports this module; off, a step costs one module-level check.

`summarize` turns the saved streams into medians and 90th percentiles of the handler's own part before and after
the device, the device channel's round trip, and the client's turnaround as the server sees it (a response written
to the next request read: the client's work, both transits and any wait of the handler's loop to read)."""

from __future__ import annotations

import contextvars
import json
import os
import time
from pathlib import Path

TIMELINE_ENV = "COROLLA_STEP_TIMELINE"
MAX_STEPS_PER_STREAM = 1 << 16  # a longer stream keeps its first steps only
IN, SENT, BACK, OUT = range(4)  # the stamps of one step, in order
SKIP_FIRST_STEPS = 2  # a stream's first steps (its prefill) are not decode steps

_dir = os.environ.get(TIMELINE_ENV)
DIRECTORY: Path | None = Path(_dir) if _dir else None
_current: contextvars.ContextVar[StreamTimeline | None] = contextvars.ContextVar("step_timeline", default=None)


class StreamTimeline:
    """The stamps of one stream's steps (`rows`: one list of four per step, a stamp 0 where it was not taken)."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: list[list[int]] = []

    def request_read(self) -> None:
        if len(self.rows) < MAX_STEPS_PER_STREAM:
            self.rows.append([time.monotonic_ns(), 0, 0, 0])

    def stamp(self, phase: int) -> None:
        if self.rows and 0 < phase < 4 and not self.rows[-1][phase]:
            self.rows[-1][phase] = time.monotonic_ns()

    def save(self, directory: Path) -> None:
        with open(directory / f"timeline-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(self.rows) + "\n")


def open_stream() -> StreamTimeline | None:
    """A timeline for the calling task's stream (its steps' `stamp` calls find it), or None when off."""
    if DIRECTORY is None:
        return None
    timeline = StreamTimeline()
    _current.set(timeline)
    return timeline


def stamp(phase: int) -> None:
    """Stamps `phase` of the current step of the calling task's stream, if it has a timeline."""
    if DIRECTORY is not None and (timeline := _current.get()) is not None:
        timeline.stamp(phase)


def close_stream(timeline: StreamTimeline | None) -> None:
    if timeline is not None and DIRECTORY is not None:
        try:
            timeline.save(DIRECTORY)
        except OSError:
            pass


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(directory: Path) -> dict[str, float]:
    """Medians and 90th percentiles (ms) over every saved stream's decode steps that have all four stamps."""
    parts: dict[str, list[float]] = {"handler_in": [], "device_round_trip": [], "handler_out": [], "client_turn": []}
    for path in sorted(directory.glob("timeline-*.jsonl")):
        for line in path.read_text().splitlines():
            rows = [r for r in json.loads(line)[SKIP_FIRST_STEPS:] if len(r) == 4]
            for i, (t_in, sent, back, out) in enumerate(rows):
                if not (sent and back and out):
                    continue
                parts["handler_in"].append((sent - t_in) / 1e6)
                parts["device_round_trip"].append((back - sent) / 1e6)
                parts["handler_out"].append((out - back) / 1e6)
                if i + 1 < len(rows):
                    parts["client_turn"].append((rows[i + 1][IN] - out) / 1e6)
    summary: dict[str, float] = {}
    for name, values in parts.items():
        summary[f"{name}_p50_ms"] = _quantile(values, 0.5)
        summary[f"{name}_p90_ms"] = _quantile(values, 0.9)
    summary["steps"] = float(len(parts["device_round_trip"]))
    return summary
