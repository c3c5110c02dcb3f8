"""Loopback swarm fixtures on `corolla.swarm.local.LocalSwarm`: a bootstrap node and server processes on port 0,
each in its own process group, every wait bounded, teardown killing whole process groups so nothing is left behind.
Also a stock-client stand-in (`ClientThread`, `InferenceStream`): a plain hivemind P2P calling the rpcs as a Petals
client would."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from hivemind.compression.serialization import serialize_torch_tensor
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from corolla.client.transport.framed_socket import MAX_RESPONSE_FRAME_BYTES
from corolla.client.transport.local_transport import LocalInferenceStream, responses_of
from corolla.protocol.packing import pack_args_kwargs
from corolla.protocol.rpc import TransformerConnectionHandler
from corolla.protocol.uids import make_chain
from corolla.swarm.local import LocalSwarm, LocalSwarmConfig
from corolla.swarm.local import ServerProcess as LocalServerProcess
from corolla.swarm.reachability import ReachabilityProtocol
from corolla.utils.processes import ChildProcess

T = TypeVar("T")


class ManagedProcess(ChildProcess):
    """A `ChildProcess` logging at INFO unless COROLLA_LOGLEVEL says otherwise (tests read the log lines)."""

    def __init__(self, args: Sequence[str], *, name: str, env: dict[str, str] | None = None, **kwargs: Any):
        loglevel = os.environ.get("COROLLA_LOGLEVEL", "INFO")
        super().__init__(args, name=name, env={"COROLLA_LOGLEVEL": loglevel, **(env or {})}, **kwargs)

    def kill_group(self, grace_s: float = 5.0) -> None:
        """SIGTERM to the child (a clean shutdown), SIGKILL to its whole group after `grace_s`; reaps it."""
        self.stop(grace_s)


class ServerProcess(LocalServerProcess, ManagedProcess):
    """A server child (`wait_ready()`, `peer_id`, `start_block`, `end_block`, `initial_peers`) with test logging."""


# A server process's heartbeat (s), as stock Petals' default: every record a test reads by default is the one a server
# stores when it starts (JOINING, then ONLINE before its ready line) or changes state (drain, OFFLINE), so it needs no
# heartbeat; a 2 s one cost each idle server ~1 CPU s a 30 s (its DHT process, p2pd and main loop; dev VM), over
# every server of every swarm test. A test relying on records expiring or on refreshed figures passes its own
# `--update_period` (later flags win) and says why at the call.
SERVER_UPDATE_PERIOD_S = 60.0
# For those: a killed server's record expires within 2 periods (`--expiration` default), here 4 s.
SHORT_UPDATE_PERIOD = ("--update_period", "2")


class Swarm(LocalSwarm):
    """A `LocalSwarm` with test defaults (CPU float32, fast block selection, Petals' heartbeat, cache and server
    working directory in `workdir`); `close()` stops every process in `processes`, appended ones included."""

    bootstrap_class = ManagedProcess
    server_class = ServerProcess

    def __init__(self, workdir: Path):
        server_args = (
            "--device", "cpu", "--torch_dtype", "float32", "--cache_dir", str(workdir / "cache"),
            "--mean_block_selection_delay", "0.2", "--update_period", str(SERVER_UPDATE_PERIOD_S),
        )  # fmt: skip
        super().__init__(LocalSwarmConfig(server_args=server_args, startup_timeout_s=90.0, stop_grace_s=5.0))
        self.workdir = workdir

    def start_bootstrap(self, timeout_s: float = 60.0) -> ChildProcess:
        return super().start_bootstrap(timeout_s)

    def start_server(  # type: ignore[override]
        self,
        model_path: str | Path,
        *args: str,
        wait: bool = True,
        timeout_s: float = 90.0,
        name: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ServerProcess:
        server = super().start_server(
            model_path, *args, wait=wait, timeout_s=timeout_s, name=name, env=env, cwd=self.workdir
        )
        assert isinstance(server, ServerProcess)
        return server

    def close(self, grace_s: float | None = None) -> None:
        """Like `LocalSwarm.close`, but the bootstrap node is asked to stop together with the rest (its shutdown
        overlaps theirs: shorter teardowns; the swarm is discarded anyway)."""
        for process in self.processes:
            process.terminate()
        super().close(grace_s)


@contextmanager
def bootstrapped(workdir: Path, timeout_s: float = 60.0) -> Iterator[Swarm]:
    """A `Swarm` in `workdir` with its bootstrap node started; every process it started is stopped on exit."""
    swarm = Swarm(workdir)
    try:
        swarm.start_bootstrap(timeout_s)
        yield swarm
    finally:
        swarm.close()


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


def chain(server: Any, start: int, end: int) -> str:
    """The uid chain of blocks `[start, end)` of an in-process server's model."""
    return make_chain(server.settings.dht_prefix, start, end)


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


def cache_used_bytes(server: Any) -> int:
    """Bytes of an in-process server's attention cache held by sessions now."""
    return server.service.executor.max_size_bytes - server.service.executor.bytes_left


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


@contextmanager
def connected_clients(server: Any, count: int) -> Iterator[list[ClientThread]]:
    """`count` `ClientThread`s (a libp2p identity and p2pd each) connected to the in-process `server`; every one
    made is closed on exit."""
    clients: list[ClientThread] = []
    try:
        for _ in range(count):
            clients.append(ClientThread(server.join_maddrs, server.peer_id))
        yield clients
    finally:
        for client in clients:
            client.close()


@contextmanager
def served_with_client(
    model_path: str | Path, cache_dir: str | Path, **overrides: Any
) -> Iterator[tuple[Any, ClientThread]]:
    """`start_inprocess_server` and one `ClientThread` connected to it; the client is closed and the server shut down
    on exit."""
    server = start_inprocess_server(model_path, cache_dir, **overrides)
    try:
        with connected_clients(server, 1) as (client,):
            yield server, client
    finally:
        server.shutdown()


@contextmanager
def inprocess_servers(
    spans: Sequence[tuple[str | Path, str] | tuple[str | Path, str, dict[str, Any]]],
    cache_dir: str | Path,
    initial_peers: Sequence[str],
    **overrides: Any,
) -> Iterator[list[Any]]:
    """`start_inprocess_server` for each `(model path, block indices "a:b"[, this server's own overrides])` of
    `spans` (in this order), all joining `initial_peers` and started at once; every one that started is shut down
    on exit (`shutdown()` is idempotent: a test may stop one earlier). For tests of what a server
    serves rather than of its process: no interpreter start-up (torch's import alone is ~5 s of CPU a server on a
    2-core VM)."""
    settings: dict[str, Any] = dict(new_swarm=False, initial_peers=tuple(initial_peers), throughput=1.0)
    settings.update(overrides)
    # hivemind's ServicerBase fills its class-wide table of rpcs lazily and without a lock: servers registering their
    # handlers at once from several threads saw a half-filled table, and one server registered no rpc_inference
    # with its p2pd (p2p clients then got "protocols not supported"). Filled once here, before the threads start.
    for servicer in (TransformerConnectionHandler, ReachabilityProtocol):
        servicer._collect_rpc_handlers()
    servers: list[Any] = []

    def own(span: tuple[Any, ...]) -> dict[str, Any]:
        return span[2] if len(span) > 2 else {}

    with ThreadPoolExecutor(max(1, len(spans))) as pool:
        try:
            starting = [
                pool.submit(
                    start_inprocess_server, span[0], cache_dir, block_indices=span[1], **{**settings, **own(span)}
                )
                for span in spans
            ]
            wait(starting)  # every start is waited for, so a failed one leaves no server running
            servers += [future.result() for future in starting if future.exception() is None]
            for future in starting:
                if future.exception() is not None:
                    raise RuntimeError("an in-process server did not start") from future.exception()
            yield servers
        finally:
            list(pool.map(lambda server: server.shutdown(), servers))


async def open_local_inference(
    peer_id: str,
    requests: AsyncIterator[runtime_pb2.ExpertRequest],
    *,
    timeout_s: float,
    directory: Path | None = None,
) -> AsyncIterator[runtime_pb2.ExpertResponse] | None:
    """The response stream of `rpc_inference` at the same-host server `peer_id`, sending `requests`; None when that
    server has no usable socket here or does not accept (then nothing was read from `requests`)."""
    stream = await LocalInferenceStream.open(peer_id, timeout_s=timeout_s, directory=directory)
    if stream is None:
        return None
    return responses_of(stream, requests, MAX_RESPONSE_FRAME_BYTES)
