"""The live check of the swarm policies: loopback swarms of corolla servers of different speeds (the test-only
`COROLLA_TEST_BLOCK_DELAY_S` knob: device seconds per block per token) and memory, in regions behind `benchmarks.wan_emulator`
proxies (every connection to a server crosses its proxy's one-way delay), driven by many concurrent clients.

The same servers are placed twice, by Petals' policy and by corolla's (each span is what that policy's `choose_span`
returns when the servers join one after another: the function the server calls when it joins), and both swarms run
side by side. Measurement windows rotate through the phases (Petals' placement with Petals' routing, Petals'
placement with corolla's routing, corolla's placement with corolla's routing) for several rounds, so the shared
machine's varying load falls on every phase alike. Each window: every client opens sessions (a short prefill, then
decode steps; a new session, so a new route, after `session_tokens`) until the window ends; decode tokens finished
inside the measured part of the window count."""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.children import child_env
from benchmarks.sim.policies import make_policy
from benchmarks.wan.chain import free_port
from benchmarks.wan_emulator import LinkConfig, ProxyThread
from corolla.client.config import ClientConfig
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session.inference_session import InferenceSession
from corolla.protocol.records import RemoteSpanInfo, ServerInfo, ServerState
from corolla.protocol.uids import make_uid
from corolla.server.slowdown import BLOCK_DELAY_ENV, slowed_throughput
from corolla.swarm.local import LocalSwarm, LocalSwarmConfig
from corolla.swarm.policy import ServerCapacity
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DHT_PREFIX = "tinyswarm"
HIDDEN_SIZE = 64


@dataclass(frozen=True)
class LiveServer:
    """One server: its region, the one-way delay (ms) on every connection to it, its device time per block per token
    (s), and how many blocks its memory holds."""

    region: str
    delay_ms: float
    block_delay_s: float
    max_blocks: int


def default_servers() -> tuple[LiveServer, ...]:
    """10 servers in 3 regions (1, 10 and 25 ms one-way), 3 speeds (5, 10, 20 ms per block per token: the slowdown
    must dwarf the shared CPU's own costs), 3 memory sizes."""
    return (
        LiveServer("near", 1.0, 0.005, 6), LiveServer("near", 1.0, 0.020, 6), LiveServer("near", 1.0, 0.010, 4),
        LiveServer("mid", 10.0, 0.005, 4), LiveServer("mid", 10.0, 0.010, 6), LiveServer("mid", 10.0, 0.020, 4),
        LiveServer("far", 25.0, 0.005, 6), LiveServer("far", 25.0, 0.010, 4), LiveServer("far", 25.0, 0.020, 3),
        LiveServer("far", 25.0, 0.010, 3),
    )  # fmt: skip


PHASES = (("petals", "petals"), ("petals", "corolla"), ("corolla", "corolla"))  # (placement, routing)


@dataclass(frozen=True)
class LiveConfig:
    """The run: model depth, servers, concurrent clients, rounds of windows (each: warm-up then measurement, s),
    each session's prefill and decode tokens, the servers' and clients' refresh period (s)."""

    num_layers: int = 12
    servers: tuple[LiveServer, ...] = field(default_factory=default_servers)
    num_clients: int = 32
    rounds: int = 3
    warmup_s: float = 5.0
    measure_s: float = 15.0
    prefill_tokens: int = 4
    session_tokens: int = 4
    update_period_s: float = 8.0  # shorter floods the DHT of a loaded 2-core machine: reads then miss records
    startup_timeout_s: float = 300.0
    phases: tuple[tuple[str, str], ...] = PHASES


@dataclass
class PhaseResult:
    """What one (placement, routing) phase measured over all its windows."""

    placement: str
    routing: str
    spans: list[tuple[int, int]]
    tokens: int = 0
    seconds: float = 0.0
    sessions: int = 0
    errors: int = 0
    step_s: list[float] = field(default_factory=list)
    window_tok_s: list[float] = field(default_factory=list)
    sessions_by_server: Counter = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        steps_ms = sorted(s * 1000 for s in self.step_s) or [float("nan")]
        return {
            "placement": self.placement, "routing": self.routing, "spans": self.spans, "tokens": self.tokens,
            "seconds": self.seconds, "tok_s": round(self.tokens / self.seconds, 2) if self.seconds else 0.0,
            "window_tok_s": [round(x, 2) for x in self.window_tok_s],
            "step_ms_p50": round(statistics.median(steps_ms), 1),
            "step_ms_p90": round(steps_ms[int(0.9 * (len(steps_ms) - 1))], 1), "sessions": self.sessions,
            "errors": self.errors, "sessions_by_server": dict(sorted(self.sessions_by_server.items())),
        }  # fmt: skip


def make_tiny_model(out: Path, num_layers: int) -> Path:
    """A random tiny Llama checkpoint (hidden 64) in `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=300, hidden_size=HIDDEN_SIZE, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def plan_spans(placement: str, servers: Sequence[LiveServer], num_layers: int) -> list[range]:
    """Each server's span when they join in order under `placement`: the policy's `choose_span` over the spans (and
    the throughputs they announce) of the servers before it, as a joining server does (`corolla-server` by corolla's
    policy; Petals' servers by Petals', the baseline)."""
    policy = make_policy(placement)
    joined: list[RemoteSpanInfo] = []
    for i, spec in enumerate(servers):
        max_blocks = min(spec.max_blocks, num_layers)
        me = ServerCapacity(
            f"server{i:02d}", max_blocks, slowed_throughput(spec.block_delay_s, max_blocks)["throughput"]
        )
        span = policy.choose_span(me, joined, num_layers)
        info = ServerInfo(state=ServerState.ONLINE, throughput=me.throughput_for(len(span)),
                          inference_rps=1.0 / spec.block_delay_s, start_block=span.start, end_block=span.stop)  # fmt: skip
        joined.append(RemoteSpanInfo(me.peer_id, span.start, span.stop, info))
    return [range(s.start, s.end) for s in joined]


class LiveSwarm:
    """A bootstrap node and one server per spec on `spans`, each behind its own WAN proxy; all start at once. (The
    spans are planned by the policies beforehand, so servers get them as --block_indices and do not rebalance.)"""

    def __init__(self, wan: ProxyThread, workdir: Path, model: Path, config: LiveConfig, spans: Sequence[range]):
        workdir.mkdir(parents=True, exist_ok=True)
        self.spans = list(spans)
        server_args = (
            "--device", "cpu", "--torch_dtype", "float32", "--no_local_socket", "--dht_prefix", DHT_PREFIX,
            "--update_period", str(config.update_period_s), "--balance_quality", "0", "--throughput", "1.0",
            "--cache_dir", str(workdir / "cache"),
        )  # fmt: skip
        self.swarm = LocalSwarm(
            LocalSwarmConfig(server_args=server_args, env=child_env(), startup_timeout_s=config.startup_timeout_s,
                             log_dir=workdir, stop_grace_s=5.0)
        )  # fmt: skip
        try:
            self.swarm.start_bootstrap()
            for i, (spec, span) in enumerate(zip(config.servers, self.spans, strict=True)):
                port = free_port()
                proxy = wan.add(port, LinkConfig(delay_ms=spec.delay_ms))
                self.swarm.start_server(
                    model, "--host_maddrs", f"/ip4/127.0.0.1/tcp/{port}",
                    "--announce_maddrs", f"/ip4/127.0.0.1/tcp/{proxy.port}",
                    block_indices=(span.start, span.stop), name=f"{workdir.name}-{i:02d}-{spec.region}",
                    env={BLOCK_DELAY_ENV: str(spec.block_delay_s)}, wait=False,
                )  # fmt: skip
            self.swarm.wait_servers_ready()
        except BaseException:
            self.close()
            raise
        self.names = {s.peer_id: s.name for s in self.swarm.servers}

    def close(self) -> None:
        self.swarm.close()  # its proxies close with the `ProxyThread`

    def __enter__(self) -> LiveSwarm:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_manager(swarm: LiveSwarm, config: LiveConfig, routing: str) -> RemoteSequenceManager:
    client_config = ClientConfig(
        initial_peers=tuple(swarm.swarm.initial_peers), update_period_s=config.update_period_s, show_route="never",
        local_transport=False, max_retries=3, request_timeout_s=60.0,
    )  # fmt: skip
    uids = [make_uid(DHT_PREFIX, i) for i in range(config.num_layers)]
    manager = RemoteSequenceManager(client_config, uids, policy=make_policy(routing))  # Petals' is the baseline
    manager.wait_ready(120.0)
    # a DHT read on a loaded machine may miss records: measure only once the client sees every server online
    deadline = time.monotonic() + 120.0
    while len(manager.spans) < len(config.servers):
        logger.info(f"swarm_live.waiting_for_view(servers_seen={len(manager.spans)}, of={len(config.servers)})")
        if time.monotonic() > deadline:
            manager.shutdown()
            raise RuntimeError(f"the client sees {len(manager.spans)} of {len(config.servers)} servers after 120 s")
        time.sleep(1.0)
        manager.update()
    return manager


def run_window(manager: RemoteSequenceManager, config: LiveConfig, result: PhaseResult, names: dict[str, str]) -> None:
    """`num_clients` concurrent clients (threads sharing the manager, like one gateway) for warm-up + measurement."""
    lock = threading.Lock()
    start = time.monotonic()
    measure_from, stop_at = start + config.warmup_s, start + config.warmup_s + config.measure_s
    tokens = 0

    def client(index: int) -> None:
        nonlocal tokens
        generator = torch.Generator().manual_seed(index)
        while time.monotonic() < stop_at:
            try:
                with InferenceSession(manager, config.prefill_tokens + config.session_tokens) as session:
                    session.step(torch.randn(1, config.prefill_tokens, HIDDEN_SIZE, generator=generator))
                    with lock:
                        result.sessions += 1
                        result.sessions_by_server.update(names.get(span.peer_id, "?") for span, _ in session.route)
                    for _ in range(config.session_tokens):
                        if time.monotonic() >= stop_at:
                            break
                        began = time.monotonic()
                        session.step(torch.randn(1, 1, HIDDEN_SIZE, generator=generator))
                        done = time.monotonic()
                        if measure_from <= done <= stop_at:
                            with lock:
                                tokens += 1
                                result.step_s.append(done - began)
            except Exception as e:
                with lock:
                    result.errors += 1
                logger.warning(f"swarm_live.client_error(client={index}): {e!r}")
                time.sleep(0.5)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(config.num_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(config.warmup_s + config.measure_s + 180.0)
    result.tokens += tokens
    result.seconds += config.measure_s
    result.window_tok_s.append(tokens / config.measure_s)
    logger.info(f"swarm_live.window(placement={result.placement}, routing={result.routing}, "
                f"tok_s={tokens / config.measure_s:.2f})")  # fmt: skip


def run_live(config: LiveConfig, workdir: Path) -> dict[str, Any]:
    """One swarm per distinct placement (where the policies place these servers alike, one swarm serves both, and
    phases that then coincide are measured once), all side by side; then `rounds` rounds of one window per phase.
    The summary compares each phase with Petals' placement and routing."""
    model = make_tiny_model(workdir / "model", config.num_layers)
    plans = {p: plan_spans(p, config.servers, config.num_layers) for p, _ in config.phases}
    layouts = list(dict.fromkeys(tuple((r.start, r.stop) for r in plan) for plan in plans.values()))
    layout_of = {p: layouts.index(tuple((r.start, r.stop) for r in plan)) for p, plan in plans.items()}
    # (layout, routing) -> the phases it measures
    runs: dict[tuple[int, str], list[tuple[str, str]]] = {}
    for placement, routing in config.phases:
        runs.setdefault((layout_of[placement], routing), []).append((placement, routing))
    results = {run: PhaseResult(phases[0][0], phases[0][1], list(layouts[run[0]])) for run, phases in runs.items()}
    with ProxyThread() as wan:
        swarms: list[LiveSwarm] = []
        managers: dict[tuple[int, str], RemoteSequenceManager] = {}
        try:
            for i, layout in enumerate(layouts):
                spans = [range(a, b) for a, b in layout]
                swarms.append(LiveSwarm(wan, workdir / f"layout{i}", model, config, spans))
            for run in runs:
                managers[run] = open_manager(swarms[run[0]], config, run[1])
            for _ in range(config.rounds):
                for run in runs:
                    run_window(managers[run], config, results[run], swarms[run[0]].names)
        finally:
            for manager in managers.values():
                manager.shutdown()
            for swarm in swarms:
                swarm.close()
    phases: dict[str, dict[str, Any]] = {}
    for run, measured in runs.items():
        names = [f"{p}/{r}" for p, r in measured]  # phases whose placement and routing coincide: one measurement
        for (placement, routing), name in zip(measured, names, strict=True):
            phases[name] = {**results[run].summary(), "placement": placement, "routing": routing, "same_as": names}
    base = phases.get("petals/petals", {}).get("tok_s") or 0.0
    for summary in phases.values():
        summary["vs_petals"] = round(summary["tok_s"] / base, 3) if base else None
    return {"config": asdict(config), "phases": phases}
