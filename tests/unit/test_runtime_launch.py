"""Two-phase batches (`register_batch_executor(..., launcher=...)`): the runtime launches the next queued batch
before it waits for and completes (delivers the results of) the one in flight, completes a lone batch at once, keeps a task's
failure to that task and a launch's or wait's failure to that batch, runs the batches a launcher declines through the
executor after the batch in flight, lets no inline step overtake a launched batch, and still delivers a launched
batch's results when it stops."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest

from corolla.server.core.gather import GatherSettings
from corolla.server.core.refusals import RuntimeStopped
from corolla.server.core.runtime import Runtime, Task

WAIT_S = 5.0


class _Pending:
    """A launched fake batch: `wait` logs, optionally blocks on `gate`, then returns `results` or raises; `device_s`
    is what its device would have measured (None: not measured)."""

    def __init__(self, log: list[tuple[str, object]], name: str, results: Sequence[object] | BaseException,
                 gate: threading.Event | None = None, device_s: float | None = None):  # fmt: skip
        self.log, self.name, self.results, self.gate = log, name, results, gate
        self.device_s = device_s

    def wait(self) -> Sequence[object]:
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        self.log.append(("wait", self.name))
        if isinstance(self.results, BaseException):
            raise self.results
        return self.results


class _Bench:
    """A runtime with a fake launcher and executor for kind "decode" that log what runs when; tasks carry their
    name as payload; `on_launch[name]` runs inside the launch of the batch whose first task is `name`."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.log: list[tuple[str, object]] = []
        self.results: dict[str, object] = {}
        self.done = threading.Event()
        self.on_launch: dict[str, Callable[[], None]] = {}
        self.launch_results: dict[str, Sequence[object] | BaseException | None] = {}  # None: declined
        self.gates: dict[str, threading.Event] = {}
        self.device_s: dict[str, float] = {}  # a batch's device-measured seconds, by its first task
        runtime.register_batch_executor("decode", self.execute, launcher=self.launch, inline_when_idle=True)

    def launch(self, tasks: list[Task]) -> _Pending | None:
        name = str(tasks[0].payload)
        self.log.append(("launch", [t.payload for t in tasks]))
        if name in self.on_launch:
            self.on_launch.pop(name)()
        planned = self.launch_results.get(name, [f"{t.payload}!" for t in tasks])
        if planned is None:
            return None
        if isinstance(planned, BaseException) and name.startswith("boom"):
            raise planned
        return _Pending(self.log, name, planned, self.gates.get(name), self.device_s.get(name))

    def execute(self, tasks: list[Task]) -> list[object]:
        self.log.append(("execute", [t.payload for t in tasks]))
        return [f"{t.payload}:executed" for t in tasks]

    def task(self, name: str, last: bool = False) -> Task:
        def on_done(result: object, error: BaseException | None) -> None:
            self.log.append(("done", name))
            self.results[name] = error if error is not None else result
            if last:
                self.done.set()

        return self.runtime.task(lambda: None, on_done=on_done, flush=None, priority=1, size_tokens=1,
                                          kind="decode", merge_key="span", payload=name)  # fmt: skip

    def submit(self, *names: str, last: bool = False) -> None:
        self.runtime.queue([self.task(n, last and i == len(names) - 1) for i, n in enumerate(names)])


def _runtime() -> Runtime:
    return Runtime(max_batch_size_tokens=64, gather=GatherSettings(fraction=0.0))


def test_the_next_batch_launches_before_the_one_in_flight_completes() -> None:
    with _runtime() as runtime:
        bench = _Bench(runtime)
        bench.on_launch["a1"] = lambda: bench.submit("b1", "b2", last=True)  # queued while a1's batch launches
        bench.submit("a1")
        assert bench.done.wait(WAIT_S)
    assert bench.log == [
        ("launch", ["a1"]), ("launch", ["b1", "b2"]), ("wait", "a1"), ("done", "a1"), ("wait", "b1"), ("done", "b1"),
        ("done", "b2"),
    ]  # fmt: skip
    assert bench.results == {"a1": "a1!", "b1": "b1!", "b2": "b2!"}
    assert runtime.num_held_launches == 0


def test_a_held_launch_waits_for_the_forward_in_flight_and_takes_what_queued_meanwhile() -> None:
    """While sessions come back sooner than a forward lasts (`GatherRule.holds_launch`), steps queued while a forward
    runs launch once the device is done with it, as one batch (the sessions that came back meanwhile merge), and
    before that forward's replies leave."""
    with Runtime(max_batch_size_tokens=64) as runtime:
        runtime.gather.return_s, runtime.gather.forward_s = 0.002, 0.005  # as learned at 32 layers on an H200
        bench = _Bench(runtime)
        bench.gates["a1"] = gate = threading.Event()
        # b1 queues while a1's batch launches, b2 while a1 still runs on the device: both go into one batch after it
        bench.on_launch["a1"] = lambda: (bench.submit("b1"), bench.submit("b2", last=True), gate.set())
        bench.submit("a1")
        assert bench.done.wait(WAIT_S)
    assert bench.log == [
        ("launch", ["a1"]), ("wait", "a1"), ("launch", ["b1", "b2"]), ("done", "a1"), ("wait", "b1"), ("done", "b1"),
        ("done", "b2"),
    ]  # fmt: skip
    assert runtime.num_held_launches == 1


def test_a_held_launch_is_queued_before_the_forward_in_flight_ends_once_its_device_time_is_known() -> None:
    """Once the device seconds of batches of its size and a launch's own seconds are learned, a held launch goes
    behind the forward in flight shortly before that forward is expected to end (`Runtime._hold`), not after its
    wait: the device does not idle between held forwards. b1's wait blocks until c1 launched, so a runtime that
    waited for b1 first would never launch c1; and c1 waits most of b1's expected 0.2 s (a sleep never ends early)."""
    with Runtime(max_batch_size_tokens=64) as runtime:
        runtime.gather.return_s, runtime.gather.forward_s = 0.002, 0.005  # as learned at 32 layers on an H200
        bench = _Bench(runtime)
        bench.device_s = {"a1": 0.2, "b1": 0.2}
        bench.gates["b1"] = gate = threading.Event()
        launched_s: dict[str, float] = {}
        bench.on_launch["a1"] = lambda: bench.submit("b1")  # held: nothing learned yet, launched after a1's wait
        bench.on_launch["b1"] = lambda: (
            launched_s.setdefault("b1", time.perf_counter()),
            bench.submit("c1", last=True),
        )
        bench.on_launch["c1"] = lambda: (launched_s.setdefault("c1", time.perf_counter()), gate.set())
        bench.submit("a1")
        assert bench.done.wait(WAIT_S)
    assert launched_s["c1"] - launched_s["b1"] > 0.1  # 0.2 s less a launch's seconds (learned: a1 -> b1) and 0.3 ms
    assert bench.log == [
        ("launch", ["a1"]), ("wait", "a1"), ("launch", ["b1"]), ("done", "a1"), ("launch", ["c1"]), ("wait", "b1"),
        ("done", "b1"), ("wait", "c1"), ("done", "c1"),
    ]  # fmt: skip
    assert runtime.num_held_launches == 2


def test_a_held_launch_behind_a_kind_without_device_time_does_not_wait_on_another_kinds_figure() -> None:
    """The device seconds a held launch expects are its kind's (training's block calls measure none): a batch of a
    kind without them is waited for as before, never slept on with a decode forward's learned seconds."""
    with Runtime(max_batch_size_tokens=64) as runtime:
        runtime.gather.return_s, runtime.gather.forward_s = 0.002, 0.005
        bench = _Bench(runtime)
        bench.device_s = {"a1": 0.5, "b1": 0.5}  # a decode batch of one step "takes" 0.5 s on the device
        bench.on_launch["a1"] = lambda: bench.submit("b1", last=True)
        bench.submit("a1")
        assert bench.done.wait(WAIT_S)  # 0.5 s learned for one-step decode batches (and a launch's seconds)
        done = threading.Event()

        def other(name: str) -> Task:
            return runtime.task(lambda: None, on_done=lambda *_: done.set() if name == "o2" else None, flush=None,
                                priority=1, size_tokens=1, kind="other", merge_key="span", payload=name)  # fmt: skip

        def launch_other(tasks: list[Task]) -> _Pending:
            if tasks[0].payload == "o1":
                runtime.queue(other("o2"))  # queued behind o1 in flight: its launch is held
            return _Pending(bench.log, str(tasks[0].payload), [None] * len(tasks))  # no device seconds

        runtime.register_batch_executor("other", lambda tasks: [None] * len(tasks), launcher=launch_other)
        held_before, started = runtime.num_held_launches, time.monotonic()
        runtime.queue(other("o1"))
        assert done.wait(WAIT_S)
        assert runtime.num_held_launches == held_before + 1
        assert time.monotonic() - started < 0.25  # not slept on decode's 0.5 s


def test_a_lone_batch_completes_at_once() -> None:
    with _runtime() as runtime:
        bench = _Bench(runtime)
        bench.submit("a1", "a2", last=True)
        assert bench.done.wait(WAIT_S)  # nothing else is ever queued: it is not held for a next batch
        assert bench.log == [("launch", ["a1", "a2"]), ("wait", "a1"), ("done", "a1"), ("done", "a2")]
        assert runtime.stats()["decode"].batches == 1 and runtime.stats()["decode"].tasks == 2


def test_device_measured_time_is_counted_apart_from_the_runtime_threads_view() -> None:
    """Batches whose device measured its own time add it to `device_s` and count in `device_timed`; a batch without
    (None) adds neither; `busy_s` stays the runtime thread's view (from launch to the results in hand)."""
    with _runtime() as runtime:
        bench = _Bench(runtime)
        bench.device_s = {"a1": 0.002, "c1": 0.003}
        bench.gates["a1"] = gate = threading.Event()
        bench.on_launch["a1"] = lambda: bench.submit("b1")
        bench.on_launch["b1"] = lambda: (bench.submit("c1", last=True), gate.set())
        bench.submit("a1")
        assert bench.done.wait(WAIT_S)
        stats = runtime.stats()["decode"]
    assert (stats.batches, stats.tasks, stats.device_timed) == (3, 3, 2)
    assert stats.device_s == pytest.approx(0.005)
    assert stats.busy_s > 0
    later = stats.plus(2, 0.01, 0.004)
    assert later.since(stats) == type(stats)(1, 2, pytest.approx(0.01), pytest.approx(0.004), 1)


def test_failures_stay_in_their_task_or_batch() -> None:
    with _runtime() as runtime:
        bench = _Bench(runtime)
        bench.launch_results["a1"] = [ValueError("bad step"), "a2!"]
        bench.launch_results["b1"] = RuntimeError("device failure")  # raised by wait
        bench.launch_results["boom"] = RuntimeError("launch failure")  # raised by the launcher
        bench.on_launch["a1"] = lambda: bench.submit("b1")
        bench.on_launch["b1"] = lambda: bench.submit("boom")
        bench.on_launch["boom"] = lambda: bench.submit("c1", last=True)
        bench.submit("a1", "a2")
        assert bench.done.wait(WAIT_S)
    assert isinstance(bench.results["a1"], ValueError) and bench.results["a2"] == "a2!"
    assert isinstance(bench.results["b1"], RuntimeError) and "device" in str(bench.results["b1"])
    assert isinstance(bench.results["boom"], RuntimeError) and "launch" in str(bench.results["boom"])
    assert bench.results["c1"] == "c1!"
    assert [e for e in bench.log if e[0] == "done"] == [("done", n) for n in ("a1", "a2", "b1", "boom", "c1")]


def test_a_declined_batch_runs_through_the_executor_after_the_one_in_flight() -> None:
    with _runtime() as runtime:
        bench = _Bench(runtime)
        bench.launch_results["b1"] = None  # e.g. a prefill: the launcher declines it
        bench.on_launch["a1"] = lambda: bench.submit("b1", last=True)
        bench.submit("a1")
        assert bench.done.wait(WAIT_S)
    assert bench.log == [
        ("launch", ["a1"]), ("launch", ["b1"]), ("wait", "a1"), ("done", "a1"), ("execute", ["b1"]), ("done", "b1"),
    ]  # fmt: skip
    assert bench.results["b1"] == "b1:executed"


def test_no_inline_step_overtakes_a_launched_batch() -> None:
    with _runtime() as runtime:
        bench = _Bench(runtime)
        inline_done = threading.Event()

        def submit_inline() -> None:  # from a1's completion, while b1's batch is in flight and the queue empty
            runtime.queue(runtime.task(
                lambda: None, on_done=lambda r, e: inline_done.set(), priority=1, size_tokens=1, kind="decode",
                merge_key="span", payload="c1",
            ), inline=True)  # fmt: skip

        bench.on_launch["a1"] = lambda: bench.submit("b1", last=True)
        original = bench.task

        def task(name: str, last: bool = False) -> Task:
            made = original(name, last)
            if name == "a1":
                assert made.on_done is not None
                on_done = made.on_done
                made.on_done = lambda r, e: (on_done(r, e), submit_inline())
            return made

        bench.task = task  # type: ignore[method-assign]
        bench.submit("a1")
        assert bench.done.wait(WAIT_S) and inline_done.wait(WAIT_S)
    assert ("execute", ["c1"]) not in bench.log  # not run inline (by the executor) ahead of b1's batch
    assert bench.log.index(("wait", "b1")) < bench.log.index(("wait", "c1"))  # queued and launched behind it


def test_stop_still_delivers_the_launched_batch() -> None:
    runtime = _runtime()
    runtime.start()
    bench = _Bench(runtime)
    gate = bench.gates["a1"] = threading.Event()
    launched = threading.Event()
    bench.on_launch["a1"] = launched.set
    bench.submit("a1", last=True)
    assert launched.wait(WAIT_S)
    stopper = threading.Thread(target=runtime.stop)
    stopper.start()
    try:
        refused = False
        for _ in range(1000):  # until stop() closed the queue
            try:
                bench.submit("late")
            except RuntimeStopped:
                refused = True
                break
            threading.Event().wait(0.001)
        assert refused
    finally:
        gate.set()
        stopper.join(WAIT_S)
    assert bench.done.wait(WAIT_S) and bench.results["a1"] == "a1!"
    assert not stopper.is_alive()
