"""The device thread: owns the blocks and KV tensors and runs queued `Task`s by priority, one batch at a time, in a
`schedule -> execute -> complete` loop; results go back to the event loop that submitted them (a future) or through
a callback task's `on_done` in the thread that ran it.

A kind with a launcher runs in two phases (docs/decisions/0002-launch-ahead.md): the launcher queues the batch on the
device, the thread launches the next batch (at once, or held until the first is about to end while the gather rule
says sessions come back within a forward: `Runtime._hold`) and only then completes the first while the device runs
the next; with nothing else queued a launched batch completes at once.

Background kinds (`gathered=False`: training block calls) are paced around the sessions (`Runtime._pace`): after a
launched batch of sessions' steps they wait for a session's next step (or `PACE_HOLD_S`), so that the thread is not
busy launching them when a session comes back, unless their own estimate says they are over before it returns
(`Runtime._fits`)."""

from __future__ import annotations

import asyncio
import heapq
import logging
import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Container, Hashable, Mapping, Sequence
from dataclasses import astuple, dataclass, field
from typing import Any, Protocol

import torch

from corolla.server.core.batch_counts import BATCH_SECONDS_BOUNDS, BATCH_STEPS_BOUNDS, BatchCounts
from corolla.server.core.gather import GatherRule, GatherSettings, ewma
from corolla.server.core.refusals import RuntimeStopped
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

# Lower is more urgent (same convention as the reference's prioritizer: inference 1.0, everything else 2.0).
PRIORITY_INFERENCE: float = 1.0
PRIORITY_FORWARD: float = 2.0
PRIORITY_BACKWARD: float = 2.0
# a shadow session's steps (`protocol.shadow`) are queued at PRIORITY_INFERENCE with this lead time (`Task.lead_after`):
# they ride spare rows of forwards that real steps lead, run at once on an idle replica, and on a full one take one
# request's rows per forward once aged (`TaskQueue.pop_batch`)
SHADOW_LEAD_AFTER_S: float = 0.02

# the longest that background work waits after a batch of sessions' steps for one of them to come back
# (`Runtime._pace`; a decode step's return takes ~1.5 ms on an H200 server): a session further away costs it this once
# per batch
PACE_HOLD_S: float = 0.004
# while background work waits out a session's way back only because its batch before is still on the device, the
# runtime looks again this often whether it would now be over before the session comes (`Runtime._fits`)
PACE_POLL_S: float = 0.0002

KIND_GENERIC = "generic"
# a held launch is queued this long before the forward in flight is expected to end, beyond the launch's own seconds
# (`Runtime._hold`): the waiter's oversleep and its wait for the GIL (0.5 ms switch interval on a GPU server)
LAUNCH_LEAD_S: float = 0.0003
MAX_WATCHES = 8  # merged forwards watched at once for their sessions' return (`TaskQueue.watch`)
KIND_INFERENCE = "inference"
KIND_FORWARD = "forward"


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
    # the steps (sessions' rows) it carries: 1, or a device channel frame's decode steps; the counters count these
    steps: int = 1
    # its steps' sessions (any hashable key per session; empty where unknown): the gather rule learns how long a
    # merged forward's own sessions take to come back (`TaskQueue.watch`)
    sessions: tuple[Hashable, ...] = ()
    # `time.monotonic()` before which it may join a batch but lead none (0: any time; `TaskQueue._lead_at`)
    lead_after: float = 0.0
    # the `time.monotonic()` it ranks at among the tasks of its priority (0: its lead time, else its queueing): a
    # training work ranks at its request's arrival, so that a request's works go before any later request's
    ranks_at: float = 0.0
    # with a future: `then(future)` runs in the same loop callback that resolved it (a front's reply: no done callback
    # per step); not for a cancelled future, nor where the task ran inline
    then: Callable[[asyncio.Future], None] | None = None

    @property
    def sort_key(self) -> tuple[float, float, int]:
        """Its place in the queue (lowest first): priority, then `ranks_at`, its lead time or its queueing (a held
        task's place ages with no re-sort), then the order of pushes."""
        return (self.priority, self.ranks_at or self.lead_after or self.submitted_at, self.seq)

    @property
    def abandoned(self) -> bool:
        """True once the caller gave up on the result (its future was cancelled); a callback task never is."""
        return self.future is not None and self.future.done()


@dataclass(frozen=True)
class KindStats:
    """Totals for one task kind since the runtime started: batches, steps (`Task.steps`), busy seconds as the runtime
    thread sees them (from a launch, or the end of the batch before, to the results in hand), and the device's own
    seconds of the batches that measured them (`PendingBatch.device_s`)."""

    batches: int = 0
    tasks: int = 0  # steps
    busy_s: float = 0.0
    device_s: float = 0.0  # the device's own seconds on the `device_timed` batches
    device_timed: int = 0

    def since(self, earlier: KindStats) -> KindStats:
        return KindStats(*(now - then for now, then in zip(astuple(self), astuple(earlier), strict=True)))

    def __add__(self, other: KindStats) -> KindStats:
        return KindStats(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

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

# A background kind's estimate of the seconds from now until a batch of it launched now would be over, its launch on
# the thread and its time on the device (float("inf") where it knows none); None while its batch before is still on
# the device (the runtime asks again shortly: `PACE_POLL_S`)
BackgroundEstimate = Callable[[], float | None]


@dataclass(eq=False)
class LaunchedBatch:
    """A batch queued on the device by its launcher (`handle`), or whose launch failed (`error`)."""

    batch: list[Task]
    steps: int  # the steps it carries (`Task.steps` summed)
    handle: PendingBatch | None
    error: BaseException | None
    started_s: float  # perf_counter at the launch
    queued_s: float = 0.0  # perf_counter once its launcher returned (the device has it queued)
    outputs: list[Any] | None = None  # once waited for: one per task (an exception instance fails its task)
    elapsed_s: float = 0.0  # its busy seconds, once waited for


@dataclass(eq=False, slots=True)
class _Watch:
    """A merged forward's sessions not back yet, how many more are waited for, and when it finished."""

    sessions: set[Hashable]
    left: int
    finished_s: float


class TaskQueue:
    """Thread-safe priority queue of pending tasks: the event loop pushes, the device thread pops batches."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, float, int, Task]] = []
        # held with `with self._lock` (a C call), not `with self._cond` (two Python frames per hold: every push and pop)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._seq = 0  # tasks pushed (their order)
        self._steps = 0  # steps pushed (`Task.steps` summed): what the gather rule counts
        self._closed = False
        self._led_pushed_s = 0.0  # when a task that may lead at once was last pushed (`_lead_at`)
        # the last merged forwards watched for their sessions' next steps (oldest first), and those back, not yet taken
        self._watches: deque[_Watch] = deque()
        self._returns: list[tuple[float, float]] = []
        self._unreturned_s: float | None = None  # the longest a dropped watch waited (a lower bound), not yet taken
        # steps pushed in all that the consumer waits for in `wait_for_pushes` (0 otherwise: any push wakes it); a
        # push short of it does not wake the consumer only to find too few and wait again
        self._wanted = 0
        self.num_wakeups = 0  # notifications sent by pushes (tests, profiling)

    def __len__(self) -> int:
        with self._lock:
            return len(self._heap)

    def head_kind(self) -> str | None:
        """The kind of the most urgent queued task (None: none queued)."""
        with self._lock:
            return self._heap[0][-1].kind if self._heap else None

    def push(self, task: Task, *, notify: bool = True) -> None:
        """Queues `task`; `notify=False` leaves waking the consumer to a later `wake()` (the runtime wakes it once
        per event-loop iteration, so the steps submitted in one iteration are popped together)."""
        self.push_many((task,), notify=notify)

    def push_many(self, tasks: Sequence[Task], *, notify: bool = True) -> None:
        """Queues `tasks` in order under one hold of the lock, then wakes the consumer once (all or none queued),
        unless `notify` is False (`push`)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("The runtime is stopped; it accepts no new tasks")
            heap, seq, steps = self._heap, self._seq, self._steps
            for task in tasks:
                seq += 1
                task.seq = seq
                steps += task.steps
                if not task.lead_after:
                    self._led_pushed_s = task.submitted_at
                if self._watches:
                    self._count_back(task)
                # (`sort_key`'s tuple and the task, built at once: a push per decode step)
                heapq.heappush(heap, (task.priority, task.ranks_at or task.lead_after or task.submitted_at, seq, task))
            self._seq, self._steps = seq, steps
            if notify and steps >= self._wanted:
                self.num_wakeups += 1
                self._cond.notify()

    def wake(self) -> None:
        """The notification that pushes with `notify=False` left out, under the same rule as `push`'s: a consumer
        waiting in `wait_for_pushes` is woken only once the steps it waits for are all there."""
        with self._lock:
            if self._steps >= self._wanted:
                self.num_wakeups += 1
                self._cond.notify()

    def _count_back(self, task: Task) -> None:
        """Counts each of `task`'s sessions back for the oldest watched forward that holds it (under the lock)."""
        for session in task.sessions:
            for watch in self._watches:
                if session in watch.sessions:
                    watch.sessions.discard(session)
                    watch.left -= 1
                    if not watch.left:
                        self._returns.append((watch.finished_s, task.submitted_at))
                        self._watches.remove(watch)
                    break

    def watch(self, sessions: set[Hashable], count: int, finished_s: float) -> None:
        """Watches for `count` of `sessions` (a merged forward's, finished at `finished_s`) to push their next steps
        (`take_returns`); past `MAX_WATCHES` the oldest is dropped (how long it waited: a lower bound of their
        return). Called before the forward's results go back."""
        with self._lock:
            self._watches.append(_Watch(sessions, min(count, len(sessions)), finished_s))
            if len(self._watches) > MAX_WATCHES:
                waited_s = finished_s - self._watches.popleft().finished_s
                self._unreturned_s = max(waited_s, self._unreturned_s or 0.0)

    def take_returns(self) -> tuple[list[tuple[float, float]], float | None]:
        """The watched forwards back since the last call, as (finished, back) times (`time.monotonic`), and the
        longest that a watch dropped since then waited (None: none dropped)."""
        with self._lock:
            returns, self._returns = self._returns, []
            unreturned_s, self._unreturned_s = self._unreturned_s, None
            return returns, unreturned_s

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_pushed(self) -> int:
        """Steps pushed so far (`Task.steps` summed: a frame task counts its steps)."""
        return self._steps

    def wait_for_pushes(self, count: int, timeout_s: float) -> None:
        """Waits up to `timeout_s` until `count` steps were pushed in all (or the queue closed); pushes short of
        `count` don't wake it (`close()` does)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
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
        with self._lock:
            self._closed = True
            remaining = [item[-1] for item in sorted(self._heap)]
            self._heap.clear()
            self._cond.notify_all()
        return remaining

    def _lead_at(self, task: Task) -> float:
        """When `task` may lead a batch: at its `lead_after`, or once as long has passed since the last push of a
        task that may lead at once (a replica serving nobody lets a shadow step run at once)."""
        if not task.lead_after:
            return 0.0
        return min(task.lead_after, self._led_pushed_s + (task.lead_after - task.submitted_at))

    def _leader(self, now: float) -> tuple[Task | None, float | None]:
        """(The most urgent task that may lead a batch at `now`, taken off the heap; None) or, where every queued
        task has to wait, (None, the earliest time one may). Under the lock."""
        heap = self._heap
        while heap and heap[0][-1].abandoned:
            heapq.heappop(heap)  # its caller was cancelled
        if not heap:
            return None, None
        if self._lead_at(heap[0][-1]) <= now:
            return heapq.heappop(heap)[-1], None
        best, lead_at = -1, None
        for index, item in enumerate(heap):
            task_lead_at = self._lead_at(item[-1])
            if task_lead_at > now:
                lead_at = task_lead_at if lead_at is None else min(lead_at, task_lead_at)
            elif not item[-1].abandoned and (best < 0 or item < heap[best]):
                best = index
        if best < 0:
            return None, lead_at
        leader = heap[best][-1]
        heap[best] = heap[-1]
        heap.pop()
        heapq.heapify(heap)
        return leader, None

    def pop_batch(
        self,
        *,
        max_batch_tokens: int,
        mergeable_kinds: Container[str],
        timeout_s: float | None = None,
        merge_limits: Mapping[str, int] | None = None,
    ) -> list[Task] | None:
        """Waits for work and returns the most urgent task that may lead, plus (if its kind is mergeable) the other
        pending tasks of its `(kind, merge_key)` in priority order while their size fits `max_batch_tokens` and the
        kind's `merge_limits`. Of the held tasks (`lead_after`) one at most joins ahead of the tasks ranked after it,
        the others only where room is left. Returns None once the queue is closed, or an empty list on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while True:
                if self._closed:
                    return None
                leader, lead_at = self._leader(time.monotonic())
                if leader is not None:
                    break
                now = time.monotonic()
                remaining = None if deadline is None else deadline - now
                if remaining is not None and remaining <= 0:
                    return []
                if lead_at is not None:
                    remaining = lead_at - now if remaining is None else min(remaining, lead_at - now)
                self._cond.wait(remaining)

            first = leader
            batch = [first]
            if first.merge_key is None or first.kind not in mergeable_kinds:
                return batch
            total_tokens = first.size_tokens
            if merge_limits is not None and first.kind in merge_limits:
                max_batch_tokens = min(max_batch_tokens, merge_limits[first.kind])
            kept: list[tuple[float, float, int, Task]] = []
            # the other held tasks take only the room left (`spare`): a burst of aged shadows never takes a saturated
            # replica's every row
            ahead = not first.lead_after
            spare: list[tuple[float, float, int, Task]] = []
            kind, merge_key = first.kind, first.merge_key
            for item in sorted(self._heap):
                task = item[-1]
                future = task.future
                if future is not None and future.done():  # abandoned (`Task.abandoned`, inlined: once per row)
                    continue
                if task.kind != kind or (task.merge_key is not merge_key and task.merge_key != merge_key):
                    kept.append(item)
                elif task.lead_after and not ahead:
                    spare.append(item)
                elif total_tokens + task.size_tokens <= max_batch_tokens:
                    batch.append(task)
                    total_tokens += task.size_tokens
                    ahead = ahead and not task.lead_after
                else:
                    kept.append(item)
            for item in spare:
                task = item[-1]
                if total_tokens + task.size_tokens <= max_batch_tokens:
                    batch.append(task)
                    total_tokens += task.size_tokens
                else:
                    kept.append(item)
            if len(batch) > 1:
                self._heap = sorted(kept) if spare else kept  # a sorted list is a valid heap
            return batch


# ---- delivery: how the runtime hands results back


# A batch's outcome is one output per task, as its executor or launcher gives them: an exception instance fails only
# its task (no (result, error) pair is built per task on the device thread; each is told apart where it is delivered).


def call_back(tasks: list[Task], outputs: Sequence[Any]) -> None:
    """Runs each callback task's `on_done` with its output (or its error), then each distinct `flush` once (a failing
    callback is logged: it must not stop the device thread or the other callers' replies)."""
    flushes: dict[Callable[[], None], None] = {}  # keyed by the callable: equal bound methods flush once
    for task, output in zip(tasks, outputs, strict=True):
        try:
            if task.on_done is not None:
                if isinstance(output, BaseException):
                    task.on_done(None, output)
                else:
                    task.on_done(output, None)
        except Exception as e:
            logger.warning(f"runtime.callback_failed(kind={task.kind}, error={e!r})")
        if task.flush is not None:
            flushes[task.flush] = None
    for flush in flushes:
        try:
            flush()
        except Exception as e:
            logger.warning(f"runtime.flush_failed(error={e!r})")


def resolve(future: asyncio.Future, output: Any) -> bool:
    """Sets the future's result to `output` (an exception instance: its error); False (nothing set) where its caller
    cancelled it meanwhile."""
    if future.done():
        return False
    if isinstance(output, BaseException):
        future.set_exception(output)
    else:
        future.set_result(output)
    return True


def settle(tasks: list[Task], outputs: Sequence[Any]) -> None:
    """Resolves `tasks`' futures (of one event loop, in it) with their outputs, then each one's `then` unless its
    caller cancelled it (a failing one is logged: the others are settled all the same)."""
    for task, output in zip(tasks, outputs, strict=True):
        assert task.future is not None
        if resolve(task.future, output) and task.then is not None:
            try:
                task.then(task.future)
            except Exception as e:
                logger.warning(f"runtime.then_failed(kind={task.kind}, error={e!r})")


def deliver(tasks: list[Task], outputs: Sequence[Any]) -> None:
    """Hands each task its output: a callback task's `on_done` here (`call_back`), futures in their own event loop,
    one wake-up per loop (`settle`; thread-safe)."""
    loop = tasks[0].loop
    by_loop: dict[asyncio.AbstractEventLoop, tuple[list[Task], list[Any]]] = {}
    if loop is not None and all(t.loop is loop for t in tasks):  # the usual batch: futures of one event loop
        by_loop[loop] = (tasks, outputs if isinstance(outputs, list) else list(outputs))
    else:
        callbacks: tuple[list[Task], list[Any]] = ([], [])
        for task, output in zip(tasks, outputs, strict=True):
            to = callbacks if task.loop is None else by_loop.setdefault(task.loop, ([], []))
            to[0].append(task)
            to[1].append(output)
        if callbacks[0]:  # (their replies leave from this thread)
            call_back(*callbacks)
    for loop, (loop_tasks, loop_outputs) in by_loop.items():
        try:
            loop.call_soon_threadsafe(settle, loop_tasks, loop_outputs)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            logger.debug(f"runtime.deliver_dropped(kind={loop_tasks[0].kind}, tasks={len(loop_tasks)}): loop closed")


# Runs several merged tasks at once; returns one result per task (an exception instance fails only that task).
BatchExecutor = Callable[[list[Task]], list[Any]]


# Told of each batch after it ran (kind, steps in it: `Task.steps` summed, seconds it took), in its thread.
BatchObserver = Callable[[str, int, float], None]


# the largest task (batch x length) that may run inline: decode steps, never a long prefill that would hold the
# caller's event loop for long
INLINE_MAX_TOKENS = 64


class Runtime:
    """One thread executing device work in priority order (lower `priority` first, then oldest first).

    Use as a context manager (`with Runtime(...) as runtime:`); `submit` is called from a running asyncio loop and
    returns an `asyncio.Future` resolved in that loop. A failing task passes its exception to its caller only.
    Tasks of a kind registered with `register_batch_executor` that have a `merge_key` always go through that
    executor, together with the other queued tasks of the same `(kind, merge_key)` (continuous batching);
    all other tasks run alone as `fn()`.
    """

    def __init__(
        self,
        *,
        max_batch_size_tokens: int,
        device: torch.device | str | None = None,
        name: str = "corolla-runtime",
        stop_timeout_s: float = 30.0,
        gather: GatherSettings | None = None,
    ):
        if max_batch_size_tokens < 1:
            raise ValueError(f"max_batch_size_tokens must be >= 1, got {max_batch_size_tokens}")
        self.max_batch_size_tokens = max_batch_size_tokens
        self.device = torch.device(device) if device is not None else None
        self.name = name
        self.stop_timeout_s = stop_timeout_s
        self._queue = TaskQueue()
        self._batch_executors: dict[str, BatchExecutor] = {}
        self._launchers: dict[str, BatchLauncher] = {}  # kinds whose batches may launch before the last completes
        self._num_in_flight = 0  # launched batches not finished yet (no inline step meanwhile)
        self._last_done_s = 0.0  # perf_counter when the last batch's device work was over (busy time accounting)
        self._merge_limits: dict[str, int] = {}  # kind -> most tokens merged into one batch (register_batch_executor)
        self._inline_kinds: set[str] = set()
        self._ungathered_kinds: set[str] = set()  # kinds whose batches the gather rule ignores
        self._executing = threading.Lock()  # held while a batch runs or launches or is waited for
        self._inline_threads = threading.local()  # the CUDA device is set once per thread running inline batches
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped = False
        self.num_batches_done = 0
        self.num_tasks_done = 0  # steps (`Task.steps`: a frame task counts each of its steps)
        self.num_inline_batches = 0
        # called after each inline batch in the thread that ran it: the serving loop polls for the lone session's next
        # request (`utils.busy_poll`, docs/decisions/0005); set by the span service
        self.after_inline: Callable[[], None] | None = None
        self.num_held_launches = 0  # batches whose launch waited for the forward in flight (`GatherRule.holds_launch`)
        # background work waits for a session's next step until this `time.monotonic()` (0: no hold; `_pace`)
        self.pace_hold_s = PACE_HOLD_S
        self._paced_until = 0.0
        self.num_paced = 0  # holds the device thread waited (benches)
        self.num_paced_out = 0  # of them, holds that ran out with background work queued and no session's step
        self.paced_s = 0.0  # seconds the device thread held background work back
        # learned for `_fits`: a session's return after a batch of sessions' steps, when that batch completed (0: a
        # session's step came since), background kinds' estimates, whether one found its batch before still running
        self._return_s: float | None = None
        self._completed_s = 0.0
        self._estimates: dict[str, BackgroundEstimate] = {}
        self._estimate_busy = False
        self.num_fitted = 0  # background batches launched while a session was on its way back (`_fits`)
        # learned for `_hold`: device seconds by kind and steps' bit length (`_device_key`), and the seconds from a
        # held launch's wake-up to its launcher's return (docs/decisions/0051)
        self._device_s: dict[tuple[str, int], float] = {}
        self.launch_s: float | None = None
        self._kind_stats: dict[str, KindStats] = {}  # written only while `_executing` is held
        # `BatchCounts`' buckets and sums, counted in place (written only while `_executing` is held)
        self._seconds_counts = [0] * (len(BATCH_SECONDS_BOUNDS) + 1)
        self._steps_counts = [0] * (len(BATCH_STEPS_BOUNDS) + 1)
        self._seconds_sum = 0.0
        self._steps_sum = 0
        self._observers: list[BatchObserver] = []
        self._wake_scheduled: set[asyncio.AbstractEventLoop] = set()  # loops with a `_wake` pending
        # after a merged forward, wait briefly for its sessions' next steps (server.gather; fraction 0 disables)
        self.gather = GatherRule(gather if gather is not None else GatherSettings())

    def add_batch_observer(self, observer: BatchObserver) -> None:
        """Calls `observer(kind, num_steps, seconds)` after every batch (benchmarks, profiling); it must be quick
        and must not raise (an exception is logged and the observer dropped)."""
        self._observers.append(observer)

    def batch_counts(self) -> BatchCounts:
        """Every batch so far by its seconds and its steps (a snapshot; read from any thread, e.g. a metrics scrape)."""
        return BatchCounts(tuple(self._seconds_counts), self._seconds_sum, tuple(self._steps_counts), self._steps_sum)

    def stats(self) -> dict[str, KindStats]:
        """Per task kind: batches, steps (`Task.steps`) and busy seconds so far (a snapshot; diff two with `KindStats.since`)."""
        return dict(self._kind_stats)

    # ---- lifecycle

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("Runtime.start: already started")
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        self._ready.wait()
        logger.info(f"runtime.start(max_batch_size_tokens={self.max_batch_size_tokens}, device={self.device})")

    def stop(self) -> None:
        """Lets the running batch finish, ends the thread and fails every task that has not run."""
        if self._stopped:
            return
        self._stopped = True
        pending = self._queue.close()
        error = RuntimeStopped("The server's runtime stopped before this task ran (server shutting down)")
        if pending:
            deliver(pending, [error] * len(pending))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.stop_timeout_s)
            if self._thread.is_alive():
                logger.warning(f"runtime.stop: thread still busy after {self.stop_timeout_s} s")
        logger.info(f"runtime.stop(failed_pending={len(pending)}, tasks_done={self.num_tasks_done})")

    def __enter__(self) -> Runtime:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    @property
    def thread(self) -> threading.Thread | None:
        """The device thread (None before `start`): benches read its CPU clock."""
        return self._thread

    @property
    def num_pending(self) -> int:
        return len(self._queue)

    def merge_limit(self, kind: str) -> int:
        """The most tokens one merged batch of `kind` takes (a device channel splits a larger frame of steps)."""
        return min(self.max_batch_size_tokens, self._merge_limits.get(kind, self.max_batch_size_tokens))

    def register_batch_executor(
        self,
        kind: str,
        executor: BatchExecutor,
        *,
        inline_when_idle: bool = False,
        max_merged_tokens: int | None = None,
        launcher: BatchLauncher | None = None,
        gathered: bool = True,
        estimate: BackgroundEstimate | None = None,
    ) -> None:
        """Lets tasks of `kind` with equal `merge_key` run together through `executor`, up to the token limit and
        `max_merged_tokens` (what one device call serves). `inline_when_idle`: a task queued `inline=True` may run
        in the queuing thread when the runtime is idle. `launcher`: two-phase runs (the module docstring); batches
        it declines go through `executor`. `gathered` False: background work (training), which the gather rule
        ignores and which is paced around the sessions; its `estimate` lets a batch launch while a session is on
        its way back (`_fits`)."""
        if max_merged_tokens is not None:
            if max_merged_tokens < 1:
                raise ValueError(f"max_merged_tokens must be >= 1, got {max_merged_tokens}")
            self._merge_limits[kind] = max_merged_tokens
        else:
            self._merge_limits.pop(kind, None)
        self._batch_executors[kind] = executor
        if launcher is not None:
            self._launchers[kind] = launcher
        else:
            self._launchers.pop(kind, None)
        if inline_when_idle:
            self._inline_kinds.add(kind)
        else:
            self._inline_kinds.discard(kind)
        if gathered:
            self._ungathered_kinds.discard(kind)
        else:
            self._ungathered_kinds.add(kind)
        if estimate is not None and not gathered:
            self._estimates[kind] = estimate
        else:
            self._estimates.pop(kind, None)

    # ---- submission: `task` builds a task, `queue` is the one way in (`submit`: both, for an event loop's caller)

    def task(
        self,
        fn: Callable[[], Any],
        *,
        priority: float,
        size_tokens: int,
        kind: str = KIND_GENERIC,
        merge_key: Hashable | None = None,
        payload: Any = None,
        on_done: Callable[[Any, BaseException | None], None] | None = None,
        flush: Callable[[], None] | None = None,
        steps: int = 1,
        sessions: tuple[Hashable, ...] = (),
        lead_after_s: float = 0.0,
        ranks_at: float = 0.0,
        then: Callable[[asyncio.Future], None] | None = None,
    ) -> Task:
        """A task for `queue`, not queued yet (the keywords are `Task`'s fields; `lead_after_s` is relative to now).
        Without `on_done` its result is `task.future`, resolved in the calling (running) asyncio loop; with `on_done`
        it is a callback task, built in any thread. Raises ValueError if `size_tokens` exceeds
        `max_batch_size_tokens`, RuntimeStopped if the runtime is stopped."""
        if size_tokens > self.max_batch_size_tokens:
            raise ValueError(
                f"Task of {size_tokens} tokens (batch x length) exceeds the server's max_batch_size "
                f"of {self.max_batch_size_tokens} tokens; send smaller batches or shorter chunks"
            )
        if size_tokens < 0:
            raise ValueError(f"size_tokens must be >= 0, got {size_tokens}")
        if self._stopped:
            raise RuntimeStopped("The server's runtime is stopped; it accepts no new tasks")
        loop = future = None
        if on_done is None:
            loop = asyncio.get_running_loop()
            future = loop.create_future()
        now = time.monotonic()
        # every field by position, in `Task`'s order (built per decode step: 0.26 us, by keywords 0.80)
        return Task(
            fn, float(priority), size_tokens, future, loop, kind, merge_key, payload, now, 0, on_done, flush, steps,
            sessions, now + lead_after_s if lead_after_s else 0.0, ranks_at, then,
        )  # fmt: skip

    def queue(self, tasks: Task | list[Task], *, inline: bool = False) -> None:
        """THE way into the runtime: queues one task or several for the device thread, or with `inline` (one task of
        an `inline_when_idle` kind, with a `merge_key`, at most `INLINE_MAX_TOKENS`) runs it here on an idle runtime.
        The device thread wakes once per loop iteration for tasks with a future, at once for callback tasks.
        RuntimeStopped (none queued) if the runtime stopped."""
        if (
            inline
            and isinstance(tasks, Task)
            and tasks.kind in self._inline_kinds
            and tasks.merge_key is not None
            and tasks.size_tokens <= INLINE_MAX_TOKENS
            and self._run_inline(tasks)
        ):
            return
        try:
            if isinstance(tasks, list):
                self._queue.push_many(tasks)
            elif tasks.loop is None:
                self._queue.push(tasks)
            else:
                loop = tasks.loop
                self._queue.push(tasks, notify=False)
                if loop not in self._wake_scheduled:  # one wake-up of the device thread per loop iteration
                    self._wake_scheduled.add(loop)
                    loop.call_soon(self._wake, loop)
        except RuntimeError as e:
            raise RuntimeStopped("The server's runtime is stopped; it accepts no new tasks") from e

    def submit(
        self, fn: Callable[[], Any], *, priority: float, size_tokens: int, kind: str = KIND_GENERIC,
        merge_key: Hashable | None = None, payload: Any = None, inline: bool = False,
        sessions: tuple[Hashable, ...] = (), lead_after_s: float = 0.0,
    ) -> asyncio.Future:  # fmt: skip
        """`queue(task(fn, ...), inline=inline)` for a caller in a running asyncio loop: the future of `fn()`'s result
        (already resolved where it ran inline)."""
        task = self.task(fn, priority=priority, size_tokens=size_tokens, kind=kind, merge_key=merge_key,
                         payload=payload, sessions=sessions, lead_after_s=lead_after_s)  # fmt: skip
        self.queue(task, inline=inline)
        assert task.future is not None
        return task.future

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wake_scheduled.discard(loop)
        self._queue.wake()

    def _run_inline(self, task: Task) -> bool:
        """Runs `task` now in this thread if nothing is queued or running (False: not run): a lone session's step
        skips two thread hand-offs, each a wake-up of an idle core, while the caller's loop is blocked for it."""
        if self._stopped or len(self._queue) > 0 or not self._executing.acquire(blocking=False):
            return False
        try:
            if len(self._queue) > 0 or self._num_in_flight:  # priority order; nothing overtakes a launched batch
                return False
            if not getattr(self._inline_threads, "set", 0):
                self._set_device()
                self._inline_threads.set = 1
            outputs = self._execute([task], task.steps)
        finally:
            self._executing.release()
        self.num_batches_done += 1
        self.num_tasks_done += task.steps
        self.num_inline_batches += 1
        if task.future is not None:
            resolve(task.future, outputs[0])
        else:
            call_back([task], outputs)
        if self.after_inline is not None:
            self.after_inline()
        return True

    # ---- device thread

    def _set_device(self) -> None:
        """Makes the runtime's CUDA device this thread's (a bare "cuda" has no index: the current device, which
        `set_device` rejects)."""
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device if self.device.index is not None else torch.cuda.current_device())

    def _run(self) -> None:
        try:
            self._set_device()
        finally:
            self._ready.set()
        queue = self._queue
        pending: LaunchedBatch | None = None
        while True:  # (gather) -> schedule -> execute (or launch) -> complete
            held = False
            if pending is None:
                wait = self.gather.wait(time.monotonic(), queue.num_pushed)
                if wait is not None:
                    queue.wait_for_pushes(wait.num_pushed, wait.timeout_s)
                self._pace(queue)
            elif self.gather.holds_launch():  # sessions come back while a forward runs: launch as it ends
                held = True
                self._hold(pending)  # so that they merge into one batch, with no device gap before it
            elif self._paced(queue):  # background work next while a session is on its way back: not yet
                self._finish(pending)
                pending = None
                continue
            woke_s = time.perf_counter()
            batch = queue.pop_batch(
                max_batch_tokens=self.max_batch_size_tokens, mergeable_kinds=self._batch_executors.keys(),
                merge_limits=self._merge_limits, timeout_s=None if pending is None else 0.0,
            )  # fmt: skip
            if not batch:  # closed (None), or nothing queued behind the launched batch: finish it now
                if pending is not None:
                    self._finish(pending)
                    pending = None
                if batch is None:
                    break
                continue
            steps = _steps(batch)  # (once per batch: its counters, the gather rule and the hold read it)
            if batch[0].kind not in self._ungathered_kinds:
                self._returned(batch[0])
                self._paced_until = 0.0  # the session is back: background work may launch behind its step
            elif self._paced_until and time.monotonic() < self._paced_until:
                self.num_fitted += 1  # launched in the session's way back: `_fits`
            launched = self._launch(batch, steps)
            self.num_held_launches += held
            if held and launched is not None:
                self.launch_s = ewma(self.launch_s, time.perf_counter() - woke_s)
            if pending is not None:  # the device runs `launched` (if any) while this one's replies leave
                self._finish(pending)
                pending = None
            if launched is not None:
                pending = launched
                continue
            with self._executing:
                started = time.perf_counter()
                outputs = self._execute(batch, steps)
                elapsed_s = time.perf_counter() - started
                self._last_done_s = time.perf_counter()
            if batch[0].merge_key is not None and batch[0].kind in self._batch_executors:
                self._gathered(batch, steps, elapsed_s)
            self._complete(batch, outputs, steps)

    def _paced(self, queue: TaskQueue) -> bool:
        """Whether background work heads the queue (or nothing does) while a session's step is due back, and its
        launch would not be over before the step comes (`_fits`)."""
        self._estimate_busy = False
        if not self._paced_until:
            return False
        head = queue.head_kind()
        if head is not None and head not in self._ungathered_kinds:
            return False
        now = time.monotonic()
        return now < self._paced_until and (head is None or not self._fits(head, now))

    def _fits(self, kind: str, now: float) -> bool:
        """Whether a batch of background `kind` launched `now` is expected to be over, on the thread and on the
        device, before the session's step comes back (by the kind's estimate, once its batch before left the
        device)."""
        estimate, return_s = self._estimates.get(kind), self._return_s
        if estimate is None or return_s is None:
            return False
        over_s = estimate()
        if over_s is None:
            self._estimate_busy = True
            return False
        return now + over_s <= self._completed_s + return_s

    def _returned(self, step: Task) -> None:
        """A session's step popped after a batch of sessions' steps completed: learns how long the sessions took to
        come back (from that batch's completion to the step's queueing; 0 where it was queued before), where it came
        within the pace hold (a session further away, or a new one, says nothing of a decode step's way back)."""
        if not self._completed_s:
            return
        back_s = max(0.0, step.submitted_at - self._completed_s)
        if back_s <= self.pace_hold_s:
            self._return_s = ewma(self._return_s, back_s)
        self._completed_s = 0.0

    def _pace(self, queue: TaskQueue) -> None:
        """Waits while `_paced`: until a session's step is queued (it heads the queue) or the hold runs out; the
        thread then launches that step first, and background work while the step runs on the device."""
        if not self._paced(queue):
            return
        started = time.monotonic()
        while self._paced(queue) and not queue.closed:
            timeout_s = self._paced_until - time.monotonic()
            queue.wait_for_pushes(
                queue.num_pushed + 1, min(timeout_s, PACE_POLL_S) if self._estimate_busy else timeout_s
            )
        now = time.monotonic()
        self.num_paced += 1
        self.paced_s += now - started
        if now >= self._paced_until:  # ran out: no more holds until the next batch of sessions' steps
            self.num_paced_out += queue.head_kind() in self._ungathered_kinds
            self._paced_until = 0.0

    def _launch(self, batch: list[Task], steps: int) -> LaunchedBatch | None:
        """Queues `batch` on the device through its kind's launcher; None where it has none or declines."""
        launcher = self._launchers.get(batch[0].kind) if batch[0].merge_key is not None else None
        if launcher is None:
            return None
        with self._executing:
            started = time.perf_counter()
            try:
                handle = launcher(batch)
            except Exception as e:  # the launch failed: every task of the batch fails, when its turn comes
                logger.warning(f"runtime.launch_failed(kind={batch[0].kind}, tasks={len(batch)}, error={e!r})")
                return LaunchedBatch(batch, steps, None, e, started)
            if handle is None:
                return None
            self._num_in_flight += 1
            return LaunchedBatch(batch, steps, handle, None, started, queued_s=time.perf_counter())

    def _hold(self, launched: LaunchedBatch) -> None:
        """Waits until the device is about to end `launched` (a held launch): its expected end (its start plus the
        device seconds learned for its kind and size) less a launch's own seconds and `LAUNCH_LEAD_S`, so that the
        next forward is queued before it ends. Where nothing is learned yet it waits for the end."""
        expected_s = self._device_s.get(_device_key(launched))
        if expected_s is None or self.launch_s is None:
            self._wait(launched)
            return
        start_s = max(launched.queued_s, self._last_done_s)
        sleep_s = start_s + expected_s - self.launch_s - LAUNCH_LEAD_S - time.perf_counter()
        if sleep_s > 0:
            time.sleep(sleep_s)

    def _finish(self, launched: LaunchedBatch) -> None:
        """Waits for a launched batch's results (if not done yet) and completes it."""
        outputs = self._wait(launched)
        self._gathered(launched.batch, launched.steps, launched.elapsed_s, launched=True)
        self._complete(launched.batch, outputs, launched.steps)

    def _gathered(self, batch: list[Task], steps: int, forward_s: float, *, launched: bool = False) -> None:
        """The gather rule's bookkeeping once a merged batch finished, before its results go back. Only after a
        `launched` batch does background work wait for its sessions (`_pace`): after a batch run to its end (a CPU
        server) there is no launch to go behind, and a session returning within the hold would starve it."""
        if batch[0].kind in self._ungathered_kinds:
            return
        queue = self._queue
        now_s = time.monotonic()
        if launched and self._ungathered_kinds and self.pace_hold_s > 0:  # background work waits for the sessions
            self._paced_until = now_s + self.pace_hold_s
            self._completed_s = now_s
        self.gather.learn(*queue.take_returns())
        count = self.gather.finished(size=steps, forward_s=forward_s, now_s=now_s, num_pushed=queue.num_pushed)
        sessions = set().union(*[task.sessions for task in batch])  # (one C call over the tasks' tuples)
        if count is not None and sessions:
            queue.watch(sessions, count, now_s)

    def _wait(self, launched: LaunchedBatch) -> list[Any]:
        """A launched batch's outputs, waited for once, and accounted for."""
        if launched.outputs is not None:
            return launched.outputs
        batch = launched.batch
        with self._executing:
            outputs: list[Any]
            try:
                if launched.handle is None:
                    assert launched.error is not None
                    raise launched.error
                outputs = _per_task(batch, launched.handle.wait(), "launcher")
            except Exception as e:
                logger.warning(f"runtime.task_failed(kind={batch[0].kind}, tasks={len(batch)}, error={e!r})")
                outputs = [e] * len(batch)
            finally:
                if launched.handle is not None:
                    self._num_in_flight -= 1
            done_s = time.perf_counter()
            # busy time: from the launch, or from the end of the batch before it if that ran on the device meanwhile
            launched.elapsed_s = done_s - max(launched.started_s, self._last_done_s)
            self._last_done_s = done_s
            device_s = launched.handle.device_s if launched.handle is not None else None
            if device_s is not None:  # what `_hold` expects of the next batch of this kind and size
                key = _device_key(launched)
                self._device_s[key] = ewma(self._device_s.get(key), device_s)
            self._account(batch[0].kind, launched.steps, launched.elapsed_s, device_s)
        launched.outputs = outputs
        return outputs

    def _execute(self, batch: list[Task], steps: int) -> list[Any]:
        started = time.perf_counter()
        try:
            executor = self._batch_executors.get(batch[0].kind) if batch[0].merge_key is not None else None
            outputs = _per_task(batch, [batch[0].fn()] if executor is None else executor(batch), "executor")
        except Exception as e:
            logger.warning(f"runtime.task_failed(kind={batch[0].kind}, tasks={len(batch)}, error={e!r})")
            logger.debug("runtime.task_failed traceback", exc_info=True)
            return [e] * len(batch)
        finally:
            self._account(batch[0].kind, steps, time.perf_counter() - started)
        return outputs

    def _account(self, kind: str, num_steps: int, elapsed_s: float, device_s: float | None = None) -> None:
        """Adds a batch to its kind's totals and tells the observers (with `_executing` held)."""
        self._kind_stats[kind] = self._kind_stats.get(kind, KindStats()).plus(num_steps, elapsed_s, device_s)
        self._seconds_counts[bisect_left(BATCH_SECONDS_BOUNDS, elapsed_s)] += 1
        self._steps_counts[bisect_left(BATCH_STEPS_BOUNDS, num_steps)] += 1
        self._seconds_sum += max(0.0, elapsed_s)
        self._steps_sum += num_steps
        for observer in list(self._observers):
            try:
                observer(kind, num_steps, elapsed_s)
            except Exception as e:
                logger.warning(f"runtime.observer_failed(error={e!r}): dropped")
                self._observers.remove(observer)
        if logger.isEnabledFor(logging.DEBUG):  # not formatted per batch unless it is logged
            logger.debug(f"runtime.execute(kind={kind}, steps={num_steps}, ms={elapsed_s * 1000:.2f})")

    def _complete(self, batch: list[Task], outputs: list[Any], steps: int) -> None:
        self.num_batches_done += 1  # counted before the callers can observe their results
        self.num_tasks_done += steps
        deliver(batch, outputs)


def _device_key(launched: LaunchedBatch) -> tuple[str, int]:
    """A launched batch's kind and its steps' bit length: the batches whose device seconds `Runtime._hold` expects
    alike (a kind that never measures them, e.g. training's block calls, is always waited for)."""
    return launched.batch[0].kind, launched.steps.bit_length()


def _steps(batch: list[Task]) -> int:  # the steps a batch carries (`Task.steps`): its counters count these
    return sum(task.steps for task in batch)


def _per_task(batch: list[Task], outputs: Sequence[Any], source: str) -> list[Any]:
    """A batch's outputs, one per task (an exception instance fails only its task); RuntimeError if the executor or
    launcher (`source`) gave another count than the batch's."""
    if len(outputs) != len(batch):
        raise RuntimeError(
            f"Batch {source} for {batch[0].kind!r} returned {len(outputs)} results for {len(batch)} tasks"
        )
    return outputs if isinstance(outputs, list) else list(outputs)
