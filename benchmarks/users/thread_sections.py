"""One thread's CPU inside named functions (`--sections` of `benchmarks.users.device_cpu`): each function is wrapped
for the time of a `with` block, and a call made by the watched thread adds its thread CPU clock (inclusive: a
section called inside another counts in both) and one call. A wrapper costs a few hundred ns a call, so only
functions called a few times per forward are watched; unlike cProfile, nothing is paid per row beyond what the
code itself does (cProfile charged each per-row `list.append` of `merge_rows` ~10x its cost, decision 0124), and it
watches one thread on every Python (Python 3.12's cProfile records all threads, decision 0119)."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from corolla.engine import batcher, graph_decode, span_engine
from corolla.server.core import runtime

# the runtime thread's decode path, per forward: (owner, attribute), labelled "Owner.attribute" (a module's function
# by its name)
DECODE_PATH: tuple[tuple[Any, str], ...] = (
    (runtime.TaskQueue, "pop_batch"), (runtime.TaskQueue, "wait_for_pushes"), (runtime.Runtime, "_launch"),
    (runtime.Runtime, "_hold"), (runtime.Runtime, "_finish"), (runtime.Runtime, "_wait"),
    (runtime.Runtime, "_gathered"), (runtime.Runtime, "_complete"), (runtime.Runtime, "_account"),
    (span_engine.SpanEngine, "can_launch"), (span_engine.SpanEngine, "launch_decode"),
    (graph_decode, "merge_rows"), (graph_decode, "stage_hidden_bytes"), (graph_decode, "stage_row_inputs"),
    (graph_decode, "advance_lengths"), (batcher.PendingSteps, "wait"), (graph_decode.PendingDecode, "output_bytes"),
)  # fmt: skip


class Sections:
    """Thread CPU seconds and calls per section, of the thread named `thread_name` only."""

    def __init__(self, thread_name: str):
        self.thread_name = thread_name
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        seconds, calls, name = self.seconds, self.calls, self.thread_name

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name != name:
                return fn(*args, **kwargs)
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += time.thread_time() - start
                calls[label] += 1

        return timed

    def per(self, count: int) -> dict[str, dict[str, float]]:
        """Each section's microseconds and calls per `count` (e.g. forwards), the costliest first."""
        count = max(count, 1)
        return {
            label: {"us": round(1e6 * s / count, 1), "calls": round(self.calls[label] / count, 2)}
            for label, s in sorted(self.seconds.items(), key=lambda item: item[1], reverse=True)
        }


def _label(owner: Any, attribute: str) -> str:
    return f"{getattr(owner, '__name__', owner)}.{attribute}".removeprefix("corolla.engine.graph_decode.")


@contextlib.contextmanager
def watched(sections: Sections, functions: Sequence[tuple[Any, str]] = DECODE_PATH) -> Iterator[Sections]:
    """Wraps `functions` (where the callers look them up at call time: class attributes, module globals) while the
    block runs; puts the originals back on exit."""
    originals = [(owner, attribute, inspect.getattr_static(owner, attribute)) for owner, attribute in functions]
    try:
        for owner, attribute, _ in originals:
            setattr(owner, attribute, sections.wrap(getattr(owner, attribute), _label(owner, attribute)))
        yield sections
    finally:
        for owner, attribute, original in originals:  # (as they were: a staticmethod stays one)
            setattr(owner, attribute, original)
