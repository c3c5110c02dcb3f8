"""Late tasks (`server.late_join`): while the runtime waits for the batch the device runs, the tasks queued meanwhile
join the batch launched behind it (and get their results from it), a task the batch turns out not to have run
(`JoinMissed`) is queued again and runs in a later batch, and tasks the batch can't take (another kind of step, a
refusal, no room) stay queued in order for a later launch."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from corolla.server.gather import GatherSettings
from corolla.server.runtime import Runtime
from corolla.server.task import JoinableBatch, JoinMissed, Task, TaskQueue

WAIT_S = 5.0


class _Launched:
    """A launched fake batch that late tasks may join: not ready until `gate` is set; payloads starting with
    "prefill" fail `can_join`, "refuse" fail `join`, names in `missed` come back as `JoinMissed`."""

    def __init__(self, log: list, name: str, payloads: list[str], room: int, gate: threading.Event | None,
                 missed: set[str]):  # fmt: skip
        self.log, self.name, self.payloads, self._room, self.gate, self.missed = log, name, payloads, room, gate, missed
        self.joined: list[str] = []

    def ready(self) -> bool:
        return self.gate is None or self.gate.is_set()

    @property
    def room(self) -> int:
        return self._room

    def can_join(self, task: Task) -> bool:
        return not str(task.payload).startswith("prefill") and task.steps <= self._room

    def join(self, task: Task) -> bool:
        if str(task.payload).startswith("refuse"):
            return False
        self.joined.append(str(task.payload))
        self._room -= task.steps
        self.log.append(("join", self.name, task.payload))
        return True

    def wait(self) -> list[object]:
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        self.log.append(("wait", self.name))
        late = [JoinMissed() if p in self.missed else f"{p}!late" for p in self.joined]
        return [f"{p}!" for p in self.payloads] + late


class _Bench:
    def __init__(self, runtime: Runtime, room: int = 4):
        self.runtime, self.room = runtime, room
        self.log: list = []
        self.results: dict[str, object] = {}
        self.gates: dict[str, threading.Event] = {}
        self.missed: set[str] = set()
        self.on_launch: dict[str, Callable[[], None]] = {}
        self.finished = threading.Condition()
        runtime.register_batch_executor("decode", self.execute, launcher=self.launch)

    def launch(self, tasks: list[Task]) -> _Launched:
        name = str(tasks[0].payload)
        self.log.append(("launch", [t.payload for t in tasks]))
        if name in self.on_launch:
            self.on_launch.pop(name)()
        payloads = [str(t.payload) for t in tasks]
        return _Launched(self.log, name, payloads, self.room, self.gates.get(name), self.missed)

    def execute(self, tasks: list[Task]) -> list[object]:
        return [f"{t.payload}:executed" for t in tasks]

    def submit(self, *names: str) -> None:
        def task(name: str) -> Task:
            def on_done(result: object, error: BaseException | None) -> None:
                with self.finished:
                    self.results[name] = error if error is not None else result
                    self.finished.notify_all()

            return self.runtime.callback_task(lambda: None, on_done=on_done, flush=None, priority=1, size_tokens=1,
                                              kind="decode", merge_key="span", payload=name)  # fmt: skip

        self.runtime.submit_callbacks([task(n) for n in names])

    def wait_for(self, predicate: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not predicate():
            assert time.monotonic() < deadline, self.log
            time.sleep(0.001)

    def wait_results(self, *names: str) -> None:
        with self.finished:
            assert self.finished.wait_for(lambda: all(n in self.results for n in names), WAIT_S), self.log


def _running_a1_with_b1_behind(bench: _Bench) -> None:
    """a1 launched (the device "runs" it until its gate opens), b1 launched behind it, the runtime waiting for a1."""
    bench.gates["a1"] = threading.Event()
    bench.on_launch["a1"] = lambda: bench.submit("b1")  # queued while a1 launches: launched behind it
    bench.submit("a1")
    bench.wait_for(lambda: ("launch", ["b1"]) in bench.log)


def _runtime() -> Runtime:
    return Runtime(max_batch_size_tokens=64, gather=GatherSettings(fraction=0.0))


def test_steps_queued_while_the_device_runs_join_the_batch_launched_behind() -> None:
    with _runtime() as runtime:
        bench = _Bench(runtime)
        _running_a1_with_b1_behind(bench)
        bench.submit("c1", "c2")
        bench.wait_for(lambda: ("join", "b1", "c2") in bench.log)
        assert ("wait", "a1") not in bench.log  # joined while a1 still ran
        bench.gates["a1"].set()
        bench.wait_results("a1", "b1", "c1", "c2")
    assert bench.results == {"a1": "a1!", "b1": "b1!", "c1": "c1!late", "c2": "c2!late"}
    assert [e for e in bench.log if e[0] == "launch"] == [("launch", ["a1"]), ("launch", ["b1"])]  # no third batch
    assert runtime.stats()["decode"].tasks == 4


def test_a_late_task_the_device_did_not_run_runs_again_in_a_later_batch() -> None:
    with _runtime() as runtime:
        bench = _Bench(runtime)
        bench.missed.add("c1")  # it joined just as b1 started on the device
        _running_a1_with_b1_behind(bench)
        bench.submit("c1")
        bench.wait_for(lambda: ("join", "b1", "c1") in bench.log)
        bench.gates["a1"].set()
        bench.wait_results("a1", "b1", "c1")
    assert bench.results == {"a1": "a1!", "b1": "b1!", "c1": "c1!"}  # from its own later batch, not an error
    assert ("launch", ["c1"]) in bench.log and bench.log.index(("launch", ["c1"])) > bench.log.index(("wait", "b1"))


def test_tasks_the_batch_cannot_take_stay_queued_for_a_later_launch() -> None:
    with _runtime() as runtime:
        bench = _Bench(runtime, room=1)
        _running_a1_with_b1_behind(bench)
        bench.submit("prefill1", "c1", "c2")  # prefill1 can't join; c1 fills the one free row; c2 waits
        bench.wait_for(lambda: ("join", "b1", "c1") in bench.log)
        bench.gates["a1"].set()
        bench.wait_results("a1", "b1", "c1", "c2", "prefill1")
    assert (
        bench.results["c1"] == "c1!late" and bench.results["c2"] == "c2!" and bench.results["prefill1"] == "prefill1!"
    )
    assert ("launch", ["prefill1", "c2"]) in bench.log  # in priority order, after b1's batch


def test_a_refused_task_is_queued_again_in_its_place() -> None:
    with _runtime() as runtime:
        bench = _Bench(runtime)
        _running_a1_with_b1_behind(bench)
        bench.submit("refuse1")
        bench.wait_for(lambda: len(runtime._queue) == 1 and ("launch", ["refuse1"]) not in bench.log)
        bench.gates["a1"].set()
        bench.wait_results("a1", "b1", "refuse1")
    assert bench.results["refuse1"] == "refuse1!" and ("launch", ["refuse1"]) in bench.log


def test_pop_matching_takes_only_accepted_tasks_of_the_kind_in_order_and_waits_once() -> None:
    queue = TaskQueue()

    def task(payload: str, kind: str = "decode", steps: int = 1) -> Task:
        return Task(lambda: None, 1.0, 1, None, None, kind=kind, merge_key="span", payload=payload, steps=steps)

    first = task("first")
    for t in (task("a"), task("other", kind="prefill"), task("big", steps=3), task("b"), task("no")):
        queue.push(t)
    taken = queue.pop_matching(first, lambda t: t.payload != "no", max_steps=2, timeout_s=0.0)
    assert [t.payload for t in taken or []] == ["a", "b"]  # "big" does not fit after "a"; "no" refused
    assert len(queue) == 3
    started = time.monotonic()
    assert queue.pop_matching(first, lambda t: t.payload == "none", max_steps=8, timeout_s=0.05) == []
    assert time.monotonic() - started >= 0.04
    queue.close()
    assert queue.pop_matching(first, lambda t: True, max_steps=8, timeout_s=0.0) is None
    assert not queue.requeue([task("late")])


def test_the_fake_is_a_joinable_batch() -> None:
    assert isinstance(_Launched([], "x", [], 1, None, set()), JoinableBatch)
