"""Where a decode step's time goes inside a front, for the many-users bench: four `time.monotonic_ns` stamps per step
(request read, handed to the core, output back, response written), appended per stream to
`<dir>/timeline-<pid>.jsonl`. Off (a check of the port's `timeline` per step) unless `COROLLA_STEP_TIMELINE` names a
directory at import, or `start` names one (the bench's own process)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

TIMELINE_ENV = "COROLLA_STEP_TIMELINE"
MAX_STEPS_PER_STREAM = 1 << 16  # a longer stream keeps its first steps only
IN, SENT, BACK, OUT = range(4)  # the stamps of one step, in order

_dir = os.environ.get(TIMELINE_ENV)
DIRECTORY: Path | None = Path(_dir) if _dir else None


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


def start(directory: Path) -> None:
    """Stamps this process's streams opened from now on into `directory` (the env variable is read at import)."""
    global DIRECTORY
    DIRECTORY = directory


def open_stream() -> StreamTimeline | None:
    """A timeline for a stream about to be served (its port's `timeline`), or None when off."""
    return None if DIRECTORY is None else StreamTimeline()


def close_stream(timeline: StreamTimeline | None) -> None:
    if timeline is not None and DIRECTORY is not None:
        try:
            timeline.save(DIRECTORY)
        except OSError as e:
            logger.warning(f"step_timeline.save_failed(dir={DIRECTORY}): {e!r}")
