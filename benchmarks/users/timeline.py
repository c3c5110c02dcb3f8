"""Where a step's time goes in the many-users bench (`benchmarks.users --timeline`): the directory the fronts (the
bench's own process, the handler processes) save their step timelines to (`server.step_timeline`), and the medians
and 90th percentiles of each part of a decode step over every saved stream (the server's part, the front's own part
before and after the core, the core's, the client's turnaround as the server sees it), also per process
(`timeline_by_process`); and where a row's
window goes beyond its timed steps (`window_breakdown`: the sessions' start and end spread, the steps' mean, the
untimed time)."""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common.measure import percentile
from corolla.server.front.step_timeline import BACK, IN, SENT, TIMELINE_ENV


def timeline_dir() -> Path | None:
    """Where this run's handler processes save their step timelines (`--timeline`), or None."""
    directory = os.environ.get(TIMELINE_ENV)
    return Path(directory) if directory else None


def saved_timeline_summary(directory: Path, sessions: int, wait_s: float = 5.0) -> dict[str, float]:
    """`timeline_summary` once every session's stream has been saved (a handler process saves a stream as it ends,
    after the client closed it), or after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        saved = sum(len(p.read_text().splitlines()) for p in directory.glob("timeline-*.jsonl"))
        if saved >= sessions:
            break
        time.sleep(0.05)
    return timeline_summary(directory)


TIMELINE_SKIP_STEPS = 2  # a stream's first steps (its prefill) are not decode steps


def timeline_summary(directory: Path) -> dict[str, float]:
    """Medians and 90th percentiles (ms) over every saved stream's decode steps (`server.step_timeline`): the server's
    part (request read to response written) and the client's turnaround as the server sees it (a response written to
    the next request read: the client's work, both transits and any wait of the front's loop to read); where the core's
    stamps are there too, the front's own part before and after the core (`handler_in`, `handler_out`) and the core's
    (`device_round_trip`: the runtime's queue and forward, a handler process's device channel)."""
    parts: dict[str, list[float]] = {
        "handler_in": [], "device_round_trip": [], "handler_out": [], "server_step": [], "client_turn": [],
    }  # fmt: skip
    for path in sorted(directory.glob("timeline-*.jsonl")):
        for rows in _decode_steps(path):
            for i, (t_in, sent, back, out) in enumerate(rows):
                if not out:
                    continue
                parts["server_step"].append((out - t_in) / 1e6)
                if i + 1 < len(rows):
                    parts["client_turn"].append((rows[i + 1][IN] - out) / 1e6)
                if sent and back:  # a handler process's step (one front: the device is in the same process)
                    parts["handler_in"].append((sent - t_in) / 1e6)
                    parts["device_round_trip"].append((back - sent) / 1e6)
                    parts["handler_out"].append((out - back) / 1e6)
    summary: dict[str, float] = {}
    for name, values in parts.items():
        summary[f"{name}_p50_ms"] = percentile(values, 0.5) if values else float("nan")
        summary[f"{name}_p90_ms"] = percentile(values, 0.9) if values else float("nan")
    summary["steps"] = float(len(parts["server_step"]))
    return summary


def _decode_steps(path: Path) -> Iterator[list[list[int]]]:
    """Each stream saved in one handler process's file: its decode steps' stamps (ns), prefill left out."""
    for line in path.read_text().splitlines():
        yield [r for r in json.loads(line)[TIMELINE_SKIP_STEPS:] if len(r) == 4]


def timeline_by_process(directory: Path) -> list[tuple[float, float]]:
    """Per handler process (one saved file each, in file-name order): the device channel's round trip p50 and its
    sessions' step as the server sees it (one request read to the next) p50, ms. A process whose replies always
    leave last after a merged forward shows a longer step than the others."""
    out: list[tuple[float, float]] = []
    for path in sorted(directory.glob("timeline-*.jsonl")):
        trips: list[float] = []
        cycles: list[float] = []
        for rows in _decode_steps(path):
            trips += [(r[BACK] - r[SENT]) / 1e6 for r in rows if r[SENT] and r[BACK]]
            cycles += [(b[IN] - a[IN]) / 1e6 for a, b in itertools.pairwise(rows)]
        if trips and cycles:
            out.append((percentile(trips, 0.5), percentile(cycles, 0.5)))
    return out


def window_breakdown(windows: list[tuple[float, float]], latencies: list[list[float]]) -> dict[str, float]:
    """Where a row's window went beyond its timed steps (the aggregate divides by the whole window, from the first
    session's start to the last one's end): how far apart the sessions' decode windows start and end, the timed
    steps' mean (a long tail shows here, not in the median), and each session's untimed time (its warm-up steps and
    the gaps between steps), ms. `windows`: (start, end) seconds per session; `latencies`: timed steps' ms."""
    if not windows:
        return {}
    flat = [x for lat in latencies for x in lat]
    untimed_ms = sum((end - start) * 1000 for start, end in windows) - sum(flat)
    return {
        "start_spread_ms": (max(w[0] for w in windows) - min(w[0] for w in windows)) * 1000,
        "end_spread_ms": (max(w[1] for w in windows) - min(w[1] for w in windows)) * 1000,
        "step_mean_ms": sum(flat) / len(flat) if flat else float("nan"),
        "untimed_ms_per_session": untimed_ms / len(windows),
    }
