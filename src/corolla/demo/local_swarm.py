"""A private swarm of local processes for the demo: a bootstrap node and servers splitting the blocks, each child
in its own process group (and told to die with us), every wait bounded, everything stopped on exit or Ctrl-C."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DHT_PEER_PREFIX = "corolla-dht: initial peer: "
SERVER_READY_PREFIX = "corolla-server: ready"
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LocalSwarmConfig:
    """How to start the swarm: the model directory, the block ranges of the servers and the time limits."""

    model_dir: Path
    block_ranges: tuple[tuple[int, int], ...]
    work_dir: Path
    startup_timeout_s: float = 90.0
    stop_timeout_s: float = 15.0
    extra_server_args: tuple[str, ...] = ()


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM when the parent dies (even by SIGKILL), so no server outlives the demo."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the process groups are still stopped by LocalSwarm.close()


class ChildProcess:
    """A child in its own session whose output is collected line by line (and optionally echoed to a log file)."""

    def __init__(self, name: str, args: Sequence[str], *, log_path: Path, env: dict[str, str] | None = None):
        self.name = name
        self.log_path = log_path
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = open(log_path, "w", encoding="utf-8")  # closed in stop()
        self.proc = subprocess.Popen(
            list(args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            start_new_session=True,  # Ctrl-C in the terminal reaches us only; we stop children in order
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            text=True,
            bufsize=1,
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"demo-reader-{name}", daemon=True)
        self._reader.start()
        logger.info(f"local_swarm.process_started(name={name}, pid={self.proc.pid})")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for_line(self, predicate: Callable[[str], bool], deadline: float) -> str:
        """The first output line satisfying `predicate`; TimeoutError at `deadline` (monotonic), RuntimeError on exit."""
        checked = 0
        with self._cond:
            while True:
                for line in self.lines[checked:]:
                    if predicate(line):
                        return line
                checked = len(self.lines)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}:\n{self.tail()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{self.name} was not ready in time:\n{self.tail()}")
                self._cond.wait(min(remaining, 0.2))

    def tail(self, num_lines: int = 25) -> str:
        with self._cond:
            return "\n".join(self.lines[-num_lines:])

    def _group_alive(self) -> bool:
        self.proc.poll()  # reap our own child so a zombie does not count
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return _group_has_live_members(self.proc.pid)

    def _wait_group_gone(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._group_alive():
                return True
            time.sleep(0.05)
        return not self._group_alive()

    def stop(self, timeout_s: float) -> None:
        """SIGTERM to the child (it shuts down its DHT process and p2pd itself); SIGKILL to its whole group if
        anything of the group is still alive after `timeout_s`. Then closes the log."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        if not self._wait_group_gone(timeout_s):
            logger.warning(f"local_swarm.stop_timeout(process={self.name}, timeout_s={timeout_s}): killing its group")
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._wait_group_gone(5.0)
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(timeout=2.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


def _group_has_live_members(pgid: int) -> bool:
    """True if a non-zombie process of group `pgid` exists (killpg(0) also succeeds for zombies)."""
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


@dataclass
class ServerHandle:
    process: ChildProcess
    start_block: int
    end_block: int
    peer_id: str = ""


@dataclass
class LocalSwarm:
    """`with LocalSwarm(config) as swarm:` starts the bootstrap node and launches the servers (then
    `swarm.wait_servers_ready()`); leaving the block (normally, by an exception or Ctrl-C) stops servers first,
    then the bootstrap node."""

    config: LocalSwarmConfig
    initial_peers: list[str] = field(default_factory=list)
    dht: ChildProcess | None = None
    servers: list[ServerHandle] = field(default_factory=list)
    _deadline: float = 0.0
    _started_at: float = 0.0

    def __enter__(self) -> LocalSwarm:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _python(self, module: str, *args: str) -> list[str]:
        return [sys.executable, "-m", module, *args]

    def start(self) -> None:
        """Starts the bootstrap node (waits until it prints its address) and launches the servers without waiting."""
        c = self.config
        self._deadline = time.monotonic() + c.startup_timeout_s
        self._started_at = time.perf_counter()
        self.dht = ChildProcess("bootstrap", self._python("corolla.cli.run_dht"), log_path=c.work_dir / "dht.log")
        line = self.dht.wait_for_line(lambda s: s.startswith(DHT_PEER_PREFIX), self._deadline)
        self.initial_peers = [line[len(DHT_PEER_PREFIX) :].strip()]
        logger.info(f"local_swarm.bootstrap_ready(initial_peers={self.initial_peers[0]})")
        for index, (start, end) in enumerate(c.block_ranges):
            args = self._python(
                "corolla.cli.run_server",
                str(c.model_dir),
                "--initial_peers", *self.initial_peers,
                "--block_indices", f"{start}:{end}",
                "--device", "cpu",
                "--torch_dtype", "float32",
                "--throughput", "1.0",
                "--cache_dir", str(c.work_dir / "cache"),
                *c.extra_server_args,
            )  # fmt: skip
            process = ChildProcess(f"server{index}", args, log_path=c.work_dir / f"server{index}.log")
            self.servers.append(ServerHandle(process, start, end))

    def wait_servers_ready(self) -> float:
        """Waits (until `startup_timeout_s` after `start()`) for every server to announce itself online.
        Returns the seconds since `start()`."""
        for server in self.servers:  # they start in parallel; wait for each in turn
            line = server.process.wait_for_line(lambda s: s.startswith(SERVER_READY_PREFIX), self._deadline)
            server.peer_id = _field(line, "peer_id")
            logger.info(
                f"local_swarm.server_ready(peer_id={server.peer_id}, blocks={server.start_block}:{server.end_block})"
            )
        elapsed_s = time.perf_counter() - self._started_at
        logger.info(f"local_swarm.ready(servers={len(self.servers)}, startup_s={elapsed_s:.1f})")
        return elapsed_s

    def close(self) -> None:
        """Stops every child (servers first), each by SIGTERM to its group and SIGKILL after a grace period."""
        threads = [
            threading.Thread(target=server.process.stop, args=(self.config.stop_timeout_s,), daemon=True)
            for server in self.servers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.config.stop_timeout_s + 10.0)
        if self.dht is not None:
            self.dht.stop(self.config.stop_timeout_s)
        logger.info("local_swarm.stopped")

    def pids(self) -> list[int]:
        children = ([self.dht] if self.dht else []) + [server.process for server in self.servers]
        return [child.proc.pid for child in children]


def _field(line: str, key: str) -> str:
    for token in line.split():
        if token.startswith(key + "="):
            return token[len(key) + 1 :]
    raise ValueError(f"no {key}= in line {line!r}")
