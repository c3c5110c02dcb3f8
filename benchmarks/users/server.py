"""Many users at once through one real server, measured as users meet it.

One corolla span server runs in this process (hivemind P2P on loopback, the `rpc_inference` handler, the runtime
thread, the same-host socket endpoint); the clients run in several other processes (forked from one forkserver
that imported torch and hivemind once; each with its own P2P instance or unix-socket connections), each driving
some of the sessions as a stock Petals client does (`rpc_inference` stream, session metadata,
`start_from_position`) or as corolla's client does (its own p2pd or socket streams, `UsersConfig.client`); with
`BenchServer(cpus=...)` the clients and the server side run on separate CPUs (`users.clients`). All sessions prefill, wait at a common start, then decode `decode_steps` tokens each.
Reported: aggregate decode tokens/s, each client step (median, p90, worst; the worst session's median), steps merged
per forward and the runtime thread's busy share (from the runtime's own per-kind counters), errors and sessions that
did not finish.

CPU use: `python -m benchmarks.users --cpu` (a ~160M-parameter Llama-shaped span, float32); the GPU run
is `python -m benchmarks.users --gpu_layers N` or `python -m benchmarks.serving --rpc --users ...`.
"""

from __future__ import annotations

import asyncio
import collections
import math
import multiprocessing
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from benchmarks.common.measure import median, percentile
from benchmarks.common.model import ModelShape
from benchmarks.users.clients import (
    ClientJob,
    CpuSplit,
    client_process,
    isolate_runtime_thread,
    pinned,
)
from benchmarks.users.config import UsersConfig
from benchmarks.users.timeline import (
    saved_timeline_summary,
    timeline_by_process,
    timeline_dir,
    window_breakdown,
)
from corolla.utils.logging import get_logger

if TYPE_CHECKING:
    from benchmarks.users.cpu_share import CpuProbe
    from corolla.server.core.engine_executor import EngineExecutor
    from corolla.server.core.runtime import Runtime
    from corolla.server.span_service import SpanService

logger = get_logger(__name__)

ServingPath = Literal["fused", "eager"]
_P2P_FLAGS = dict(nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
_LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
DHT_PREFIX = "bench"
# the runtime kinds that run inference steps (plain path: one task per session step; fast path: merged steps)
INFERENCE_KINDS = ("inference", "engine_inference")
MAX_LENGTH_TOKENS = 4096
MAX_BATCH_SIZE_TOKENS = 16384


@dataclass
class UsersResult:
    sessions: int
    client_processes: int
    transport: str
    serving_path: str
    aggregate_tokens_per_s: float  # every session's steps over the window from the first start to the last end
    step_median_ms: float
    step_p90_ms: float
    step_worst_ms: float
    worst_session_median_ms: float
    steps_per_merged_forward: float
    device_busy_share: float
    merged_forward_ms: float
    wall_s: float
    sessions_finished: int
    prefill_median_ms: float  # client-observed prefill of `prefix_tokens` (each process's sessions at once)
    errors: list[str] = field(default_factory=list)
    num_handlers: int = 1  # processes serving the p2p streams (1: the server's own loop; server.handler_pool)
    # CPU microseconds per decode step (all sessions' steps in the window) per process / thread (bench.cpu_share)
    cpu_us_per_step: dict[str, float] = field(default_factory=dict)
    gather_fraction: float = 0.5  # the runtime's gather rule (server.gather) while this row ran
    handler_poll_ms: float = 0.0  # handler processes polled this long after each message (0: they slept)
    held_launches: bool = False  # the runtime held its launches at the row's end (`GatherRule.holds_launch`)
    launch_rule: str = "automatic"  # "forced": the run spec forced the launch decision (report.ForcedLaunch)
    rule_return_ms: float = math.nan  # at the row's end: the gather rule's learned return time and last merged forward
    rule_forward_ms: float = math.nan
    held_launch_count: int = 0  # launches that waited for the forward in flight (`Runtime.num_held_launches`)
    launch_count: int = 0  # batches the runtime ran in the row (`Runtime.num_batches_done`): the held share's whole
    held_launch_ms: float = math.nan  # at the row's end: a held launch's learned seconds (`Runtime.launch_s`)
    client: str = "petals"  # the client kind (clients.CLIENT_KINDS)
    client_cpus: list[int] = field(default_factory=list)  # CPUs of the client processes (empty: not pinned)
    server_cpus: list[int] = field(default_factory=list)  # CPUs of the server side (empty: not pinned)
    runtime_cpus: list[int] = field(default_factory=list)  # of those, the runtime thread's alone (empty: shared)
    # where a step's time went in the handler processes (`--timeline`: `timeline_summary`), ms
    timeline_ms: dict[str, float] = field(default_factory=dict)
    timeline_by_process: list[tuple[float, float]] = field(default_factory=list)  # (round trip, step) p50 ms each
    sessions_per_handler: list[int] = field(default_factory=list)  # this row's sessions opened by each process
    window_ms: dict[str, float] = field(default_factory=dict)  # timeline.window_breakdown
    # each finished session's steps over its own window, summed: the rate while all run (no start-up or drain)
    session_rates_tok_s: float = float("nan")
    repeat: int = 0  # which of `--repeats` measured it
    # measured on the device (CUDA events around each launched forward; nan where none was): the share of the
    # window it spent on forwards, and a merged forward's own time (`merged_forward_ms` is the runtime thread's view)
    device_time_share: float = float("nan")
    device_forward_ms: float = float("nan")
    # a row's start: each untimed first step's median / worst ms over the sessions (`warmup_ms`: "step0_p50", ...),
    # the gather rule's learned return and forward at the start signal, the merged forwards (and their rows) run in
    # the first 100 ms after it, and the steps run inline on an idle runtime during the row
    start: dict[str, float] = field(default_factory=dict)


# ---- the server (this process)


def build_executor(
    shape: ModelShape,
    dtype: torch.dtype,
    device: torch.device,
    *,
    num_layers: int,
    serving_path: ServingPath,
    cache_bytes: int,
    seed: int = 0,
    model: torch.nn.Module | None = None,
) -> EngineExecutor:
    """The span executor of a random-weight span of `num_layers` corolla llama blocks, as the server builds it
    (`engine_executor`): the engine over its paged pool on fused kernels, or running the blocks eagerly over it
    (`serving_path` "fused" or "eager"; the steps of all sessions merged into one forward either way).
    `model`: a transformers `LlamaModel` of `shape` whose first layers' weights the blocks take (default: a new
    random one)."""
    from benchmarks.common.model import build_blocks, build_hf_model
    from corolla.engine import EngineConfig, SpanEngine
    from corolla.server.backend import SpanBackend
    from corolla.server.core.engine_executor import EngineExecutor
    from corolla.server.core.runtime import Runtime

    small = ModelShape(**{**asdict(shape), "num_layers": num_layers})
    source = model if model is not None else build_hf_model(small, dtype, device, seed=seed)
    blocks = build_blocks(source, small, dtype, device, num_layers)
    del source
    backend = SpanBackend(blocks, config=small.hf_config(), dtype=dtype, device=device)
    runtime = Runtime(max_batch_size_tokens=MAX_BATCH_SIZE_TOKENS, device=device)
    config = EngineConfig(kv_pool_bytes=cache_bytes, max_seq_len_tokens=MAX_LENGTH_TOKENS)
    engine = SpanEngine.from_blocks([backend.blocks[i] for i in sorted(backend.blocks)], config,
                                    fused=serving_path == "fused")  # fmt: skip
    if engine.graphs is not None:  # as the server's warm-up does: no row measures a graph's capture
        engine.graphs.capture_all()
    executor = EngineExecutor(backend, engine, runtime)
    if executor.path != serving_path:
        raise RuntimeError(f"asked for the {serving_path} path, the server built {executor.path}")
    return executor


class BenchServer:
    """One span server on its own asyncio loop thread in this process, listening on loopback only."""

    def __init__(
        self,
        executor: EngineExecutor,
        *,
        hidden_size: int,
        num_layers: int,
        dtype,
        device,
        num_handlers: int = 1,
        cpus: CpuSplit | None = None,
        handler_poll_s: float | None = None,
    ):
        from corolla.server import config
        from corolla.server.front.block_functions import ServingLimits

        self.executor, self.device, self.num_handlers = executor, device, num_handlers
        # handler processes poll after each message (`FrontSettings.poll_linger_s`); None: as a server's default settings do
        default_s = config.busy_poll_s(config.ServerConfig.busy_poll_ms, torch.device(device).type)
        self.handler_poll_s = default_s if handler_poll_s is None else handler_poll_s
        self.cpus = cpus  # set: this process runs on cpus.server while serving, the client processes on cpus.clients
        self.num_layers, self.hidden_size, self.dtype = num_layers, hidden_size, dtype
        self.limits = ServingLimits(
            dht_prefix=DHT_PREFIX,
            start_block=0,
            end_block=num_layers,
            hidden_size=hidden_size,
            dtype=dtype,
            inference_max_length_tokens=MAX_LENGTH_TOKENS,
            max_batch_size_tokens=MAX_BATCH_SIZE_TOKENS,
        )
        self.maddrs: list[str] = []
        self.peer_id_b58 = ""
        # (perf_counter at its end, steps) of the last merged batches (`Runtime.add_batch_observer`): a row's start
        self.batches: collections.deque[tuple[float, int]] = collections.deque(maxlen=4096)
        executor.runtime.add_batch_observer(self._observe_batch)
        self.service: SpanService | None = None
        self.loop_thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @contextmanager
    def running(self, keep_runtime: bool = False) -> Iterator[BenchServer]:
        """Serves until the block ends; with `cpus`, this process's threads run on the server's CPUs meanwhile, set
        before the loop thread, the P2P (its p2pd) and the handler processes' forkserver exist (they inherit it)."""
        with pinned(self.cpus.server if self.cpus is not None else None):
            with self._serving(keep_runtime) as server:
                yield server

    @contextmanager
    def _serving(self, keep_runtime: bool) -> Iterator[BenchServer]:
        from hivemind.p2p import P2P

        from corolla.protocol.local_stream import socket_dir
        from corolla.server.core.limits import PeerLimits, SessionTimeouts
        from corolla.server.front.direct_endpoint import DirectListen
        from corolla.server.front.front_settings import FrontSettings
        from corolla.server.span_service import SpanService
        from corolla.utils.busy_poll import BusyPollSelector

        _start_forkserver()  # here: on the server's CPUs, before the loop thread exists
        selector = BusyPollSelector()
        loop = asyncio.SelectorEventLoop(selector)
        thread = threading.Thread(target=loop.run_forever, name="bench-users-server", daemon=True)
        thread.start()
        self.loop_thread, self.loop = thread, loop

        def on_loop(coro, timeout_s: float = 120.0):
            return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

        p2p = service = None
        try:
            p2p = on_loop(P2P.create(host_maddrs=_LOOPBACK, **_P2P_FLAGS))
            settings = FrontSettings(
                self.limits,
                SessionTimeouts(step_timeout_s=120, session_timeout_s=1800, request_timeout_s=120),
                # one bench process plays many users: the per-peer fair-use caps (sessions, KV share) would refuse
                # them (every socket client is the one peer "local"), so they are lifted here; the rest stay default
                PeerLimits(max_sessions_per_peer=0, max_kv_fraction_per_peer=1.0),
                local_socket_dir=str(socket_dir()),
                direct=DirectListen("127.0.0.1", 0, ("127.0.0.1",)),  # corolla clients' direct port (loopback)
                poll_linger_s=self.handler_poll_s,
            )
            service = SpanService(
                self.executor,
                settings,
                busy_poll=selector if self.device.type == "cuda" else None,  # as the server does
                num_handlers=self.num_handlers,
            )
            on_loop(service.start(p2p))
            self.service = service
            if self.cpus is not None and self.cpus.runtime:  # the runtime thread and handler processes exist now
                thread_id = self.runtime.thread.native_id if self.runtime.thread is not None else None
                assert thread_id is not None, "the runtime thread is running"
                isolate_runtime_thread(self.cpus, thread_id, service.pool.pids if service.pool is not None else [])
            self.maddrs = [str(m) for m in on_loop(p2p.get_visible_maddrs())]
            self.peer_id_b58 = p2p.peer_id.to_base58()
            yield self
        finally:
            if service is not None:
                on_loop(service.stop(keep_runtime=keep_runtime))
            if p2p is not None:
                on_loop(p2p.shutdown())
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()

    def _observe_batch(self, kind: str, num_steps: int, elapsed_s: float) -> None:
        if kind in INFERENCE_KINDS:
            self.batches.append((time.perf_counter(), num_steps))

    @property
    def runtime(self) -> Runtime:
        return self.executor.runtime

    def cpu_probe(self) -> CpuProbe:
        """Samples this server's threads and processes (`bench.cpu_share`)."""
        from benchmarks.users.cpu_share import CpuProbe

        assert self.loop_thread is not None, "cpu_probe() needs a running server"
        pool = self.service.pool if self.service is not None else None
        return CpuProbe(self.runtime.thread, self.loop_thread, pool.pids if pool is not None else [])

    def sessions_opened_per_handler(self) -> list[int]:
        """Sessions each handler process has opened so far (empty with one process)."""
        pool = self.service.pool if self.service is not None else None
        if pool is None:
            return []
        return [channel.num_sessions_opened if channel is not None else 0 for channel in pool.channels]


# ---- the clients (other processes: `clients`)


CLIENT_PRELOAD = (
    "benchmarks.users.server",
    "benchmarks.users.clients",
    "benchmarks.users.petals_stream",
    "corolla.protocol.rpc",
    "corolla.client.session.span_session",
    "hivemind.p2p",
)


def _start_forkserver() -> None:
    """Starts this process's one forkserver (multiprocessing keeps one per process, and a preload set after it
    started is ignored) preloading what both the handler processes and the client processes import, so that neither
    imports it after each fork; in the calling thread's CPUs: the handler processes inherit them, the client processes
    set their own."""
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["corolla.server.front.front_service", *CLIENT_PRELOAD]
    )
    forkserver.ensure_running()


def run_users(
    server: BenchServer, config: UsersConfig, serving_path: str, *, clients_out: list[dict] | None = None
) -> UsersResult:
    """One measurement against a running `server` (its runtime counters give the merged-forward figures).
    `clients_out`: the client processes' result dicts are appended to it, each with its sessions' outputs."""
    from benchmarks.users.cpu_share import with_clients_per_step_us

    # forkserver: one fresh interpreter imports torch and hivemind once (the preload), then forks every client
    # process from it; no client inherits this process's threads, CUDA context or event loop (as with spawn)
    context = multiprocessing.get_context("forkserver")  # started by the server (`_start_forkserver`)
    ready, results = context.Queue(), context.Queue()
    go = context.Event()
    dtype_name = str(server.dtype).removeprefix("torch.")
    split = config.split()
    jobs = [
        ClientJob(
            maddrs=server.maddrs,
            peer_id_b58=server.peer_id_b58,
            prefix=DHT_PREFIX,
            num_layers=server.num_layers,
            config=config,
            num_sessions=k,
            hidden_size=server.hidden_size,
            dtype_name=dtype_name,
            seed=100 + i,
            cpus=server.cpus.clients if server.cpus is not None else None,
            keep_outputs=clients_out is not None,
        )
        for i, k in enumerate(split)
    ]
    processes = [
        context.Process(
            target=client_process,
            args=(job, ready, go, results),
            name=f"bench-users-{i}",
            daemon=True,
        )
        for i, job in enumerate(jobs)
    ]
    opened_before = server.sessions_opened_per_handler()
    for p in processes:
        p.start()
    collected: list[dict] = []
    timeline = timeline_dir()
    try:
        deadline = time.monotonic() + config.start_timeout_s
        opened = 0
        for _ in processes:  # every process has opened and prefilled its sessions (or failed)
            try:
                opened += ready.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                break
        opened_per_handler = [b - a for a, b in zip(opened_before, server.sessions_opened_per_handler(), strict=True)]
        if timeline is not None:  # the prefills' streams are still open: only this row's streams are saved
            for old in timeline.glob("timeline-*.jsonl"):
                old.unlink()
        probe = server.cpu_probe()
        cpu_before = probe.sample()
        before = server.runtime.stats()
        gather, inline_before = server.runtime.gather, server.runtime.num_inline_batches
        start: dict[str, float] = {
            "rule_return_ms_at_go": 1000 * gather.return_s if gather.return_s is not None else math.nan,
            "rule_forward_ms_at_go": 1000 * gather.forward_s if gather.forward_s is not None else math.nan,
        }
        server.batches.clear()
        go_perf = time.perf_counter()
        started = time.time()
        go.set()
        budget_s = config.step_timeout_s * config.decode_steps + 60
        for _ in processes:
            try:
                collected.append(results.get(timeout=budget_s))
            except queue.Empty:
                collected.append({"errors": ["a client process sent no result"], "latencies": [], "finished": 0})
        ended = time.time()
        after = server.runtime.stats()
        start["inline_steps"] = server.runtime.num_inline_batches - inline_before
        first = [steps for done, steps in list(server.batches) if done - go_perf <= 0.1]
        start["forwards_first_100ms"], start["rows_first_100ms"] = len(first), sum(first)
        cpu_server = probe.sample().since(cpu_before)
    finally:
        go.set()
        for p in processes:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    if clients_out is not None:
        clients_out.extend(collected)
    result = _summarize(config, serving_path, collected, before, after, started, ended)
    result.start = start | _warmup_summary(collected)
    if server.cpus is not None:
        result.client_cpus, result.server_cpus = sorted(server.cpus.clients), sorted(server.cpus.server)
        result.runtime_cpus = sorted(server.cpus.runtime)
    result.num_handlers = server.num_handlers
    result.sessions_per_handler = opened_per_handler
    result.handler_poll_ms = server.handler_poll_s * 1000
    steps = result.sessions_finished * config.decode_steps
    result.cpu_us_per_step = with_clients_per_step_us(cpu_server, collected, steps)
    if timeline is not None:
        result.timeline_ms = saved_timeline_summary(timeline, config.sessions)
        result.timeline_by_process = timeline_by_process(timeline)
    return result


def _warmup_summary(collected: list[dict]) -> dict[str, float]:
    """Each untimed first step's median and worst ms over every session of the row."""
    summary: dict[str, float] = {}
    per_session = [w for r in collected for w in r.get("warmup_ms", [])]
    for step in range(max((len(w) for w in per_session), default=0)):
        values = [w[step] for w in per_session if len(w) > step]
        summary[f"step{step}_p50_ms"], summary[f"step{step}_max_ms"] = median(values), max(values)
    return summary


def _summarize(config: UsersConfig, serving_path: str, collected, before, after, started, ended) -> UsersResult:
    from corolla.server.core.runtime import KindStats

    errors = [e for r in collected for e in r["errors"]]
    per_session = [lat for r in collected for lat in r["latencies"] if lat]
    flat = [x for lat in per_session for x in lat] or [float("nan")]
    windows = [w for r in collected for w in r.get("windows", [])]
    finished = sum(r["finished"] for r in collected)
    wall_s = (max(w[1] for w in windows) - min(w[0] for w in windows)) if windows else ended - started
    deltas = {k: s.since(before.get(k, KindStats())) for k, s in after.items()}
    inference = [deltas[k] for k in INFERENCE_KINDS if k in deltas]
    delta = sum(inference, KindStats())  # KindStats add field-wise
    busy_all = sum(d.busy_s for d in deltas.values())
    device_all = sum(d.device_s for d in deltas.values())
    window_s = ended - started
    return UsersResult(
        sessions=config.sessions,
        client_processes=len(config.split()),
        transport=config.transport,
        client=config.client,
        serving_path=serving_path,
        aggregate_tokens_per_s=finished * config.decode_steps / wall_s if wall_s > 0 else float("nan"),
        step_median_ms=median(flat),
        step_p90_ms=percentile(flat, 0.9),
        step_worst_ms=max(flat),
        worst_session_median_ms=max((median(lat) for lat in per_session), default=float("nan")),
        steps_per_merged_forward=delta.tasks_per_batch,
        device_busy_share=busy_all / window_s if window_s > 0 else float("nan"),
        merged_forward_ms=delta.busy_s / delta.batches * 1000 if delta.batches else float("nan"),
        device_time_share=device_all / window_s if window_s > 0 and delta.device_timed else float("nan"),
        device_forward_ms=delta.device_s / delta.device_timed * 1000 if delta.device_timed else float("nan"),
        wall_s=wall_s,
        sessions_finished=finished,
        prefill_median_ms=median([x for r in collected for x in r.get("prefill_ms", [])] or [float("nan")]),
        errors=errors,
        window_ms=window_breakdown(windows, per_session),
        session_rates_tok_s=sum(x for r in collected for x in r.get("session_rates", [])),
    )
