"""Suite-wide checks. The process-leak check fails the run if a `p2pd`, a DHT process or a corolla process started
by these tests is still alive at the end (after a grace period), and kills what it finds.

Attribution is robust to other test runs on the same machine: at session start we put a unique
`COROLLA_TEST_RUN_ID` into the environment, which every process we exec inherits (hivemind copies `os.environ` for
p2pd). Forked processes (hivemind's DHT process) keep the environment of the original exec, so they are recognised
as descendants of this process with its command line.

Under pytest-xdist the workers order the collected files longest first (`helpers.file_order`), and the controller
records each file's duration when `COROLLA_TEST_DURATIONS_OUT` names a file (the Makefile does)."""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from pathlib import Path

import pytest

from helpers.file_order import (
    COMMITTED_DURATIONS,
    DURATIONS_OUT_ENV,
    DurationRecorder,
    expected_durations,
    longest_files_first,
    read_durations,
)

RUN_ID_ENV = "COROLLA_TEST_RUN_ID"
LEAK_GRACE_S = 5.0


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


_COROLLA_MODULE = re.compile(rb"(?:^|[\s;(])corolla\.[A-Za-z_]")


def _runs_corolla(cmdline: bytes) -> bool:
    """A corolla console script (`.../corolla-dht`) or Python code naming a corolla module (`-m corolla.cli...`);
    not merely a path that contains "corolla" (CI checkouts often live in a directory of that name)."""
    for arg in cmdline.split(b"\0"):
        if arg.rsplit(b"/", 1)[-1].startswith(b"corolla-") or _COROLLA_MODULE.search(arg):
            return True
    return False


def find_leaked_processes(run_id: str, *, own_pid: int | None = None) -> dict[int, str]:
    """`{pid: description}` of live p2pd / DHT / corolla processes that are descendants of this process or carry
    `run_id` in their environment (orphans). DHT processes are forks of their owner, so they share its command
    line; other helpers (e.g. multiprocessing's resource tracker) have a different one and are not counted."""
    own_pid = os.getpid() if own_pid is None else own_pid
    own_cmdline = _read(Path(f"/proc/{own_pid}/cmdline"))
    marker = f"{RUN_ID_ENV}={run_id}".encode()
    parents: dict[int, int] = {}
    states: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _read(entry / "stat").decode(errors="replace").rsplit(")", 1)[-1].split()
            if len(fields) >= 2:
                states[int(entry.name)], parents[int(entry.name)] = fields[0], int(fields[1])

    def is_descendant(pid: int) -> bool:
        for _ in range(64):
            pid = parents.get(pid, 0)
            if pid == own_pid:
                return True
            if pid <= 1:
                return False
        return False

    leaked = {}
    for pid, state in states.items():
        if pid == own_pid or state == "Z":  # zombies are already dead
            continue
        entry = Path(f"/proc/{pid}")
        cmdline = _read(entry / "cmdline")
        ours = is_descendant(pid) or marker in _read(entry / "environ").split(b"\0")
        if not ours:
            continue
        comm = _read(entry / "comm").decode(errors="replace").strip()
        readable = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()[:200]
        if comm == "p2pd" or cmdline == own_cmdline or _runs_corolla(cmdline):
            leaked[pid] = f"{comm}: {readable}"
    return leaked


@pytest.fixture
def leak_finder():
    """The leak detector of this run, for tests that check it."""
    return find_leaked_processes


def pytest_sessionstart(session: pytest.Session) -> None:
    os.environ[RUN_ID_ENV] = uuid.uuid4().hex


if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # started as a background job of a non-interactive shell (`make test &`): SIGINT is ignored, every process the
    # tests start would inherit that, and the Ctrl-C tests would fail; a handled signal is SIG_DFL after exec
    signal.signal(signal.SIGINT, signal.default_int_handler)
_SIGINT_AT_START = signal.getsignal(signal.SIGINT)
_MASK_AT_START = signal.pthread_sigmask(signal.SIG_BLOCK, [])


@pytest.fixture(autouse=True)
def _process_state_restored(request: pytest.FixtureRequest):
    """Process-wide state a test may leave behind for the next tests of its worker: the SIGINT disposition and the
    signal mask (children inherit an ignored or blocked SIGINT, so a later Ctrl-C test's CLI would not stop), and
    logging handlers bound to a stream that was closed (a test's captured stderr). Restored after each test, with a
    warning naming the test that changed it."""
    yield
    import logging
    import sys
    import warnings

    if signal.getsignal(signal.SIGINT) is not _SIGINT_AT_START:
        warnings.warn(f"{request.node.nodeid} left the SIGINT handler changed: restored", stacklevel=1)
        signal.signal(signal.SIGINT, _SIGINT_AT_START)
    if signal.pthread_sigmask(signal.SIG_BLOCK, []) != _MASK_AT_START:
        warnings.warn(f"{request.node.nodeid} left signals blocked: restored", stacklevel=1)
        signal.pthread_sigmask(signal.SIG_SETMASK, _MASK_AT_START)
    for name in ("", "corolla", "hivemind"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
                handler.stream = sys.stderr  # not setStream: it flushes the closed one first


def pytest_configure(config: pytest.Config) -> None:
    out = os.environ.get(DURATIONS_OUT_ENV)
    # the controller sees every worker's reports; only whole files are worth recording (no -k, no single tests)
    whole_files = not config.option.keyword and not any("::" in arg for arg in config.args)
    if out and whole_files and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(
            DurationRecorder(Path(out), read_durations(COMMITTED_DURATIONS)), "corolla-duration-recorder"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On xdist workers: files longest first (with `--no-loadscope-reorder`, the order xdist hands them out in)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = longest_files_first(items, expected_durations())


@pytest.hookimpl(trylast=True)  # after session-scoped fixtures were torn down
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    run_id = os.environ.get(RUN_ID_ENV)
    if not run_id or not Path("/proc/self/environ").exists():
        return
    deadline = time.monotonic() + LEAK_GRACE_S
    leaked = find_leaked_processes(run_id)
    while leaked and time.monotonic() < deadline:
        time.sleep(0.25)
        leaked = find_leaked_processes(run_id)
    if not leaked:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"process leak check: {len(leaked)} process(es) started by the tests survived:"]
    lines += [f"  pid {pid}: {what}" for pid, what in sorted(leaked.items())]
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if reporter is not None:
        reporter.write("\n")
    for line in lines:
        if reporter is not None:
            reporter.write_line(line, red=True)
        else:
            print(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
