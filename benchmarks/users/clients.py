"""The client side of the many-users bench (`benchmarks.users`): the client processes, each driving its share of the
sessions, and where they run.

Two client kinds (`--clients`): `petals`, each session a stock-Petals-style hivemind stub stream
(`users.petals_stream.PetalsStream`: `stub.rpc_inference(async generator)`, a queue, hivemind's writer task; over the same-host
socket a `LocalInferenceStream` driven the same way), and `corolla`, each session a `client.session.span_session.SpanSession`
driven as `InferenceSession` drives a one-span chain (`CorollaStream`: opened over the same-host socket, the direct
port or p2p; the prefill on the loop, each decode step `SpanSession.step_here` in the session's own thread).
`--client_cpus` emulates clients on other machines: the client processes (and the p2pd daemons they start, which
inherit it) run only on those CPUs, the server side on the others (`os.sched_setaffinity`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from benchmarks.users.config import UsersConfig
from corolla.utils.logging import get_logger

if TYPE_CHECKING:
    import multiprocessing

    from hivemind.p2p import P2P

    from corolla.client.session.span_session import SpanSession

logger = get_logger(__name__)

CLIENT_DESCRIPTIONS = {
    "petals": "stock-Petals-style rpc_inference streams (hivemind stub: an async generator fed by a queue, "
    "hivemind's writer task; over the socket a LocalInferenceStream driven the same way)",
    "corolla": "corolla's client as InferenceSession drives a one-span chain (client.session.span_session.SpanSession: "
    "opened over client.transport.p2p_stream.P2PInferenceStream on the client's p2pd / client.transport.local_transport."
    "LocalInferenceStream / client.transport.direct_transport.DirectInferenceStream on the server's direct port, ticket over "
    "p2p; the prefill on the client's loop, every decode step SpanSession.step_here in the session's own thread: "
    "send, wait in poll(2), parse)",
}
_P2P_FLAGS = dict(nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
_LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
PREFILLS_AT_ONCE = 8  # per client process: users arrive spread out, not all with their prompt at one instant
OPEN_TIMEOUT_S = 30.0


# ---- where the clients and the server run


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPUs of a list such as `10-15`, `12,13,14,15` or `0-3,8` (ValueError for anything else or an empty list)."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a CPU number or a range a-b") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a range of CPU numbers >= 0")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpus(cpus: frozenset[int] | set[int]) -> str:
    """`0-3,8` for {0, 1, 2, 3, 8}."""
    ranges: list[str] = []
    for cpu in sorted(cpus):
        if ranges and int(ranges[-1].split("-")[-1]) == cpu - 1:
            ranges[-1] = f"{ranges[-1].split('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)


@dataclass(frozen=True)
class CpuSplit:
    """The client processes' CPUs and the server side's (the rest of this process's CPUs)."""

    clients: frozenset[int]
    server: frozenset[int]
    runtime: frozenset[int] = frozenset()  # of the server's: the runtime thread's alone (empty: shares them)

    @classmethod
    def parse(cls, text: str, available: frozenset[int] | None = None) -> CpuSplit:
        """`text` as `parse_cpu_list`, checked against `available` (default: the CPUs this process may run on);
        ValueError naming those CPUs for an unknown CPU or when none is left for the server."""
        have = available if available is not None else frozenset(os.sched_getaffinity(0))
        clients = parse_cpu_list(text)
        unknown = clients - have
        if unknown:
            raise ValueError(
                f"--client_cpus {text!r}: CPU(s) {format_cpus(unknown)} unknown; this machine has CPUs {format_cpus(have)}"
            )
        server = have - clients
        if not server:
            raise ValueError(
                f"--client_cpus {text!r} leaves no CPU for the server; this machine has CPUs {format_cpus(have)}"
            )
        return cls(clients, server)

    def with_runtime(self, text: str) -> CpuSplit:
        """The same with the runtime thread alone on `text`'s CPUs (some of the server's; list a core's SMT sibling
        too to keep it free), every other server-side thread and process on the rest of the server's."""
        runtime = parse_cpu_list(text)
        if not runtime <= self.server or runtime == self.server:
            raise ValueError(
                f"--runtime_cpus {text!r}: must be some, not all, of the server's CPUs {format_cpus(self.server)}"
            )
        return CpuSplit(self.clients, self.server, runtime)

    @property
    def server_rest(self) -> frozenset[int]:
        """The server side's CPUs but the runtime thread's own."""
        return self.server - self.runtime

    def describe(self) -> str:
        text = (
            f"client processes and their p2pd daemons pinned to CPUs {format_cpus(self.clients)}; the server side "
            f"(bench process, its p2pd, handler processes, their forkserver) to CPUs {format_cpus(self.server)}"
        )
        if self.runtime:
            text += (
                f", of which the runtime thread alone runs on {format_cpus(self.runtime)} (every other server-side "
                f"thread and handler process on {format_cpus(self.server_rest)})"
            )
        return text


def isolate_runtime_thread(cpus: CpuSplit, runtime_tid: int, handler_pids: list[int]) -> None:
    """Puts the runtime thread (native id `runtime_tid`) alone on `cpus.runtime` and every other thread of this
    process and of the handler processes on `cpus.server_rest` (the server's p2pd daemon keeps the server's CPUs)."""
    pids: list[int | str] = ["self", *handler_pids]
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):  # a handler process that ended meanwhile
            _set_all_threads(cpus.server_rest, pid)
    os.sched_setaffinity(runtime_tid, cpus.runtime)


def _set_all_threads(cpus: frozenset[int] | set[int], pid: int | str = "self") -> None:
    """Every thread of process `pid` (`os.sched_setaffinity(0, ...)` sets only the calling thread's) on `cpus`;
    threads and processes started later inherit it."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def pinned(cpus: frozenset[int] | None) -> Iterator[None]:
    """This process's threads (and what they start meanwhile) on `cpus` while the block runs (None: unchanged)."""
    if cpus is None:
        yield
        return
    before = frozenset(os.sched_getaffinity(0))
    _set_all_threads(cpus)
    try:
        yield
    finally:
        _set_all_threads(before)


# ---- one session as corolla's client drives it


class CorollaStream:
    """One session as `InferenceSession` drives a one-span chain: `SpanSession.open` (the same-host socket, the direct
    port or p2p, as `ClientConfig` says), the prefill through `SpanSession.step` on the loop (a session's first
    step always is), then every decode step through `SpanSession.step_here` in the session's own thread (send, wait
    in `poll(2)`, parse: no hop to the loop; `InferenceSession._step_here` for a chain of socket streams), counted
    in `steps_in_flight` as `InferenceSession.step` counts it. The interface is `users.petals_stream.PetalsStream`'s (`open`,
    `step`, `close`) plus `step_sync` for the decode steps."""

    def __init__(
        self,
        p2p: P2P,
        peer_id_b58: str,
        num_blocks: int,
        max_length: int,
        transport: str,
        prefix: str,
        timeout_s: float,
    ):
        from corolla.client.calls.remote_forward_backward import NO_HYPO_IDS, NO_PROMPTS
        from corolla.client.config import ClientConfig
        from corolla.client.routing.sequence_manager import RemoteSequenceManager
        from corolla.client.session.forwarding import StepForwarding
        from corolla.client.session.span_session import SpanSession, steps_in_flight
        from corolla.protocol.records import RemoteSpanInfo, ServerInfo, ServerState
        from corolla.protocol.uids import make_uid

        self.p2p, self.peer_id, self.transport = p2p, peer_id_b58, transport
        config = ClientConfig(
            local_transport=transport == "socket",
            direct_transport=transport == "direct",
            max_retries=0,
            request_timeout_s=timeout_s,
            liveness_check_period_s=0,  # its pings would run on corolla's client loop, not this process's own
        )
        uids = [make_uid(prefix, i) for i in range(num_blocks)]
        # no DHT, no thread: the request encoder's, rpc_info's and the direct port's tickets (over this p2p)
        self.manager = RemoteSequenceManager(config, uids, start_updates=False, p2p=p2p)
        info = ServerInfo(ServerState.ONLINE, 1.0, start_block=0, end_block=num_blocks)
        self.session: SpanSession = SpanSession(
            self.manager, RemoteSpanInfo(peer_id_b58, 0, num_blocks, info), max_length
        )
        self.forwarding = StepForwarding(config.server_forwarding)  # InferenceSession's step ids (next_step_id)
        self._dummy, self._dummy_int64, self._steps_in_flight = NO_PROMPTS, NO_HYPO_IDS, steps_in_flight

    async def open(self) -> CorollaStream:
        await self.session.open()
        opened = self.session.transport
        if opened != {"socket": "local"}.get(self.transport, self.transport):
            raise RuntimeError(f"the session opened over {opened}, not {self.transport}")
        return self

    def _step_args(self, position: int) -> dict:
        step_id = self.forwarding.take_step_id()
        extra = self.forwarding.request_extra([self.session], 0, position, step_id, allowed=False)
        return dict(position=position, prompts=self._dummy, hypo_ids=self._dummy_int64, step_id=step_id, extra=extra)

    async def step(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """A step on the loop (`SpanSession.step`): the prefill."""
        outputs, _ = await self.session.step(hidden, position, **self._step_args(position))
        return outputs

    def step_sync(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """A decode step in the calling thread (`SpanSession.step_here`)."""
        if not self.session.can_step_here():
            raise RuntimeError("the session cannot step in this thread (no open socket stream)")
        with self._steps_in_flight():
            outputs, _ = self.session.step_here(hidden, position, **self._step_args(position))
        return outputs

    async def close(self) -> None:
        """`SpanSession.close`: the empty request that ends the server session, the end of our input stream, the
        server's last messages, then the socket."""
        await self.session.close()


# ---- the client processes


@dataclass(frozen=True)
class ClientJob:
    """What one client process runs: `num_sessions` sessions of `config` against the server at `maddrs`."""

    maddrs: list[str]
    peer_id_b58: str
    prefix: str  # the server's DHT prefix: the block uids are prefix.0 ... prefix.{num_layers - 1}
    num_layers: int
    config: UsersConfig
    num_sessions: int
    hidden_size: int
    dtype_name: str
    seed: int
    cpus: frozenset[int] | None  # the CPUs this process and its p2pd run on (None: inherited)
    keep_outputs: bool = False  # report every session's outputs (tests compare client kinds)


def client_process(
    job: ClientJob, ready: multiprocessing.Queue, go: threading.Event, results: multiprocessing.Queue
) -> None:
    """A client process's body: its CPUs first (before its P2P and p2pd exist), then its sessions; the result dict
    (errors, latencies, finished, windows, prefill_ms, cpu_s, cpus, seed, maybe outputs) goes to `results`."""
    try:
        if job.cpus is not None:
            os.sched_setaffinity(0, job.cpus)  # one thread here (forked from the forkserver): p2pd inherits it
        result = asyncio.run(_client_sessions(job, ready, go))
    except BaseException as e:  # reported to the parent, which counts the sessions as lost
        result = {"errors": [f"client process failed: {e!r}"[:300]], "latencies": [], "finished": 0}
    result["cpus"], result["seed"] = sorted(os.sched_getaffinity(0)), job.seed
    results.put(result)


async def _client_sessions(job: ClientJob, ready: multiprocessing.Queue, go: threading.Event) -> dict:
    from hivemind.p2p import P2P, PeerID

    from benchmarks.users.cpu_share import client_cpu
    from benchmarks.users.petals_stream import PetalsStream
    from corolla.protocol.rpc import get_stub
    from corolla.protocol.uids import make_chain

    config, k, h = job.config, job.num_sessions, job.hidden_size
    torch.manual_seed(job.seed)
    dtype = getattr(torch, job.dtype_name)
    max_length = config.prefix_tokens + config.decode_steps + 8
    prefix = torch.randn(1, config.prefix_tokens, h).to(dtype)
    tokens = [torch.randn(1, 1, h).to(dtype) for _ in range(8)]
    p2p = await P2P.create(initial_peers=job.maddrs, host_maddrs=_LOOPBACK, **_P2P_FLAGS)
    errors: list[str] = []
    latencies: list[list[float]] = [[] for _ in range(k)]
    warmup: list[list[float]] = [[] for _ in range(k)]  # each session's untimed first steps, ms
    outputs: list[list[list[float]]] = [[] for _ in range(k)]  # per session: the prefill's last row, each step's
    windows: list[tuple[float, float]] = []
    rates: list[float] = []  # each finished session's decode steps over its own window
    prefill_ms: list[float] = []  # client-observed, all of this process's sessions prefilling at once
    finished = 0
    cpu_s = (0.0, 0.0)  # this process and its p2pd over the decode window
    local = config.transport == "socket"
    try:
        streams: list[PetalsStream | CorollaStream]
        if config.client == "corolla":
            streams = [
                await CorollaStream(
                    p2p, job.peer_id_b58, job.num_layers, max_length, config.transport, job.prefix,
                    config.step_timeout_s,
                ).open()
                for _ in range(k)
            ]  # fmt: skip
        else:
            stub = get_stub(p2p, PeerID.from_base58(job.peer_id_b58))
            chain = make_chain(job.prefix, 0, job.num_layers)
            peer = job.peer_id_b58 if local else None
            streams = [await PetalsStream(stub, chain, max_length, peer).open() for _ in range(k)]

        gate = asyncio.Semaphore(PREFILLS_AT_ONCE)

        async def prefill(i: int) -> None:
            async with gate:
                t0 = time.perf_counter()
                out = await asyncio.wait_for(streams[i].step(prefix, 0), config.step_timeout_s)
                prefill_ms.append((time.perf_counter() - t0) * 1000)
                if job.keep_outputs:
                    outputs[i].append(out[0, -1].float().tolist())

        await asyncio.gather(*(prefill(i) for i in range(k)))
        ready.put(k)
        if not await asyncio.to_thread(go.wait, config.start_timeout_s):
            raise TimeoutError("no start signal")

        def record(i: int, step: int, out: torch.Tensor, t0: float) -> None:
            if out.shape != (1, 1, h):
                raise ValueError(f"response of shape {tuple(out.shape)}")
            if step >= config.warmup_steps:
                latencies[i].append((time.perf_counter() - t0) * 1000)
            else:
                warmup[i].append((time.perf_counter() - t0) * 1000)
            if job.keep_outputs:
                outputs[i].append(out[0, 0].float().tolist())

        def decode_here(stream: CorollaStream, i: int) -> None:  # a corolla session's decode steps, in its thread
            for step in range(config.decode_steps):
                t0 = time.perf_counter()
                record(i, step, stream.step_sync(tokens[step % len(tokens)], config.prefix_tokens + step), t0)

        async def decode(i: int) -> None:
            nonlocal finished
            stream = streams[i]
            start = time.time()
            done = False
            try:
                if isinstance(stream, CorollaStream):
                    await loop.run_in_executor(threads, decode_here, stream, i)
                else:
                    for step in range(config.decode_steps):
                        t0 = time.perf_counter()
                        position = config.prefix_tokens + step
                        out = await asyncio.wait_for(
                            stream.step(tokens[step % len(tokens)], position), config.step_timeout_s
                        )
                        record(i, step, out, t0)
                finished += 1
                done = True
            except Exception as e:
                errors.append(f"session {i}: {e!r}"[:300])
            finally:
                end = time.time()
                windows.append((start, end))
                if done:  # a finished session's own tok/s, over the same window
                    rates.append(config.decode_steps / (end - start))
                await stream.close()

        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(max_workers=k, thread_name_prefix="session") as threads:
            cpu_before = client_cpu()
            await asyncio.gather(*(decode(i) for i in range(k)))
            cpu_after = client_cpu()
        cpu_s = (cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1])
    finally:
        await p2p.shutdown()
    result: dict = {
        "errors": errors,
        "latencies": latencies,
        "warmup_ms": warmup,
        "finished": finished,
        "windows": windows,
        "session_rates": rates,
        "prefill_ms": prefill_ms,
        "cpu_s": cpu_s,
    }
    if job.keep_outputs:
        result["outputs"] = outputs
    return result
