"""Loopback swarm fixtures: a bootstrap node (`python -m corolla.cli.run_dht`) and server processes
(`python -m corolla.cli.run_server`) on port 0, each in its own process group; the address they print is parsed,
every wait is bounded, and teardown kills whole process groups so nothing is left behind. Also a stock-client
stand-in (`ClientThread`, `InferenceStream`): a plain hivemind P2P calling the rpcs as a Petals client would."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from hivemind.compression.serialization import serialize_torch_tensor
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from corolla.protocol.packing import pack_args_kwargs
from corolla.protocol.rpc import TransformerConnectionHandler

T = TypeVar("T")

DHT_PEER_PREFIX = "corolla-dht: initial peer: "
SERVER_READY_PREFIX = "corolla-server: ready"
_READY_RE = re.compile(r"peer_id=(\S+) blocks=(\d+):(\d+) initial_peers=(.+)$")


class ManagedProcess:
    """A child process in its own session (process group) whose combined output is collected line by line."""

    def __init__(self, args: Sequence[str], *, name: str, env: dict[str, str] | None = None, cwd: str | None = None):
        self.name = name
        self.args = list(args)
        full_env = dict(os.environ)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        full_env.setdefault("COROLLA_LOGLEVEL", "INFO")
        if env:
            full_env.update(env)
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
            text=True,
            bufsize=1,
        )
        self.pgid = self.proc.pid  # leader of its own group
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"reader-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def wait_for_line(self, predicate: Callable[[str], bool], timeout_s: float, *, start: int = 0) -> str:
        """Returns the first line (from index `start`) satisfying `predicate`; fails on timeout or process exit."""
        deadline = time.monotonic() + timeout_s
        index = start
        with self._cond:
            while True:
                while index < len(self.lines):
                    if predicate(self.lines[index]):
                        return self.lines[index]
                    index += 1
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{self.name}: no expected line within {timeout_s} s; output:\n{self.tail()}")
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; output:\n{self.tail()}")
                self._cond.wait(min(remaining, 0.2))

    def tail(self, n: int = 60) -> str:
        with self._cond:
            return "\n".join(self.lines[-n:])

    def group_alive(self) -> bool:
        """True while any process of this group (the child or anything it started) lives."""
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # zombies still count for killpg; reap our direct child so it doesn't
        self.proc.poll()
        return _group_has_live_members(self.pgid)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def wait_group_gone(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.proc.poll()
            if not self.group_alive():
                return True
            time.sleep(0.1)
        return not self.group_alive()

    def kill_group(self, grace_s: float = 5.0) -> None:
        """SIGTERM to the leader (a clean shutdown: servers announce OFFLINE), SIGKILL to the whole group after
        `grace_s`; reaps the child."""
        self.signal(signal.SIGTERM)
        self.finish_kill(time.monotonic() + grace_s)

    def finish_kill(self, deadline: float) -> None:
        """Waits until `deadline` for the group to exit, then SIGKILLs whatever is left of it."""
        if not self.wait_group_gone(max(0.0, deadline - time.monotonic())):
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.wait_group_gone(5.0)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _group_has_live_members(pgid: int) -> bool:
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


class ServerProcess(ManagedProcess):
    peer_id: str = ""
    start_block: int = -1
    end_block: int = -1
    initial_peers: list[str]

    def wait_ready(self, timeout_s: float = 60.0, *, start: int = 0) -> ServerProcess:
        line = self.wait_for_line(lambda s: s.startswith(SERVER_READY_PREFIX), timeout_s, start=start)
        match = _READY_RE.search(line)
        assert match, f"unparsable ready line: {line!r}"
        self.peer_id = match.group(1)
        self.start_block, self.end_block = int(match.group(2)), int(match.group(3))
        self.initial_peers = match.group(4).split()
        return self

    def ready_lines(self) -> list[str]:
        with self._cond:
            return [line for line in self.lines if line.startswith(SERVER_READY_PREFIX)]


class Swarm:
    """Starts processes and remembers them so that `close()` kills every one of them."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.processes: list[ManagedProcess] = []
        self.initial_peers: list[str] = []

    def start_bootstrap(self, timeout_s: float = 60.0) -> ManagedProcess:
        proc = ManagedProcess([sys.executable, "-m", "corolla.cli.run_dht"], name="bootstrap")
        self.processes.append(proc)
        line = proc.wait_for_line(lambda s: s.startswith(DHT_PEER_PREFIX), timeout_s)
        self.initial_peers = [line[len(DHT_PEER_PREFIX) :].strip()]
        return proc

    def start_server(
        self,
        model_path: str | Path,
        *args: str,
        wait: bool = True,
        timeout_s: float = 90.0,
        name: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ServerProcess:
        command = [sys.executable, "-m", "corolla.cli.run_server", str(model_path)]
        if self.initial_peers and "--new_swarm" not in args:
            command += ["--initial_peers", *self.initial_peers]
        command += [
            "--device", "cpu", "--torch_dtype", "float32", "--cache_dir", str(self.workdir / "cache"),
            "--mean_block_selection_delay", "0.2", "--update_period", "2",
            *args,
        ]  # fmt: skip
        proc = ServerProcess(command, name=name or f"server{len(self.processes)}", env=env, cwd=str(self.workdir))
        self.processes.append(proc)
        if wait:
            proc.wait_ready(timeout_s)
        return proc

    def close(self, grace_s: float = 5.0) -> None:
        """SIGTERM to every process at once, then SIGKILL to the groups still alive after `grace_s`."""
        for proc in self.processes:
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in reversed(self.processes):
            proc.finish_kill(deadline)


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    """A fresh loopback swarm manager; every process it started is killed (whole group) at teardown."""
    manager = Swarm(tmp_path)
    try:
        yield manager
    finally:
        manager.close()


# ---- stock-client stand-in -----------------------------------------------------------------------------------


class ClientThread:
    """A hivemind P2P client living in its own event loop thread; `run(fn)` runs `await fn(stub)` there."""

    def __init__(self, initial_peers: list[str], server_peer_id: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-client", daemon=True)
        self.thread.start()
        self.p2p: P2P = self.call(
            P2P.create(
                initial_peers=initial_peers,
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                nat_port_map=False,
                auto_nat=False,
                use_relay=False,
                use_auto_relay=False,
            ),
            timeout_s=60,
        )
        self.peer_id = PeerID.from_base58(server_peer_id)
        self.stub = TransformerConnectionHandler.get_stub(self.p2p, self.peer_id)

    def stub_for(self, peer_id: str) -> Any:
        return TransformerConnectionHandler.get_stub(self.p2p, PeerID.from_base58(peer_id))

    def call(self, coro: Awaitable[T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def run(self, fn: Callable[[Any], Awaitable[T]], timeout_s: float = 30.0) -> T:
        return self.call(fn(self.stub), timeout_s)

    def info(self, uid: str = "") -> dict[str, Any]:
        async def go(stub: Any) -> dict[str, Any]:
            response = await stub.rpc_info(runtime_pb2.ExpertUID(uid=uid), timeout=10)
            return MSGPackSerializer.loads(response.serialized_info)

        return self.run(go)

    def close(self) -> None:
        try:
            self.call(self.p2p.shutdown(), timeout_s=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def make_request(
    uid: str, tensors: list[torch.Tensor], metadata: dict | bytes | None = None
) -> runtime_pb2.ExpertRequest:
    raw = metadata if isinstance(metadata, bytes) else MSGPackSerializer.dumps(metadata or {})
    return runtime_pb2.ExpertRequest(uid=uid, tensors=[serialize_torch_tensor(t) for t in tensors], metadata=raw)


def packed_request(uid: str, *args: torch.Tensor, **metadata: Any) -> runtime_pb2.ExpertRequest:
    """Like a Petals client: tensors via `pack_args_kwargs` and `args_structure` in metadata."""
    tensors, structure = pack_args_kwargs(*args)
    return make_request(uid, tensors, {**metadata, "args_structure": structure})


class InferenceStream:
    """One `rpc_inference` stream driven step by step (a queue feeds the request iterator)."""

    def __init__(self, client: ClientThread, peer_id: str | None = None):
        self.client = client
        self.stub = client.stub if peer_id is None else client.stub_for(peer_id)
        self.queue: asyncio.Queue | None = None
        self.responses: Any = None

    def open(self) -> InferenceStream:
        async def go(stub: Any) -> None:
            self.queue = asyncio.Queue()

            async def requests() -> Any:
                while True:
                    item = await self.queue.get()
                    if item is None:
                        return
                    yield item

            self.responses = (await self.stub.rpc_inference(requests())).__aiter__()

        self.client.run(go)
        return self

    def step(self, request: runtime_pb2.ExpertRequest, timeout_s: float = 20.0) -> runtime_pb2.ExpertResponse:
        async def go(_stub: Any) -> runtime_pb2.ExpertResponse:
            await self.queue.put(request)
            return await asyncio.wait_for(self.responses.__anext__(), timeout_s)

        return self.client.run(go, timeout_s + 5)

    def close(self, timeout_s: float = 10.0) -> None:
        """Sends the empty request that ends a session and reads the stream to its end."""

        async def go(_stub: Any) -> None:
            await self.queue.put(runtime_pb2.ExpertRequest())
            await self.queue.put(None)
            try:
                while True:
                    await asyncio.wait_for(self.responses.__anext__(), timeout_s)
            except (StopAsyncIteration, Exception):
                pass

        self.client.run(go, timeout_s + 5)

    def abort(self) -> None:
        """Drops the connection without the closing message (like a crashed client)."""

        async def go(_stub: Any) -> None:
            await self.responses.aclose()

        self.client.run(go)


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def start_inprocess_server(model_path: str | Path, cache_dir: str | Path, **overrides: Any) -> Any:
    """A `Server` on a tiny model in this process (own thread and loop), new private swarm, CPU float32."""
    from corolla.server.config import ServerConfig
    from corolla.server.server import Server

    settings: dict[str, Any] = dict(
        model_name_or_path=str(model_path),
        new_swarm=True,
        throughput=10.0,
        torch_dtype="float32",
        update_period_s=30.0,
        cache_dir=str(cache_dir),
    )
    settings.update(overrides)
    return Server(ServerConfig(**settings)).start(timeout_s=90)
