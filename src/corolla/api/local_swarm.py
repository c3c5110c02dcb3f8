"""A private swarm on this machine for `corolla-api --new_swarm` and the demo: a bootstrap DHT node and servers
splitting a model's blocks evenly, each a child process in its own process group (all stopped on exit)."""

from __future__ import annotations

import functools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from corolla.swarm.dht import set_parent_death_signal
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DHT_PEER_PREFIX = "corolla-dht: initial peer: "
SERVER_READY_PREFIX = "corolla-server: ready"


def _die_with_parent(parent_pid: int) -> None:
    # Runs in the child before exec: if we are killed (even SIGKILL), the child gets SIGTERM and shuts down cleanly.
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:
        os._exit(1)


class _Child:
    """A child process whose output lines are forwarded to a queue (and to our stderr when `echo`)."""

    def __init__(self, args: Sequence[str], name: str, echo: bool):
        self.name = name
        self.proc = subprocess.Popen(
            list(args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            start_new_session=True,  # own process group: stopping it stops its p2pd and DHT process too
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=functools.partial(_die_with_parent, os.getpid()),
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._echo = echo
        threading.Thread(target=self._pump, name=f"pump-{name}", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if self._echo:
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.name} did not print {prefix!r} within {timeout_s} s") from None
            if line is None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.wait()} before printing {prefix!r}")
            if line.startswith(prefix):
                return line

    def stop(self, grace_s: float) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the group
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


class LocalSwarm:
    """`with LocalSwarm(model, num_servers=2) as swarm:` -> `swarm.initial_peers` of a ready loopback swarm."""

    def __init__(
        self,
        model: str,
        *,
        num_servers: int = 2,
        num_blocks: int | None = None,
        server_args: Sequence[str] = (),
        startup_timeout_s: float = 180.0,
        echo: bool = False,
    ):
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        self.model = model
        self.num_servers = num_servers
        self.num_blocks = num_blocks
        self.server_args = list(server_args)
        self.startup_timeout_s = startup_timeout_s
        self.echo = echo
        self.initial_peers: list[str] = []
        self._children: list[_Child] = []

    def _spans(self) -> list[tuple[int, int]]:
        num_blocks = self.num_blocks
        if num_blocks is None:
            from corolla.models.config import load_config

            num_blocks = int(load_config(self.model).num_hidden_layers)
        n = min(self.num_servers, num_blocks)
        bounds = [round(i * num_blocks / n) for i in range(n + 1)]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def start(self) -> LocalSwarm:
        try:
            dht = _Child([sys.executable, "-m", "corolla.cli.run_dht"], "dht", self.echo)
            self._children.append(dht)
            self.initial_peers = [dht.wait_for(DHT_PEER_PREFIX, self.startup_timeout_s)[len(DHT_PEER_PREFIX) :]]
            servers = []
            for i, (start, end) in enumerate(self._spans()):
                args = [sys.executable, "-m", "corolla.cli.run_server", self.model, "--initial_peers"]
                args += [*self.initial_peers, "--block_indices", f"{start}:{end}", *self.server_args]
                servers.append(_Child(args, f"server{i}", self.echo))
                self._children.append(servers[-1])
            for server in servers:
                logger.info(f"local_swarm.server_ready({server.wait_for(SERVER_READY_PREFIX, self.startup_timeout_s)})")
        except BaseException:
            self.close()
            raise
        return self

    def close(self, grace_s: float = 10.0) -> None:
        for child in reversed(self._children):  # servers first, so they can announce OFFLINE through the DHT
            child.stop(grace_s)
        self._children.clear()

    def __enter__(self) -> LocalSwarm:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
