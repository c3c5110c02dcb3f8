"""What a run left behind, read from `/proc`: live processes that carry a run's marker in their environment (every
child, fork and `p2pd` of the run inherits it) and orphans (a corolla or `p2pd` process whose parent is gone:
re-parented to init or to a sub-reaper). Linux only; elsewhere every scan is empty."""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

RUN_MARKER_ENV = "COROLLA_CHURN_RUN_ID"
_COROLLA_MODULE = re.compile(rb"(?:^|[\s;(])corolla\.[A-Za-z_]")


@dataclass(frozen=True)
class ProcessInfo:
    """One live process as `/proc` shows it; `cmdline` is space-joined and cut to 200 characters."""

    pid: int
    ppid: int
    comm: str
    cmdline: str
    marked: bool  # carries the run marker in its environment

    def describe(self) -> str:
        return f"pid {self.pid} (ppid {self.ppid}) {self.comm}: {self.cmdline}"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def runs_corolla(cmdline: bytes) -> bool:
    """A corolla console script (`.../corolla-server`) or Python naming a corolla module (`-m corolla.cli...`);
    not merely a path that contains "corolla" (checkouts often live in a directory of that name)."""
    for arg in cmdline.split(b"\0"):
        if arg.rsplit(b"/", 1)[-1].startswith(b"corolla-") or _COROLLA_MODULE.search(arg):
            return True
    return False


def scan_processes(run_id: str | None = None) -> list[ProcessInfo]:
    """Live (non-zombie) `p2pd` and corolla processes, plus any process marked with `run_id`."""
    marker = f"{RUN_MARKER_ENV}={run_id}".encode() if run_id else None
    found: list[ProcessInfo] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _read(entry / "stat").decode(errors="replace").rsplit(")", 1)[-1].split()
        if len(fields) < 2 or fields[0] in ("Z", "X"):
            continue
        cmdline = _read(entry / "cmdline")
        comm = _read(entry / "comm").decode(errors="replace").strip()
        marked = marker is not None and marker in _read(entry / "environ").split(b"\0")
        if not (marked or comm == "p2pd" or runs_corolla(cmdline)):
            continue
        readable = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()[:200]
        found.append(ProcessInfo(int(entry.name), int(fields[1]), comm, readable, marked))
    return found


def find_leftovers(run_id: str, *, own_pid: int | None = None) -> tuple[list[ProcessInfo], list[ProcessInfo]]:
    """`(leaked, foreign_orphans)`: the run's marked processes still alive (except this one), and orphaned corolla /
    `p2pd` processes (parent is init) that do not carry the marker: another run's, reported but never counted
    against this run."""
    own_pid = os.getpid() if own_pid is None else own_pid
    leaked, foreign = [], []
    for info in scan_processes(run_id):
        if info.pid == own_pid:
            continue
        if info.marked:
            leaked.append(info)
        elif info.ppid == 1:
            foreign.append(info)
    return leaked, foreign


def orphans_among(leaked: list[ProcessInfo], *, own_pid: int | None = None) -> list[ProcessInfo]:
    """The leaked processes whose parent is gone: neither this process nor another of the run's processes (an
    orphan is re-parented to init or to a sub-reaper, which never carries the run's marker)."""
    own_pid = os.getpid() if own_pid is None else own_pid
    run_pids = {info.pid for info in leaked} | {own_pid}
    return [info for info in leaked if info.ppid not in run_pids]


def wait_for_no_leftovers(run_id: str, grace_s: float) -> tuple[list[ProcessInfo], list[ProcessInfo]]:
    """`find_leftovers`, retried for up to `grace_s` while the run's processes are still exiting."""
    deadline = time.monotonic() + grace_s
    leaked, foreign = find_leftovers(run_id)
    while leaked and time.monotonic() < deadline:
        time.sleep(0.25)
        leaked, foreign = find_leftovers(run_id)
    return leaked, foreign


def kill_all(processes: list[ProcessInfo]) -> None:
    """SIGKILL to each listed process (so a failed run still leaves nothing behind)."""
    for info in processes:
        try:
            os.kill(info.pid, signal.SIGKILL)
        except OSError:
            pass
        else:
            logger.warning(f"leftovers.killed({info.describe()})")
