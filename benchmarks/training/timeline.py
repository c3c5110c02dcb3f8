"""Where a phase's time goes on the device: a CUDA-only `torch.profiler` trace of the bench process (its runtime
thread's launches and every kernel and copy of the device), summarized as the device's busy share, its idle gaps, the
device time of kernels launched by CUDA-graph replays (the decode steps) against the rest (training block calls and
copies), and the launching threads' CPU time in CUDA calls."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

GAP_MS_BOUNDS = (0.05, 0.2, 1.0, 5.0)  # idle gaps counted by length (ms): <= each bound, then above the last
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class Timeline:
    window_ms: float = 0.0
    device_busy_share: float = 0.0  # union of kernels and copies over the window
    graph_device_ms: float = 0.0  # kernels launched by CUDA-graph replays (decode steps)
    other_device_ms: float = 0.0  # kernels and copies launched one by one (training block calls, copies)
    idle_gaps: dict[str, list[float]] = field(default_factory=dict)  # "<= 0.2 ms": [count, total ms]
    launch_ms_by_thread: dict[str, float] = field(default_factory=dict)  # CUDA runtime calls' CPU ms per thread


@contextmanager
def traced(out_path: str | None, result: list[Timeline]):
    """Profiles the device (CUDA activity only) within the block; appends the summary to `result`, and writes the
    gzipped chrome trace to `out_path` if given."""
    # (CPU on a machine without CUDA: the dry run's plumbing; its summary finds no device events)
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as profile:
        yield
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        profile.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    if out_path:
        with gzip.open(out_path, "wt") as f:
            json.dump(trace, f)
    result.append(summarize(trace))


def summarize(trace: dict[str, Any]) -> Timeline:
    """The summary of a chrome trace (`traceEvents` with `ph == "X"`, `ts`/`dur` in microseconds)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    timeline = Timeline()
    if not device:
        return timeline
    graph_launches = {e.get("args", {}).get("correlation") for e in runtime if "GraphLaunch" in str(e.get("name", ""))}
    intervals = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device)
    start, end = intervals[0][0], max(b for _, b in intervals)
    busy, gaps = 0.0, []
    current_start, current_end = intervals[0]
    for a, b in intervals[1:]:
        if a > current_end:
            busy += current_end - current_start
            gaps.append(a - current_end)
            current_start, current_end = a, b
        else:
            current_end = max(current_end, b)
    busy += current_end - current_start
    timeline.window_ms = (end - start) / 1e3
    timeline.device_busy_share = busy / (end - start) if end > start else 0.0
    for e in device:
        ms = float(e["dur"]) / 1e3
        if e.get("args", {}).get("correlation") in graph_launches:
            timeline.graph_device_ms += ms
        else:
            timeline.other_device_ms += ms
    labels = [f"<= {b} ms" for b in GAP_MS_BOUNDS] + [f"> {GAP_MS_BOUNDS[-1]} ms"]
    timeline.idle_gaps = {label: [0, 0.0] for label in labels}
    for gap_us in gaps:
        gap_ms = gap_us / 1e3
        label = next((lab for lab, b in zip(labels, GAP_MS_BOUNDS, strict=False) if gap_ms <= b), labels[-1])
        timeline.idle_gaps[label][0] += 1
        timeline.idle_gaps[label][1] += gap_ms
    for e in runtime:
        thread = str(e.get("tid"))
        timeline.launch_ms_by_thread[thread] = timeline.launch_ms_by_thread.get(thread, 0.0) + float(e["dur"]) / 1e3
    return timeline
