"""Child processes that cannot be left behind: `ChildProcess` runs a command in its own process group (told to die
with us on Linux), keeps every output line for bounded waits, and stops the whole group (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

_PR_SET_PDEATHSIG = 1
_REAP_TIMEOUT_S = 5.0  # after SIGKILL: how long to wait for the group to vanish and the child to be reaped


def _libc_prctl() -> Any | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _libc_prctl()


def parent_death_signal_supported() -> bool:
    """True where `set_parent_death_signal` works (Linux)."""
    return _prctl is not None


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Asks Linux to send `sig` to this process when the thread that created it exits. False where unsupported."""
    if _prctl is None:
        return False
    return _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


class _Spawner:
    """One thread that lives as long as the process and forks every child started from another non-main thread:
    Linux fires PR_SET_PDEATHSIG when the *thread* that forked the child exits, so a child forked by a short-lived
    worker thread would die with that thread, and one forked without the signal outlives its parent (a client left
    orphaned when a harness is killed). Forking here gives such children the signal, tied to the process's life."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[tuple[Callable[[], Any], threading.Event, list[Any]]] = []
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def run(self, fn: Callable[[], Any]) -> Any:
        done = threading.Event()
        result: list[Any] = []
        with self._lock:
            if self._thread is None or self._pid != os.getpid():  # none yet, or inherited dead through a fork
                self._thread, self._pid = (
                    threading.Thread(target=self._loop, name="corolla-spawner", daemon=True),
                    os.getpid(),
                )
                self._thread.start()
            self._jobs.append((fn, done, result))
            self._wake.notify()
        done.wait()
        value, error = result
        if error is not None:
            raise error
        return value

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._jobs:
                    self._wake.wait()
                fn, done, result = self._jobs.pop(0)
            try:
                result.extend([fn(), None])
            except BaseException as e:  # handed to the caller
                result.extend([None, e])
            done.set()


_spawner = _Spawner()


def _die_with(parent_pid: int) -> None:
    # Runs in the child between fork and exec: SIGTERM when the parent dies (even by SIGKILL), so the child shuts
    # down cleanly instead of being orphaned; exits at once if the parent is already gone.
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:
        os._exit(1)


def group_has_live_members(pgid: int) -> bool:
    """True if a non-zombie process of process group `pgid` exists (`killpg(pgid, 0)` also succeeds for zombies)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


class ChildProcess:
    """`with ChildProcess([...], name="server0") as child:` runs the command in its own session (process group) with
    stdout and stderr merged; `lines` holds every output line (also written to `log_path` and, with `echo`, to our
    stderr as `[name] line`). Leaving the block stops the whole group.

    `die_with_parent` sets PR_SET_PDEATHSIG (SIGTERM) in the child. Linux ties it to the spawning *thread*, so a child
    started from another thread is forked by a thread that lives as long as the process (`_Spawner`)."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        name: str,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        log_path: Path | None = None,
        echo: bool = False,
        die_with_parent: bool = True,
    ):
        self.name = name
        self.args = list(args)
        self.log_path = log_path
        self.lines: list[str] = []
        self._echo = echo
        self._cond = threading.Condition()
        self._terminated = False
        self._stopped = False
        self._log: IO[str] | None = open(log_path, "w", encoding="utf-8") if log_path is not None else None
        preexec: Callable[[], None] | None = None
        if die_with_parent and parent_death_signal_supported():
            parent_pid = os.getpid()
            preexec = lambda: _die_with(parent_pid)  # noqa: E731
        in_main_thread = threading.current_thread() is threading.main_thread()
        try:
            popen = lambda: subprocess.Popen(  # noqa: E731
                self.args,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                cwd=cwd,
                start_new_session=True,  # own group: Ctrl-C in a terminal reaches only us; we stop it (and its own
                preexec_fn=preexec,  # children: DHT process, p2pd) as one
                text=True,
                bufsize=1,
            )
            # outside the main thread, fork from the process-long spawner thread (see _Spawner)
            self.proc = popen() if preexec is None or in_main_thread else _spawner.run(popen)
        except BaseException:
            if self._log is not None:
                self._log.close()
            raise
        self.pgid = self.proc.pid  # the leader of its own group
        self._reader = threading.Thread(target=self._read, name=f"reader-{name}", daemon=True)
        self._reader.start()
        logger.info(f"processes.started(name={name}, pid={self.proc.pid})")

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            if self._log is not None:
                self._log.write(raw)
                self._log.flush()
            if self._echo:
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------------------------------------ output

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def tail(self, n: int = 60) -> str:
        """The last `n` output lines, for error messages."""
        with self._cond:
            return "\n".join(self.lines[-n:])

    def wait_for_line(self, predicate: Callable[[str], bool], timeout_s: float, *, start: int = 0) -> str:
        """The first output line (from index `start`) satisfying `predicate`. TimeoutError after `timeout_s`,
        RuntimeError if the process exits (and its output ends) without printing one."""
        deadline = time.monotonic() + timeout_s
        index = start
        with self._cond:
            while True:
                while index < len(self.lines):
                    if predicate(self.lines[index]):
                        return self.lines[index]
                    index += 1
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}; output:\n{self.tail()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{self.name}: no expected line within {timeout_s} s; output:\n{self.tail()}")
                self._cond.wait(min(remaining, 0.2))

    # ----------------------------------------------------------------------------------------------- control

    def signal(self, sig: int) -> None:
        """Sends `sig` to the child only (not its group), if it still runs."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def terminate(self) -> None:
        """Asks the child for a clean shutdown (SIGTERM, once); it stops its own children. Does not wait."""
        if not self._terminated:
            self._terminated = True
            self.signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int:
        """The child's exit code; `subprocess.TimeoutExpired` after `timeout_s`."""
        return self.proc.wait(timeout=timeout_s)

    def group_alive(self) -> bool:
        """True while any process of this group (the child or anything it started) lives."""
        self.proc.poll()  # reap our own child so that its zombie does not count
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return group_has_live_members(self.pgid)

    def wait_group_gone(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for every process of the group to exit; True if they all did."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.group_alive():
                return True
            time.sleep(0.05)
        return not self.group_alive()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the child (a clean shutdown: a server announces OFFLINE and stops its DHT process and p2pd),
        SIGKILL to the whole group if anything of it is still alive after `grace_s`; reaps the child and closes its
        output. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.terminate()
        if not self.wait_group_gone(grace_s):
            logger.warning(f"processes.stop_timeout(name={self.name}, grace_s={grace_s}): killing its group")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGKILL)
            self.wait_group_gone(_REAP_TIMEOUT_S)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=_REAP_TIMEOUT_S)
        self._reader.join(timeout=2.0)
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()
        if self._log is not None and not self._reader.is_alive():
            self._log.close()
            self._log = None
        logger.info(f"processes.stopped(name={self.name}, returncode={self.proc.returncode})")
