"""A private loopback swarm of child processes: a bootstrap node (`python -m corolla.cli.run_dht`) and servers
(`python -m corolla.cli.run_server`), their printed addresses parsed, every wait bounded, and everything stopped
(servers first, then the bootstrap node) when the `LocalSwarm` context ends. The CLIs run as subprocesses only."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from corolla.utils.logging import get_logger
from corolla.utils.processes import ChildProcess

logger = get_logger(__name__)

DHT_PEER_PREFIX = "corolla-dht: initial peer: "
SERVER_READY_PREFIX = "corolla-server: ready"
_READY_RE = re.compile(r"peer_id=(\S+) blocks=(\d+):(\d+) initial_peers=(.+)$")


def ready_line(peer_id: str, start_block: int, end_block: int, initial_peers: Sequence[str]) -> str:
    """The line a server prints once it serves its blocks (`ServerProcess.wait_ready` parses it)."""
    peers = " ".join(initial_peers)
    return f"{SERVER_READY_PREFIX} peer_id={peer_id} blocks={start_block}:{end_block} initial_peers={peers}"


@dataclass(frozen=True)
class LocalSwarmConfig:
    """How children are started: flags for every server (before each call's own), extra environment, where their
    logs go (`<log_dir>/<name>.log`; None = none), echo to our stderr, and the default bounds of waits and stops."""

    server_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    echo: bool = False
    startup_timeout_s: float = 90.0
    stop_grace_s: float = 10.0


class ServerProcess(ChildProcess):
    """A `corolla.cli.run_server` child; `wait_ready()` parses its ready line into the fields below."""

    peer_id: str = ""
    start_block: int = -1
    end_block: int = -1
    initial_peers: list[str]

    def wait_ready(self, timeout_s: float, *, start: int = 0) -> ServerProcess:
        """Waits (bounded) for the ready line from output index `start` on and records what it says."""
        line = self.wait_for_line(lambda s: s.startswith(SERVER_READY_PREFIX), timeout_s, start=start)
        match = _READY_RE.search(line)
        if match is None:
            raise ValueError(f"{self.name}: unparsable ready line {line!r}")
        self.peer_id = match.group(1)
        self.start_block, self.end_block = int(match.group(2)), int(match.group(3))
        self.initial_peers = match.group(4).split()
        return self

    def ready_lines(self) -> list[str]:
        with self._cond:
            return [line for line in self.lines if line.startswith(SERVER_READY_PREFIX)]


def even_block_ranges(num_blocks: int, num_servers: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal block ranges [start, end) for up to `num_servers` servers (never an empty one)."""
    if num_servers < 1 or num_blocks < 1:
        raise ValueError(f"need num_servers >= 1 and num_blocks >= 1, got {num_servers} and {num_blocks}")
    n = min(num_servers, num_blocks)
    bounds = [round(i * num_blocks / n) for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


class LocalSwarm:
    """`with LocalSwarm(config) as swarm:` then `swarm.start(model, [(0, 2), (2, 4)])` (or `start_bootstrap()` and
    `start_server(...)` one by one); `swarm.initial_peers` joins it. Every process started through it (or appended
    to `processes`) is stopped when the block ends, normally, by an exception or by Ctrl-C."""

    bootstrap_class: type[ChildProcess] = ChildProcess
    server_class: type[ServerProcess] = ServerProcess

    def __init__(self, config: LocalSwarmConfig | None = None):
        self.config = config or LocalSwarmConfig()
        self.processes: list[ChildProcess] = []
        self.servers: list[ServerProcess] = []
        self.bootstrap: ChildProcess | None = None
        self.initial_peers: list[str] = []
        self._started_at: float | None = None

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _spawn(
        self,
        cls: type[ChildProcess],
        args: Sequence[str],
        name: str,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> ChildProcess:
        if self._started_at is None:
            self._started_at = time.perf_counter()
        c = self.config
        process = cls(
            [sys.executable, "-m", *args],
            name=name,
            env={**c.env, **(env or {})},
            cwd=cwd,
            log_path=c.log_dir / f"{name}.log" if c.log_dir is not None else None,
            echo=c.echo,
        )
        self.processes.append(process)
        return process

    def start_process(
        self, module: str, *args: str, name: str, env: Mapping[str, str] | None = None, cwd: str | Path | None = None
    ) -> ChildProcess:
        """Starts `python -m module args` (a health page, an API, a client) as a process the swarm owns: it is
        stopped with the servers, however the block ends. Does not wait for it."""
        return self._spawn(ChildProcess, [module, *args], name, env, cwd)

    def start_bootstrap(self, timeout_s: float | None = None) -> ChildProcess:
        """Starts the bootstrap node and waits (bounded) for the address it prints, which becomes `initial_peers`."""
        process = self._spawn(self.bootstrap_class, ["corolla.cli.run_dht"], "bootstrap")
        self.bootstrap = process
        timeout_s = self.config.startup_timeout_s if timeout_s is None else timeout_s
        line = process.wait_for_line(lambda s: s.startswith(DHT_PEER_PREFIX), timeout_s)
        self.initial_peers = [line[len(DHT_PEER_PREFIX) :].strip()]
        logger.info(f"local_swarm.bootstrap_ready(initial_peers={self.initial_peers[0]})")
        return process

    def start_server(
        self,
        model: str | Path,
        *args: str,
        block_indices: tuple[int, int] | None = None,
        num_blocks: int | None = None,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        wait: bool = True,
        timeout_s: float | None = None,
        module: str = "corolla.cli.run_server",
    ) -> ServerProcess:
        """Launches a server of `model` joining `initial_peers` (unless `--new_swarm` is among `args`) with
        `config.server_args` then `args`; with `wait`, waits (bounded) until it is ready. `module`: what runs it
        (`python -m module`, taking `run_server`'s arguments: a benchmark's misbehaving server)."""
        if block_indices is not None and num_blocks is not None:
            raise ValueError("pass block_indices or num_blocks, not both")
        command = [module, str(model)]
        if self.initial_peers and "--new_swarm" not in args:
            command += ["--initial_peers", *self.initial_peers]
        if block_indices is not None:
            command += ["--block_indices", f"{block_indices[0]}:{block_indices[1]}"]
        if num_blocks is not None:
            command += ["--num_blocks", str(num_blocks)]
        command += [*self.config.server_args, *args]
        server = self._spawn(self.server_class, command, name or f"server{len(self.servers)}", env, cwd)
        assert isinstance(server, ServerProcess)
        self.servers.append(server)
        if wait:
            server.wait_ready(self.config.startup_timeout_s if timeout_s is None else timeout_s)
        return server

    def start(self, model: str | Path, block_ranges: Sequence[tuple[int, int]], *, wait: bool = True) -> LocalSwarm:
        """Starts the bootstrap node, then one server per block range (all loading in parallel); with `wait`, waits
        for them all (else call `wait_servers_ready()`)."""
        self.start_bootstrap()
        for start, end in block_ranges:
            self.start_server(model, block_indices=(start, end), wait=False)
        if wait:
            self.wait_servers_ready()
        return self

    def wait_servers_ready(self, timeout_s: float | None = None) -> float:
        """Waits until every started server is ready, all within `timeout_s` (default `startup_timeout_s`).
        Returns the seconds since the swarm's first process started."""
        deadline = time.monotonic() + (self.config.startup_timeout_s if timeout_s is None else timeout_s)
        for server in self.servers:  # they load in parallel; wait for each in turn
            server.wait_ready(max(0.0, deadline - time.monotonic()))
            logger.info(
                f"local_swarm.server_ready(peer_id={server.peer_id}, blocks={server.start_block}:{server.end_block})"
            )
        elapsed_s = time.perf_counter() - (self._started_at or time.perf_counter())
        logger.info(f"local_swarm.ready(servers={len(self.servers)}, startup_s={elapsed_s:.1f})")
        return elapsed_s

    def close(self, grace_s: float | None = None) -> None:
        """Stops every process: first all but the bootstrap node (SIGTERM to all at once, so clean shutdowns overlap,
        then SIGKILL to the groups still alive after `grace_s`), so servers can still announce OFFLINE through it;
        then the bootstrap node the same way."""
        grace_s = self.config.stop_grace_s if grace_s is None else grace_s
        others = [p for p in self.processes if p is not self.bootstrap]
        for batch in (others, [self.bootstrap] if self.bootstrap is not None else []):
            for process in batch:
                process.terminate()
            deadline = time.monotonic() + grace_s
            for process in reversed(batch):
                process.stop(max(0.0, deadline - time.monotonic()))
        if self.processes:
            logger.info(f"local_swarm.stopped(processes={len(self.processes)})")
