"""Timing helpers for the benchmark: medians of host-timed synchronous calls, CUDA-event timing, the device's
measured copy bandwidth (bytes read plus bytes written), and threads' CPU time (a thread's, a function's)."""

from __future__ import annotations

import collections
import functools
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: torch.device | None = None) -> None:
    """Waits for `device`'s queued work (None: the current CUDA device, when there is one; a CPU device: nothing)."""
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def thread_cpu_s(thread: threading.Thread | None) -> float:
    """CPU seconds `thread` (alive) used so far (its own clock: host work, not its waits)."""
    assert thread is not None and thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def cpu_timed(
    original: Any, label: str, counter: Callable[[], collections.Counter[str]], on: Callable[[], bool]
) -> Any:
    """`original` (a function or a classmethod) wrapped to add the calling thread's CPU nanoseconds in each call
    (inclusive) to `counter()[label]` while `on()`."""
    is_class = isinstance(original, classmethod)
    function = original.__func__ if is_class else original

    @functools.wraps(function)
    def timed(*args: object, **kwargs: object) -> object:
        if not on():
            return function(*args, **kwargs)
        began = time.thread_time_ns()
        try:
            return function(*args, **kwargs)
        finally:
            counter()[label] += time.thread_time_ns() - began

    return classmethod(timed) if is_class else timed


def host_times_ms(
    fn: Callable[[], object], iters: int, *, warmup: int = 2, device: torch.device | None = None
) -> list[float]:
    """Wall-clock milliseconds of `iters` calls of `fn` (each followed by a synchronize of `device`)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1000)
    return times


def host_median_ms(fn: Callable[[], object], iters: int, device: torch.device | None = None) -> float:
    """Median wall-clock milliseconds of `iters` synchronized calls of `fn`, no warm-up calls."""
    return statistics.median(host_times_ms(fn, iters, warmup=0, device=device))


def event_median_ms(fn: Callable[[], object], iters: int, *, warmup: int = 3) -> float:
    """Median device milliseconds of `fn` measured with CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def copy_bandwidth_bytes_per_s(device: torch.device, size_bytes: int = 2 << 30) -> float:
    """Device-to-device copy rate counting bytes read plus bytes written (as the issue's anchors do)."""
    n = size_bytes // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = event_median_ms(lambda: dst.copy_(src), 10)
    return 2 * size_bytes / (ms / 1000)


def matmul_tflops(device: torch.device, n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = event_median_ms(lambda: a @ b, 10)
    return 2 * n**3 / (ms / 1000) / 1e12
