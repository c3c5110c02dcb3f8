"""What the runtime executes: a `Task` (a callable plus its priority, size and merge identity) and the
`TaskQueue` that orders pending tasks and picks the next batch (most urgent first, oldest first within a priority),
and how a task's result is handed back: a future resolved inside its own event loop, or a callback task's `on_done`
run in the thread that ran it, then its batch's flushes (`call_back`, `deliver`, `resolve_all`)."""

from __future__ import annotations

import asyncio
import heapq
import threading
import time
from collections import deque
from collections.abc import Callable, Container, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Protocol

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

# Lower is more urgent (same convention as the reference's prioritizer: inference 1.0, everything else 2.0).
PRIORITY_INFERENCE: float = 1.0
PRIORITY_FORWARD: float = 2.0
PRIORITY_BACKWARD: float = 2.0

KIND_GENERIC = "generic"
PUSH_TIMES_KEPT = 4096  # push times remembered for the runtime's gather rule (server.gather)
KIND_INFERENCE = "inference"
KIND_FORWARD = "forward"
KIND_BACKWARD = "backward"


@dataclass(eq=False, slots=True)  # built per decode step: slots make it ~0.5 us cheaper
class Task:
    """One unit of device work. `fn()` runs it alone; tasks with the same `(kind, merge_key)` may instead be handed
    together to a batch executor registered for `kind` (continuous batching), which reads their `payload`s."""

    fn: Callable[[], Any]
    priority: float
    size_tokens: int
    future: asyncio.Future | None  # resolved in `loop`; None for a callback task (`on_done`)
    loop: asyncio.AbstractEventLoop | None
    kind: str = KIND_GENERIC
    merge_key: Hashable | None = None
    payload: Any = None
    submitted_at: float = field(default_factory=time.monotonic)
    seq: int = 0
    # a callback task (no event loop): `on_done(result, error)` runs in the thread that ran the task, then
    # `flush()` once per distinct flush of the batch it ran in (a device channel sends one reply frame per batch)
    on_done: Callable[[Any, BaseException | None], None] | None = None
    flush: Callable[[], None] | None = None
    # the steps (sessions' rows) it carries: 1, or a device channel frame's decode steps in one task; the runtime's
    # counters, the gather rule and `KindStats` count these, not tasks
    steps: int = 1

    @property
    def sort_key(self) -> tuple[float, float, int]:
        return (self.priority, self.submitted_at, self.seq)

    @property
    def abandoned(self) -> bool:
        """True once the caller gave up on the result (its future was cancelled); a callback task never is."""
        return self.future is not None and self.future.done()


@dataclass(frozen=True)
class KindStats:
    """Totals for one task kind since the runtime started: batches run, steps in them (`Task.steps`: a frame task
    counts its steps), seconds spent running them as the runtime thread sees it (from a launch, or the end of the
    batch before it, to the results in hand: it includes any time the thread was late to collect them), and, for
    batches whose device time was measured on the device (`PendingBatch.device_s`), that time and their count."""

    batches: int = 0
    tasks: int = 0  # steps
    busy_s: float = 0.0
    device_s: float = 0.0  # the device's own seconds on the `device_timed` batches
    device_timed: int = 0

    def since(self, earlier: KindStats) -> KindStats:
        return KindStats(
            self.batches - earlier.batches, self.tasks - earlier.tasks, self.busy_s - earlier.busy_s,
            self.device_s - earlier.device_s, self.device_timed - earlier.device_timed,
        )  # fmt: skip

    def plus(self, num_steps: int, elapsed_s: float, device_s: float | None = None) -> KindStats:
        """These totals and one more batch of `num_steps` steps."""
        timed = device_s is not None
        return KindStats(
            self.batches + 1, self.tasks + num_steps, self.busy_s + elapsed_s,
            self.device_s + (device_s or 0.0), self.device_timed + timed,
        )  # fmt: skip

    @property
    def tasks_per_batch(self) -> float:
        """Mean steps merged into one forward (1.0 where nothing merges)."""
        return self.tasks / self.batches if self.batches else 0.0


class PendingBatch(Protocol):
    """A batch a launcher queued on the device: `wait()` (once, in the runtime's thread) gives one result per task
    (an exception instance fails only that task); raising fails the whole batch."""

    def wait(self) -> Sequence[object]: ...

    @property
    def device_s(self) -> float | None:
        """Once waited for: the device's own seconds on the batch (events recorded on its stream before its first
        copy in and after its last copy out), or None where not measured."""


# Queues a batch on the device and returns at once, or returns None (nothing done: the batch runs through the
# kind's executor instead); raising fails the whole batch.
BatchLauncher = Callable[[list[Task]], PendingBatch | None]


@dataclass(eq=False)
class LaunchedBatch:
    """A batch queued on the device by its launcher (`handle`), or whose launch failed (`error`)."""

    batch: list[Task]
    handle: PendingBatch | None
    error: BaseException | None
    started_s: float  # perf_counter at the launch
    results: list[tuple[Any, BaseException | None]] | None = None  # once waited for
    elapsed_s: float = 0.0  # its busy seconds, once waited for


class TaskQueue:
    """Thread-safe priority queue of pending tasks: the event loop pushes, the device thread pops batches."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, float, int, Task]] = []
        self._cond = threading.Condition()
        self._seq = 0  # tasks pushed (their order)
        self._steps = 0  # steps pushed (`Task.steps` summed): what the gather rule counts
        self._closed = False
        self._push_times: deque[float] = deque(maxlen=PUSH_TIMES_KEPT)  # of the last steps pushed, oldest first
        # steps pushed in all that the consumer waits for in `wait_for_pushes` (0 otherwise: any push wakes it); a
        # push short of it does not wake the consumer only to find too few and wait again
        self._wanted = 0
        self.num_wakeups = 0  # notifications sent by pushes (tests, profiling)

    def __len__(self) -> int:
        with self._cond:
            return len(self._heap)

    def push(self, task: Task, *, notify: bool = True) -> None:
        """Queues `task`; `notify=False` leaves waking the consumer to a later `wake()` (the runtime wakes it once
        per event-loop iteration, so the steps submitted in one iteration are popped together)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("The runtime is stopped; it accepts no new tasks")
            self._seq += 1
            task.seq = self._seq
            self._steps += task.steps
            if task.steps == 1:
                self._push_times.append(task.submitted_at)
            else:
                self._push_times.extend(repeat(task.submitted_at, task.steps))
            heapq.heappush(self._heap, (*task.sort_key, task))
            if notify and self._steps >= self._wanted:
                self.num_wakeups += 1
                self._cond.notify()

    def push_many(self, tasks: list[Task]) -> None:
        """Queues `tasks` in order under one hold of the lock, then wakes the consumer once (all or none queued)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("The runtime is stopped; it accepts no new tasks")
            heap, times, seq, steps = self._heap, self._push_times, self._seq, self._steps
            for task in tasks:
                seq += 1
                task.seq = seq
                steps += task.steps
                if task.steps == 1:
                    times.append(task.submitted_at)
                else:
                    times.extend(repeat(task.submitted_at, task.steps))
                heapq.heappush(heap, (task.priority, task.submitted_at, seq, task))
            self._seq, self._steps = seq, steps
            if steps >= self._wanted:
                self.num_wakeups += 1
                self._cond.notify()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def push_time_s(self, count: int) -> float | None:
        """When the `count`-th step was pushed (`time.monotonic`), if it is one of the last `PUSH_TIMES_KEPT`."""
        with self._cond:
            index = count - (self._steps - len(self._push_times)) - 1
            return self._push_times[index] if 0 <= index < len(self._push_times) else None

    @property
    def num_pushed(self) -> int:
        """Steps pushed so far (`Task.steps` summed: a frame task counts its steps)."""
        return self._steps

    def wait_for_pushes(self, count: int, timeout_s: float) -> None:
        """Waits up to `timeout_s` until `count` steps were pushed in all (or the queue closed); pushes short of
        `count` don't wake it (`wake()` and `close()` do)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._wanted = count
            try:
                while self._steps < count and not self._closed:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return
                    self._cond.wait(remaining)
            finally:
                self._wanted = 0

    def close(self) -> list[Task]:
        """Stops accepting tasks, wakes the waiting consumer and returns the tasks that never ran."""
        with self._cond:
            self._closed = True
            remaining = [item[-1] for item in sorted(self._heap)]
            self._heap.clear()
            self._cond.notify_all()
        return remaining

    def pop_batch(
        self,
        *,
        max_batch_tokens: int,
        mergeable_kinds: Container[str],
        timeout_s: float | None = None,
        merge_limits: Mapping[str, int] | None = None,
    ) -> list[Task] | None:
        """Waits for work and returns the most urgent task, plus (if its kind is mergeable) the other pending tasks
        with the same `(kind, merge_key)` in priority order while their total size fits `max_batch_tokens` (and the
        kind's own `merge_limits` entry, if any; the most urgent task is always taken, whatever its size).
        Returns None once the queue is closed, or an empty list on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._closed:
                    return None
                while self._heap and self._heap[0][-1].abandoned:
                    heapq.heappop(self._heap)  # the caller was cancelled before the task ran
                if self._heap:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return []
                self._cond.wait(remaining)

            first = heapq.heappop(self._heap)[-1]
            batch = [first]
            if first.merge_key is None or first.kind not in mergeable_kinds:
                return batch
            total_tokens = first.size_tokens
            if merge_limits is not None and first.kind in merge_limits:
                max_batch_tokens = min(max_batch_tokens, merge_limits[first.kind])
            kept: list[tuple[float, float, int, Task]] = []
            for item in sorted(self._heap):
                task = item[-1]
                if task.abandoned:
                    continue
                if (
                    task.kind == first.kind
                    and task.merge_key == first.merge_key
                    and total_tokens + task.size_tokens <= max_batch_tokens
                ):
                    batch.append(task)
                    total_tokens += task.size_tokens
                else:
                    kept.append(item)
            if len(batch) > 1:
                self._heap = kept  # a sorted list is a valid heap
            return batch


# ---- delivery: how the runtime hands results back


def call_back(tasks: list[Task], results: list[tuple[Any, BaseException | None]]) -> None:
    """Runs each callback task's `on_done`, then each distinct `flush` once (a failing callback is logged: it must
    not stop the device thread or the other callers' replies)."""
    flushes: dict[Callable[[], None], None] = {}  # keyed by the callable: equal bound methods flush once
    for task, (result, error) in zip(tasks, results, strict=True):
        try:
            if task.on_done is not None:
                task.on_done(result, error)
        except Exception as e:
            logger.warning(f"runtime.callback_failed(kind={task.kind}, error={e!r})")
        if task.flush is not None:
            flushes[task.flush] = None
    for flush in flushes:
        try:
            flush()
        except Exception as e:
            logger.warning(f"runtime.flush_failed(error={e!r})")


def deliver(task: Task, result: Any, error: BaseException | None) -> None:
    """Resolves the task's future inside its own event loop (thread-safe), or runs its callback here."""
    if task.future is None or task.loop is None:
        call_back([task], [(result, error)])
        return
    try:
        task.loop.call_soon_threadsafe(resolve, task.future, result, error)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        logger.debug(f"runtime.deliver_dropped(kind={task.kind}): event loop closed")


def resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled by its caller meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def resolve_all(items: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for future, result, error in items:
        resolve(future, result, error)
