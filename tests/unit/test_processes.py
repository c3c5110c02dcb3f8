"""`ChildProcess`: output lines are captured and waited for within a bound, `stop()` leaves nothing of the child's
process group alive (even a grandchild ignoring SIGTERM), and a child dies with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from corolla.utils.processes import ChildProcess, group_has_live_members, parent_death_signal_supported

pytestmark = pytest.mark.timeout(60)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_dead(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_lines_are_captured_logged_and_waited_for(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    code = "import time\nprint('one')\nprint('two')\ntime.sleep(0.3)\nprint('ready port=123')\ntime.sleep(30)"
    with ChildProcess(_python(code), name="child", log_path=log) as child:
        assert child.wait_for_line(lambda s: s.startswith("ready"), 10) == "ready port=123"
        assert child.lines[:2] == ["one", "two"]
        assert child.wait_for_line(lambda s: s.startswith("t"), 1, start=1) == "two"
        assert child.tail(1) == "ready port=123"
    assert log.read_text().splitlines() == ["one", "two", "ready port=123"]
    assert child.proc.returncode is not None


def test_wait_for_line_times_out_within_its_bound() -> None:
    with ChildProcess(_python("import time\nprint('hello')\ntime.sleep(30)"), name="silent") as child:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="silent"):
            child.wait_for_line(lambda s: s == "never", 0.5)
        assert 0.4 < time.monotonic() - started < 5.0
        with pytest.raises(TimeoutError):  # a matching line before `start` does not count
            child.wait_for_line(lambda s: s == "hello", 0.2, start=1)


def test_wait_for_line_fails_fast_when_the_child_exits() -> None:
    with ChildProcess(_python("import sys\nprint('bye')\nsys.exit(3)"), name="quitter") as child:
        with pytest.raises(RuntimeError, match="code 3"):
            child.wait_for_line(lambda s: s == "never", 30)


def test_stop_kills_the_whole_group_including_a_stubborn_grandchild() -> None:
    grandchild = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('grandchild up', flush=True); "
        "time.sleep(60)"
    )
    code = f"""
        import subprocess, sys, time
        g = subprocess.Popen([sys.executable, "-c", {grandchild!r}])
        print(f"grandchild pid={{g.pid}}", flush=True)
        time.sleep(60)
    """
    child = ChildProcess(_python(code), name="parent")
    try:
        line = child.wait_for_line(lambda s: s.startswith("grandchild pid="), 20)
        grandchild_pid = int(line.split("=", 1)[1])
        child.wait_for_line(lambda s: s == "grandchild up", 20)
        assert os.getpgid(grandchild_pid) == child.pgid != os.getpgid(0)  # its own group, shared with descendants
        assert child.group_alive()
        started = time.monotonic()
        child.stop(grace_s=1.0)  # SIGTERM ends the child; the grandchild ignores it and gets SIGKILL
        assert time.monotonic() - started < 15.0
        assert not group_has_live_members(child.pgid)
        assert not child.group_alive()
        assert _wait_dead(grandchild_pid, 5.0)
    finally:
        child.stop(grace_s=0.0)


@pytest.mark.skipif(not parent_death_signal_supported(), reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.parametrize("from_thread", [False, True], ids=["main-thread", "short-lived-thread"])
def test_child_dies_with_its_parent(tmp_path: Path, from_thread: bool) -> None:
    # An intermediate Python process starts a ChildProcess from its main thread (or from a worker thread that ends
    # at once, as a harness starting clients concurrently would), then is SIGKILLed: no cleanup code runs in it, so
    # only the parent-death signal can stop the child (and it must not fire when the worker thread ends).
    parent_code = f"""
        import sys, threading, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2] / "src")!r})
        from corolla.utils.processes import ChildProcess
        start = lambda: ChildProcess([sys.executable, "-c", "import time; print('child up', flush=True); time.sleep(60)"],
                                     name="child")
        started = []
        if {from_thread!r}:
            worker = threading.Thread(target=lambda: started.append(start()))
            worker.start()
            worker.join()
            child = started[0]
        else:
            child = start()
        child.wait_for_line(lambda s: s == "child up", 20)
        print(f"child pid={{child.proc.pid}}", flush=True)
        time.sleep(60)
    """
    parent = subprocess.Popen(
        _python(parent_code), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
    child_pid = None
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()  # bounded by the test timeout; the parent prints it within seconds
        assert line.startswith("child pid="), line
        child_pid = int(line.strip().split("=", 1)[1])
        time.sleep(0.3)
        assert _alive(child_pid)  # alive after the thread that started it ended
        parent.kill()
        parent.wait(10)
        assert _wait_dead(child_pid, 10.0), "the child outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if child_pid is not None and _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)
        if parent.stdout is not None:
            parent.stdout.close()
