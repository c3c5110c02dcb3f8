"""`--client_cpus` of the many-users bench (`benchmarks.users.clients`): the CPU list's syntax, the checks against the
CPUs this machine has, and `pinned` putting every thread of the process on a set and back."""

from __future__ import annotations

import os
import threading

import pytest

from benchmarks.users.clients import CpuSplit, format_cpus, parse_cpu_list, pinned

MACHINE = frozenset(range(16))


def test_cpu_lists_parse_as_ranges_and_single_cpus() -> None:
    assert parse_cpu_list("10-15") == frozenset(range(10, 16))
    assert parse_cpu_list("12,13,14,15") == frozenset(range(12, 16))
    assert parse_cpu_list("0-3,8") == frozenset({0, 1, 2, 3, 8})
    assert parse_cpu_list("7") == frozenset({7})
    assert format_cpus(frozenset({0, 1, 2, 3, 8, 10, 11})) == "0-3,8,10-11"
    for bad in ("", "a", "3-1", "-1", "1-", "1,,2", "1-2-3"):
        with pytest.raises(ValueError, match="CPU list"):
            parse_cpu_list(bad)


def test_client_cpus_leave_the_rest_to_the_server() -> None:
    split = CpuSplit.parse("10-15", MACHINE)
    assert split.clients == frozenset(range(10, 16)) and split.server == frozenset(range(10))
    assert "CPUs 10-15" in split.describe() and "CPUs 0-9" in split.describe()


def test_unknown_cpus_and_no_cpu_left_for_the_server_are_refused() -> None:
    with pytest.raises(ValueError, match=r"CPU\(s\) 16-17 unknown; this machine has CPUs 0-15"):
        CpuSplit.parse("14-17", MACHINE)
    with pytest.raises(ValueError, match="leaves no CPU for the server; this machine has CPUs 0-15"):
        CpuSplit.parse("0-15", MACHINE)
    have = frozenset(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=f"this machine has CPUs {format_cpus(have)}"):
        CpuSplit.parse(str(max(have) + 1))  # default: the CPUs this process may run on


class _AffinityWitness:
    """A thread started now that, once `report()` is called, notes the CPUs it may run on and ends."""

    def __init__(self) -> None:
        self.seen: list[frozenset[int]] = []
        self._started, self._go = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        self._started.wait(10)

    def _run(self) -> None:
        self._started.set()
        self._go.wait(10)
        self.seen.append(frozenset(os.sched_getaffinity(0)))

    def report(self) -> list[frozenset[int]]:
        self._go.set()
        self.thread.join(10)
        return self.seen


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_pinned_moves_every_thread_and_restores() -> None:
    before = frozenset(os.sched_getaffinity(0))
    target = frozenset({min(before)})
    witness = _AffinityWitness()  # a thread that exists before the pin
    with pinned(target):
        assert frozenset(os.sched_getaffinity(0)) == target
        seen = witness.report()
    assert seen == [target]
    assert frozenset(os.sched_getaffinity(0)) == before
    with pinned(None):
        assert frozenset(os.sched_getaffinity(0)) == before


def test_runtime_cpus_are_some_of_the_servers() -> None:
    split = CpuSplit.parse("10-15", MACHINE).with_runtime("0,8")
    assert split.runtime == frozenset({0, 8}) and split.server_rest == frozenset({1, 2, 3, 4, 5, 6, 7, 9})
    assert "runtime thread alone runs on 0,8" in split.describe() and "on 1-7,9" in split.describe()
    for bad in ("12", "0-9", "9-10"):  # a client's CPU, all of the server's, partly a client's
        with pytest.raises(ValueError, match="some, not all, of the server's CPUs 0-9"):
            CpuSplit.parse("10-15", MACHINE).with_runtime(bad)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_runtime_thread_runs_alone_on_its_cpus() -> None:
    from benchmarks.users.clients import isolate_runtime_thread

    before = frozenset(os.sched_getaffinity(0))
    runtime_cpu, rest = min(before), before - {min(before)}
    split = CpuSplit(frozenset(), before, frozenset({runtime_cpu}))
    with pinned(before):  # every thread of the test process back on its CPUs afterwards
        runtime_thread = _AffinityWitness()
        assert runtime_thread.thread.native_id is not None
        isolate_runtime_thread(split, runtime_thread.thread.native_id, [])
        assert frozenset(os.sched_getaffinity(0)) == rest  # this (main) thread: the rest of the server's
        assert runtime_thread.report() == [frozenset({runtime_cpu})]
    assert frozenset(os.sched_getaffinity(0)) == before
