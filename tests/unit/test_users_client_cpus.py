"""`--client_cpus` of the many-users bench (`bench.users_clients`): the CPU list's syntax, the checks against the
CPUs this machine has, and `pinned` putting every thread of the process on a set and back."""

from __future__ import annotations

import os
import threading

import pytest

from corolla.bench.users_clients import CpuSplit, format_cpus, parse_cpu_list, pinned

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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_pinned_moves_every_thread_and_restores() -> None:
    before = frozenset(os.sched_getaffinity(0))
    target = frozenset({min(before)})
    started, done = threading.Event(), threading.Event()
    seen: list[frozenset[int]] = []

    def worker() -> None:  # a thread that exists before the pin
        started.set()
        done.wait(10)
        seen.append(frozenset(os.sched_getaffinity(0)))

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait(10)
    with pinned(target):
        assert frozenset(os.sched_getaffinity(0)) == target
        done.set()
        thread.join(10)
    assert seen == [target]
    assert frozenset(os.sched_getaffinity(0)) == before
    with pinned(None):
        assert frozenset(os.sched_getaffinity(0)) == before
