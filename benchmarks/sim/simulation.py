"""One simulated run: servers join (placing their span by the policy), announce, check balance and move (charged
their load time), leave or crash; clients open sessions routed by the policy; the bound is sampled over time.
Every random draw comes from a stream seeded from `SimConfig.seed`, so a run is reproducible."""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from benchmarks.sim.bound import ServerKind, best_known_placement
from benchmarks.sim.catalogue import GPUS, LLAMA2_70B, ModelSpec, ServerPerf
from benchmarks.sim.churn import ChurnConfig
from benchmarks.sim.client_book import ClientBooks, fake_records
from benchmarks.sim.client_model import NEW_SERVER_S, ClientDriver, SimSession
from benchmarks.sim.clock import Event, EventLoop
from benchmarks.sim.delivery_judge import DeliveryJudge
from benchmarks.sim.lorises import make_loris
from benchmarks.sim.metrics import FlowSample, Metrics, Report
from benchmarks.sim.policies import make_policy
from benchmarks.sim.regions import REGIONS, RttModel
from benchmarks.sim.server_model import SimServer
from benchmarks.sim.shadow_rows import ROW_COSTS, ROW_FLOPS_EFFICIENCY, row_s
from benchmarks.sim.shadows import ShadowBook, held_kv, shadow_costs
from benchmarks.sim.view import SwarmView
from benchmarks.sim.workload import Conversation, WorkloadConfig, WorkloadGenerator, read_trace
from corolla.protocol.records import RemoteSpanInfo, ServerState
from corolla.swarm.cache_refusals import may_avoid
from corolla.swarm.early_announce import DEFAULT_EARLY_ANNOUNCE, EARLY_CHECK_PERIOD_S
from corolla.swarm.placement_flow import placement_max_flow
from corolla.swarm.policy import FETCH_CHECKS_PER_PERIOD, PLACEMENT_PINGS, MoveDecision, ServerCapacity
from corolla.swarm.route_planning import find_missing_blocks
from corolla.swarm.routed_load import RoutedLoad
from corolla.utils.errors import MissingBlocksError
from corolla.utils.logging import get_logger

logger = get_logger(__name__)
T = TypeVar("T")

DETERMINISTIC_ROUTING = {
    "petals"
}  # min-latency routing that ignores rng and load: one call per (view, region, max_length, servers banned)
MAX_LENGTH_STEP_TOKENS = 512  # clients ask for KV in multiples of this (an app's max_length), never per token
MAX_NEXT_PINGS = 10  # Petals pings <= 5 servers of its span's inner uids + <= 5 of the next uid
# how clients weigh a span's server (decision 0195): "announced", by the records' figures alone (main before decision
# 0189, the baseline), or "judged", by what it delivers too (0189: `delivery_judge`, what the client runs)
DELIVERY_RULES = ("announced", "judged")
SHADOW_PROBE_S = 30.0  # how often a run with shadows reads what their rows cost the servers' steps (`_shadow_probe`)


@dataclass(frozen=True)
class SimConfig:
    """A scenario. fleet: GPU name -> share of servers; server_regions: region -> share of servers."""

    name: str
    servers: int
    duration_s: float
    workload: WorkloadConfig
    fleet: Mapping[str, float]
    server_regions: Mapping[str, float] = field(default_factory=lambda: {r: 1.0 for r in REGIONS})
    churn: ChurnConfig = ChurnConfig()
    policy: str = "corolla"  # "petals": the baseline (`policies`)
    seed: int = 0
    warmup_s: float = 600.0
    model: ModelSpec = LLAMA2_70B
    dtype: str = "nf4"
    announce_period_s: float = 60.0  # Petals server's update_period
    client_update_period_s: float = 60.0  # ClientConfig.update_period_s: how often clients re-read the records
    balance_check_mean_s: float = 120.0  # Petals' mean_balance_check_period (interval U(0, 2x))
    leave_detect_s: float = 0.5
    crash_detect_s: float = 30.0  # a vanished peer is noticed by a step timeout (assumption)
    snapshot_period_s: float = 300.0
    bound_time_limit_s: float = 0.0
    unmeasured: str = "known"  # what clients know of servers they never pinged (`client_book.UNMEASURED_RULES`)
    fake_servers: int = 0  # made-up records claiming every block at a great speed (`client_book.fake_records`)
    delivery_rule: str = "announced"  # `DELIVERY_RULES`
    loris_fraction: float = 0.0  # the share of servers that are lorises (`lorises`), drawn from their own stream
    # verification by shadow sessions (`shadows`, decision 0268): the share of span sessions mirrored on a replica
    # (0: none, every figure as before; the client's default is 0.75), whether shadows hold their KV there, and what
    # a shadow row costs the replica's step (`shadow_rows.ROW_COSTS`: fitted to decision 0260, or the roofline alone)
    shadow_fraction: float = 0.0
    shadow_kv: bool = True
    shadow_rows: str = "calibrated"

    def __post_init__(self) -> None:
        unknown = set(self.fleet) - set(GPUS)
        if unknown:
            raise ValueError(f"unknown GPUs {sorted(unknown)}; the catalogue has {sorted(GPUS)}")
        if self.delivery_rule not in DELIVERY_RULES:
            raise ValueError(f"delivery_rule must be one of {DELIVERY_RULES}, got {self.delivery_rule!r}")
        if not 0.0 <= self.loris_fraction <= 1.0:
            raise ValueError(f"loris_fraction must be within [0, 1], got {self.loris_fraction}")
        if not 0.0 <= self.shadow_fraction <= 1.0:
            raise ValueError(f"shadow_fraction must be within [0, 1], got {self.shadow_fraction}")
        if self.shadow_rows not in ROW_COSTS:
            raise ValueError(f"shadow_rows must be one of {ROW_COSTS}, got {self.shadow_rows!r}")
        if self.servers < 1 or self.duration_s <= 0:
            raise ValueError(f"need servers >= 1 and duration_s > 0, got {self.servers}, {self.duration_s}")


class Simulation:
    def __init__(self, config: SimConfig):
        self.config = c = config
        self.loop = EventLoop()
        self.rngs = {
            name: random.Random(f"{c.seed}/{name}")
            for name in ("fleet", "churn", "policy", "route", "work", "pings", "books", "lorises", "shadows")
        }
        self.policy = make_policy(c.policy)
        # corolla's servers re-announce early on a large change of free cache and its clients re-read the records and
        # re-route at once after a cache refusal (decision 0020); "petals" runs stock Petals peers: heartbeat only,
        # a refusal banned and backed off from
        self.corolla_peers = self.policy.name == "corolla"
        self.view = SwarmView(c.model.num_blocks, RttModel(c.seed))
        self.view.fakes = fake_records(c.fake_servers, c.model.num_blocks)
        self.books = ClientBooks(c.unmeasured, c.client_update_period_s, self.rngs["books"])
        self.metrics = Metrics(measure_from_s=c.warmup_s)
        self.workload = WorkloadGenerator(c.workload, self.rngs["work"])
        self.delivery = (
            DeliveryJudge(
                num_blocks=c.model.num_blocks,
                hidden_bytes_per_token=c.model.hidden_bytes_per_token,
                client_key=self._client_key,
                client_view=self._client_records,
                max_length=self._max_length,
            )
            if c.delivery_rule == "judged"
            else None
        )
        self.shadows: ShadowBook[SimSession] | None = (
            ShadowBook(
                c.shadow_fraction,
                self.rngs["shadows"],
                self._replica_candidates,
                self.view.servers,
                self.metrics,
                lambda: self.loop.now_s,
                hold_kv=c.shadow_kv,
            )  # fmt: skip
            if c.shadow_fraction > 0
            else None
        )
        self.clients = ClientDriver(
            self.loop,
            self.view,
            self.metrics,
            self._route,
            self.rngs["route"],
            self.workload.think_s,
            self._ended,
            sessions_per_client=c.workload.sessions_per_client,
            view_age_max_s=c.client_update_period_s,
            on_cache_refusal=self._on_cache_refusal if self.corolla_peers else None,
            on_failure=self._on_failure,
            delivery=self.delivery,
            shadows=self.shadows,
        )
        self.perfs = {name: ServerPerf(GPUS[name], c.model, c.dtype) for name in c.fleet}
        mean = c.workload
        self.typical_context = round(mean.mean_turns * (mean.mean_prompt_tokens + mean.mean_output_tokens))
        self.kinds = {name: self._kind(name, perf) for name, perf in self.perfs.items()}
        # a corolla server knows its tokens/s per span length (`ServerCapacity.capacity_tps`) and announces it;
        # a Petals server announces Petals' model
        self.curves = {
            name: self._curve(perf) if self.policy.name == "corolla" else () for name, perf in self.perfs.items()
        }
        # and the KV cache per block it holds at each span length (Petals' unit, as `cache_tokens_left` counts it)
        self.cache_curves = {
            name: tuple(2.0 * perf.kv_tokens(k) for k in range(1, perf.petals_max_blocks() + 1))
            if self.policy.name == "corolla"
            else ()
            for name, perf in self.perfs.items()
        }
        self.servers: list[SimServer] = []
        self.client_regions: list[str] = []  # by closed-loop client, when each keeps several conversations
        self.routed: dict[int, RoutedLoad] = {}  # by closed-loop client: what it routed lately
        self._route_memo: dict[tuple[int, str, int, frozenset[str]], list[tuple[str, int, int]]] = {}
        # a client that re-read the records after a cache refusal routes on its own copy until the next periodic read
        # of every client: client key -> (the periodic view's version then, the records it read)
        self._own_views: dict[tuple[str, int], tuple[int, list[RemoteSpanInfo]]] = {}

    def _kind(self, name: str, perf: ServerPerf) -> ServerKind:
        max_k = max(1, perf.max_blocks(self.typical_context))
        return ServerKind(name, tuple(perf.capacity_tps(k, self.typical_context) for k in range(1, max_k + 1)))

    def _curve(self, perf: ServerPerf) -> tuple[float, ...]:
        """Tokens/s through k blocks at typical sessions, k = 1..max_blocks, as the server measures it."""
        return tuple(perf.capacity_tps(k, self.typical_context) for k in range(1, perf.petals_max_blocks() + 1))

    def _timed(self, what: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Runs a policy (or bound) call, adding its wall time to `Metrics.calls_s[what]`, to tell the simulator's
        own cost from the real policies' and the bound's."""
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.metrics.calls_s[what] = self.metrics.calls_s.get(what, 0.0) + time.perf_counter() - started

    # --- servers ---

    def _capacity(self, server: SimServer) -> ServerCapacity:
        """The server as its policy sees it before placing or moving; a policy that places by RTT pings up to
        `PLACEMENT_PINGS` announced servers it has not measured and gets every RTT its book holds, as the real server
        does (`server.swarm_seat`, `swarm.rtt_book`)."""
        if not self.policy.uses_rtts:
            return server.capacity
        servers, rtt = self.view.servers, self.view.rtt
        peers = set(servers) - {server.peer_id}
        pinged = server.rtt_book.to_ping(peers, PLACEMENT_PINGS, self.rngs["pings"])
        server.rtt_book.record({p: rtt.rtt_s(server.peer_id, server.region, p, servers[p].region) for p in pinged})
        return dataclasses.replace(server.capacity, rtts_s=server.rtt_book.known(peers))

    def _spawn(self, at_s: float, *, initial: bool) -> None:
        c, rng = self.config, self.rngs["fleet"]
        gpu = rng.choices(list(c.fleet), weights=list(c.fleet.values()), k=1)[0]
        region = rng.choices(list(c.server_regions), weights=list(c.server_regions.values()), k=1)[0]
        perf = self.perfs[gpu]
        server = SimServer(
            f"sim{len(self.servers):05d}",
            region,
            perf,
            perf.petals_max_blocks(),
            joined_s=at_s,
            curve=self.curves[gpu],
            cache_curve=self.cache_curves[gpu],
            pooled_kv=not self.corolla_peers,
            shadow_row_s=row_s(perf, ROW_FLOPS_EFFICIENCY if c.shadow_rows == "calibrated" else 0.0),
        )
        if self.rngs["lorises"].random() < c.loris_fraction:
            make_loris(server)
        self.servers.append(server)
        self.loop.at(at_s, self._join, server)
        if c.churn.enabled:
            stay = c.churn.residual_s(self.rngs["churn"]) if initial else c.churn.session_s(self.rngs["churn"])
            crash = self.rngs["churn"].random() < c.churn.crash_fraction
            if at_s + stay < c.duration_s:
                self.loop.at(at_s + stay, self._depart, server, crash)

    def _join(self, server: SimServer) -> None:
        if server.state is None:
            return
        span = self._choose_span(server)
        server.start, server.end = span.start, span.stop
        server.state = ServerState.JOINING
        self.view.announce(server, self.loop.now_s)
        self.metrics.joins += 1
        server.last_load_s = server.load_s(server.num_blocks)
        self.loop.after(server.last_load_s, self._online, server, server.num_moves)

    def _online(self, server: SimServer, moves: int) -> None:
        if server.state is None or server.num_moves != moves:
            return
        server.state = ServerState.ONLINE
        server.online_since_s = self.loop.now_s
        if server.first_online_s is None:
            server.first_online_s = self.loop.now_s
            if self.loop.now_s >= self.config.warmup_s:  # a server that joins the running swarm: its first minutes
                self.metrics.new_server_s += min(NEW_SERVER_S, self.config.duration_s - self.loop.now_s)
        self.view.announce(server, self.loop.now_s)
        self._schedule_balance_check(server)

    def _schedule_balance_check(self, server: SimServer) -> None:
        delay = self.rngs["policy"].uniform(0, 2 * self.config.balance_check_mean_s)
        self.loop.after(delay, self._balance_check, server, server.num_moves)

    def _balance_check(self, server: SimServer, moves: int) -> None:
        if server.state != ServerState.ONLINE or server.num_moves != moves or server.fetching is not None:
            return
        decision = self._decide_move(server)
        if not decision.move:
            self._schedule_balance_check(server)
            return
        if not self.corolla_peers:  # as Petals' server: stop serving (sessions fail over), choose a span, load it
            self._leave_span(server)
            self._switch(server, self._choose_span(server), decision.reason, server.load_s)
            return
        # corolla's server (`Server`'s move): keeps serving its span while it fetches the new span's weights to its
        # disk, its balance checks asking again during the fetch (the fetch stops once the move is no longer wanted)
        # and at its end, then switches, loading from the local copy
        target = self._choose_span(server)
        fetch_s = server.fetch_s(len(target))
        server.fetching = target
        self.view.refresh_one(server, self.loop.now_s)  # its record says where it moves (`moving_to`), as the real one
        self.metrics.fetch_s += fetch_s
        fetched = self.loop.after(fetch_s, self._fetched, server, server.num_moves, decision.reason)
        self._check_during_fetch(server, fetched)

    def _check_during_fetch(self, server: SimServer, fetched: Event) -> None:
        """Schedules `server`'s next balance check while its fetch (ending with the event `fetched`) goes on."""
        delay = self.rngs["policy"].uniform(0, 2 * self.config.balance_check_mean_s / FETCH_CHECKS_PER_PERIOD)
        if self.loop.now_s + delay < fetched.time_s:
            self.loop.after(delay, self._fetching_check, server, fetched)

    def _fetching_check(self, server: SimServer, fetched: Event) -> None:
        """A balance check during a fetch: the move dropped at once if the policy no longer asks for it."""
        if fetched.cancelled or server.fetching is None or server.state != ServerState.ONLINE:
            return
        if self._decide_move(server).move:
            self._check_during_fetch(server, fetched)
            return
        fetched.cancel()
        left_s = fetched.time_s - self.loop.now_s
        self.metrics.fetch_s -= left_s
        self.metrics.moves_dropped += 1
        self.metrics.fetch_dropped_s += server.fetch_s(len(server.fetching)) - left_s
        server.fetching = None
        self.view.refresh_one(server, self.loop.now_s)
        self._schedule_balance_check(server)

    def _fetched(self, server: SimServer, moves: int, reason: str) -> None:
        target, server.fetching = server.fetching, None
        if server.state != ServerState.ONLINE or server.num_moves != moves or target is None:
            return
        if not self._decide_move(server).move:  # the swarm changed while it fetched: it stays, the copy kept on disk
            self.metrics.moves_dropped += 1
            self.metrics.fetch_dropped_s += server.fetch_s(len(target))
            self.view.refresh_one(server, self.loop.now_s)
            self._schedule_balance_check(server)
            return
        self._leave_span(server)
        self._switch(server, target, reason, server.local_load_s)

    def _decide_move(self, server: SimServer) -> MoveDecision:
        return self._timed(
            "move",
            self.policy.choose_move,
            self._capacity(server),
            self.view.placement_spans(),
            self.config.model.num_blocks,
            reload_s=server.last_load_s,
            since_move_s=self.loop.now_s - server.online_since_s,
            # its own stream per check, so that what a policy draws (or skips drawing) does not shift the run's
            rng=random.Random(self.rngs["policy"].getrandbits(64)),
        )

    def _choose_span(self, server: SimServer) -> range:
        return self._timed("span", self.policy.choose_span, self._capacity(server), self.view.placement_spans(),
                           self.config.model.num_blocks)  # fmt: skip

    def _leave_span(self, server: SimServer) -> None:
        """`server` stops serving its span: it announces OFFLINE and its sessions fail over."""
        server.state = ServerState.OFFLINE
        self.view.announce(server, self.loop.now_s)
        self.clients.on_server_lost(server, self.config.leave_detect_s)

    def _switch(self, server: SimServer, span: range, reason: str, load_s: Callable[[int], float]) -> None:
        """`server` (OFFLINE) loads `span` in `load_s(blocks)` (JOINING), then serves it."""
        server.start, server.end = span.start, span.stop
        server.num_moves += 1
        server.state = ServerState.JOINING
        self.view.announce(server, self.loop.now_s)
        server.last_load_s = load_s(server.num_blocks)
        self.metrics.moves += 1
        self.metrics.move_reasons[reason] = self.metrics.move_reasons.get(reason, 0) + 1
        self.metrics.reload_s += server.last_load_s
        self.loop.after(server.last_load_s, self._online, server, server.num_moves)

    def _depart(self, server: SimServer, crash: bool) -> None:
        if server.state is None:
            return
        server.state = None
        self.view.announce(server, self.loop.now_s)
        if crash:
            self.metrics.crashes += 1
        else:
            self.metrics.leaves += 1
        self.clients.on_server_lost(server, self.config.crash_detect_s if crash else self.config.leave_detect_s)

    def _arrival_process(self) -> None:
        rate = self.config.churn.join_rate_per_s(self.config.servers)
        if rate <= 0:
            return
        at = self.loop.now_s + self.rngs["churn"].expovariate(rate)
        if at < self.config.duration_s:
            self._spawn(at, initial=False)
            self.loop.at(at, self._arrival_process)

    def _announce_tick(self) -> None:
        """Every server's heartbeat: pings to the servers that can follow it, then fresh records."""
        online = [s for s in self.view.servers.values() if s.state == ServerState.ONLINE]
        by_block: dict[int, list[SimServer]] = {}
        for s in online:
            for block in range(s.start, s.end):
                by_block.setdefault(block, []).append(s)
        rng, rtt = self.rngs["policy"], self.view.rtt
        for s in self.view.servers.values():
            nexts = [o for o in by_block.get(s.end, []) if o is not s]
            if len(nexts) > MAX_NEXT_PINGS:
                nexts = rng.sample(nexts, MAX_NEXT_PINGS)
            s.next_pings = {o.peer_id: rtt.rtt_s(s.peer_id, s.region, o.peer_id, o.region) for o in nexts}
            s.busy_fraction = self._busy_fraction(s)
        self.view.refresh_all(self.loop.now_s)
        self.loop.after(self.config.announce_period_s, self._announce_tick)

    def _early_announce_tick(self) -> None:
        """Each ONLINE server compares its free cache with the one it announced, as the real announcer does every
        `EARLY_CHECK_PERIOD_S`, and re-announces when `EarlyAnnounce.due` says so."""
        now = self.loop.now_s
        for s in self.view.servers.values():
            if s.state != ServerState.ONLINE or s.info is None:
                continue
            if DEFAULT_EARLY_ANNOUNCE.due(
                announced_left=s.info.cache_tokens_left,
                left_now=s.cache_tokens_left,
                capacity=2 * s.num_blocks * s.kv_capacity_tokens,
                since_last_s=now - s.announced_s,
            ):
                self.view.refresh_one(s, now)
                self.metrics.early_announcements += 1
        self.loop.after(EARLY_CHECK_PERIOD_S, self._early_announce_tick)

    def _busy_fraction(self, server: SimServer) -> float:
        """The share of time it steps, at the batch its sessions' tokens make (`SimServer.batch`)."""
        return server.batch()[2] if server.rows else 0.0

    # --- clients ---

    def _max_length(self, session: SimSession) -> int:
        step = MAX_LENGTH_STEP_TOKENS
        return min(math.ceil(session.conversation.total_tokens / step) * step, self.config.workload.max_context_tokens)

    def _client_refresh(self) -> None:
        self.view.refresh_client_view()
        self.loop.after(self.config.client_update_period_s, self._client_refresh)

    def _client_key(self, session: SimSession) -> tuple[str, int]:
        if session.slot is None:
            return ("session", session.sid)
        return ("client", session.slot // self.config.workload.sessions_per_client)

    def _on_cache_refusal(self, session: SimSession, peer_id: str) -> bool:
        """As the real client's `RemoteSequenceManager.on_cache_refusal`: whether it avoids `peer_id` for `AVOID_S`
        (`may_avoid` over its view less the servers it skips now), then it re-reads the records."""
        spans, _ = self._client_view(session)
        now = self.loop.now_s
        skipped = {peer for peer, until in session.banned.items() if until > now}
        view = [span for span in spans if span.peer_id not in skipped]
        rtts = self.view.client_rtts_s[session.conversation.region]
        avoid = may_avoid(view, peer_id, self.config.model.num_blocks, rtts, self.policy.route_region_rtt_s)
        self._reread(session)
        return avoid

    def _on_failure(self, session: SimSession, peer_id: str) -> None:
        """A server failed `session`'s call (gone, or made up): its client's book applies the unmeasured rule."""
        spans, _ = self._client_view(session)
        self.books.on_failure(self._client_key(session), peer_id, spans, self.loop.now_s)

    def _reread(self, session: SimSession) -> None:
        """`session`'s client re-reads the records now (after a cache refusal): the servers' latest announcements."""
        self._own_views[self._client_key(session)] = (self.view.client_version, self.view.client_records())
        self.metrics.rereads += 1

    def _client_view(self, session: SimSession) -> tuple[list[RemoteSpanInfo], int]:
        own = self._own_views.get(self._client_key(session))
        if own is not None:
            if own[0] == self.view.client_version:
                return own[1], -1  # not memoized (only Petals' deterministic routing is, and it never re-reads)
            del self._own_views[self._client_key(session)]
        return self.view.client_spans(), self.view.client_version

    def _client_records(self, session: SimSession) -> tuple[list[RemoteSpanInfo], dict[str, float]]:
        """What `session`'s client reads of the records now and its RTTs to the servers (`DeliveryJudge`)."""
        return self._client_view(session)[0], self.view.client_rtts_s[session.conversation.region]

    def _route(self, session: SimSession) -> list[tuple[str, int, int]]:
        """The policy's chain on the client's view without the servers this session saw fail; if that view misses a
        block, the client re-reads the records at once (as the real client does) and tries again."""
        try:
            return self._route_on(session, *self._client_view(session))
        except MissingBlocksError:
            self.view.refresh_client_view()
            return self._route_on(session, *self._client_view(session))

    def _route_on(self, session: SimSession, spans: list[RemoteSpanInfo], version: int) -> list[tuple[str, int, int]]:
        region, need = session.conversation.region, self._max_length(session)
        now = self.loop.now_s
        banned = frozenset(peer for peer, until in session.banned.items() if until > now)
        key = (version, region, need, banned)
        memo = (
            self.policy.name in DETERMINISTIC_ROUTING
            and version >= 0
            and self.config.unmeasured == "known"
            and self.delivery is None  # (routes read what the client observed)
        )
        client = self._client(session)
        if memo and key in self._route_memo:
            chain = self._route_memo[key]
            if client is not None:
                client.note((peer for peer, _, _ in chain), self.loop.now_s)
            return chain
        if banned:  # as Petals' client: bans are ignored where they would leave a block without a server
            allowed = [s for s in spans if s.peer_id not in banned]
            spans = allowed if not find_missing_blocks(allowed, 0, self.config.model.num_blocks) else spans
        if self.delivery is not None:  # a server seen slower than it announces costs what it delivered
            spans = self.delivery.priced(session, spans, now)
        self.metrics.route_calls += 1
        route = self._timed(
            "route",
            self.policy.choose_route,
            spans,
            0,
            self.config.model.num_blocks,
            mode="min_latency",
            client_rtts_s=self.books.rtts(self._client_key(session), spans, self.view.client_rtts_s[region], now),
            cache_tokens_needed=need,
            client_load=None if client is None else client.load(self.loop.now_s),
            waited_s=0.0 if session.wait_start_s is None else now - session.wait_start_s,
            rng=self.rngs["route"],
        )
        chain = [(span.peer_id, span.start, span.end) for span in route]
        if client is not None:
            client.note((peer for peer, _, _ in chain), self.loop.now_s)
        if memo:
            if len(self._route_memo) > 10_000:
                self._route_memo.clear()
            self._route_memo[key] = chain
        return chain

    def _replica_candidates(self, session: SimSession, start: int, end: int, server: str) -> list[str]:
        """The servers of `session`'s client's view that may run the shadow of its hop over [start, end) on `server`
        (`StretchReferees.replicas`: holding the blocks whole, not the hop's server, not banned by its client), once
        each, in the view's order."""
        spans, _ = self._client_view(session)
        now = self.loop.now_s
        peers = {
            span.peer_id: None
            for span in spans
            if span.peer_id != server and span.start <= start and end <= span.end
            and session.banned.get(span.peer_id, now) <= now
        }  # fmt: skip
        return list(peers)

    def _client(self, session: SimSession) -> RoutedLoad | None:
        """The closed-loop client that opened `session` (None for open arrivals: each is its own client)."""
        if session.slot is None:
            return None
        client = session.slot // self.config.workload.sessions_per_client
        return self.routed.setdefault(client, RoutedLoad())

    def _ended(self, session: SimSession) -> None:
        if session.slot is None:
            self.books.forget(self._client_key(session))
            if self.delivery is not None:
                self.delivery.forget(session)
        else:
            at = self.loop.now_s + self.workload.idle_s()
            if at < self.config.duration_s:
                self.loop.at(at, self._start_conversation, session.slot)

    def _start_conversation(self, slot: int | None, conversation: Conversation | None = None) -> None:
        if conversation is None:
            per_client = self.config.workload.sessions_per_client
            region = self.client_regions[slot // per_client] if slot is not None and per_client > 1 else None
            conversation = self.workload.conversation(self.loop.now_s, region)
        self.clients.start(conversation, slot)

    # --- the bound over time ---

    def _snapshot(self) -> None:
        self._timed("bound", self._sample_flow)
        self.loop.after(self.config.snapshot_period_s, self._snapshot)

    def _sample_flow(self) -> None:
        online = [s for s in self.view.servers.values() if s.state == ServerState.ONLINE]
        caps = [s.perf.capacity_tps(s.num_blocks, self.typical_context) for s in online]
        flow = placement_max_flow(
            [(s.start, s.end) for s in online], caps, self.config.model.num_blocks, exact_boundaries=False
        )
        names = sorted({s.perf.gpu.name for s in online})
        counts = [sum(1 for s in online if s.perf.gpu.name == n) for n in names]
        best = best_known_placement(
            [self.kinds[n] for n in names],
            counts,
            self.config.model.num_blocks,
            time_limit_s=self.config.bound_time_limit_s,
        )
        sessions = self.clients.sessions.values()
        decoding = sum(1 for x in sessions if x.phase == "decode")
        waiting = sum(1 for x in sessions if x.route is None and x.wait_start_s is not None)
        capacity = sum(s.kv_capacity_tokens * s.num_blocks for s in online)
        reserved = sum(s.kv_reserved_token_blocks for s in online) / max(capacity, 1)
        best_tps = max(best.flow_tps, flow)
        fetching = sum(1 for s in online if s.fetching is not None)
        shadow_kv = sum(held_kv(s) for s in online) / max(capacity, 1)
        self.metrics.flow.append(
            FlowSample(self.loop.now_s, flow, best_tps, len(online), decoding, waiting, reserved, fetching, shadow_kv)
        )
        logger.info(f"sim.state(time_s={self.loop.now_s:.0f}, decoding={decoding}, waiting={waiting}, "
                    f"kv_reserved={reserved:.2f}, flow_tps={flow:.0f})")  # fmt: skip

    def _shadow_probe(self) -> None:
        """The shadows' rows' cost to the swarm now: each ONLINE server's step and token time with its shadows'
        requests over without (`shadow_costs`), weighted by the real tokens/s through it; every `SHADOW_PROBE_S` (it
        reads the servers, changes nothing)."""
        online = [s for s in self.view.servers.values() if s.state == ServerState.ONLINE and s.visit_rate > 0]
        weight = sum(s.visit_rate for s in online)
        if weight > 0:
            costs = [(s.visit_rate, *shadow_costs(s)) for s in online]
            self.metrics.shadow_step_costs.append(sum(w * step for w, step, _ in costs) / weight)
            self.metrics.shadow_hop_costs.append(sum(w * hop for w, _, hop in costs) / weight)
        self.loop.after(SHADOW_PROBE_S, self._shadow_probe)

    # --- the run ---

    def run(self, on_progress: Callable[[float, float], None] | None = None, progress_every_s: float = 300.0) -> Report:
        """Simulates `duration_s`; `on_progress(simulated_s, cpu_s)` is called every `progress_every_s` simulated."""
        c = self.config
        started, cpu_started = time.perf_counter(), time.process_time()
        if on_progress is not None:

            def progress() -> None:
                on_progress(self.loop.now_s, time.process_time() - cpu_started)
                self.loop.after(progress_every_s, progress)

            self.loop.at(progress_every_s, progress)
        join_window = c.warmup_s / 4  # servers join, then load (minutes), before clients start
        for i in range(c.servers):
            self._spawn(join_window * i / c.servers, initial=True)
        self.loop.at(0.0, self._arrival_process)
        self.loop.at(c.announce_period_s, self._announce_tick)
        if self.corolla_peers:
            self.loop.at(c.announce_period_s, self._early_announce_tick)
        self.loop.at(0.0, self._client_refresh)
        self.loop.at(c.warmup_s, self._snapshot)
        if self.shadows is not None:
            self.loop.at(c.warmup_s, self._shadow_probe)
        w = c.workload
        if w.concurrent_clients is not None:
            slots = w.concurrent_clients * w.sessions_per_client
            if w.sessions_per_client > 1:
                self.client_regions = [self.workload.region() for _ in range(w.concurrent_clients)]
            for slot in range(slots):
                self.loop.at(c.warmup_s * (0.5 + 0.5 * slot / slots), self._start_conversation, slot)
        else:
            arrivals = (
                read_trace(w.trace_path, max_context_tokens=w.max_context_tokens)
                if w.trace_path is not None
                else self.workload.open_arrivals(c.duration_s)
            )
            for conversation in arrivals:
                self.loop.at(conversation.arrival_s, self._start_conversation, None, conversation)
        self.loop.run(c.duration_s)
        self.clients.finish()
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        logger.info(f"sim.done(scenario={c.name}, policy={c.policy}, events={self.loop.events_run}, wall_s={wall:.1f})")
        return Report.build(
            self.metrics,
            scenario=c.name,
            policy=c.policy,
            seed=c.seed,
            servers_start=c.servers,
            duration_s=c.duration_s,
            wall_s=wall,
            cpu_s=cpu,
            events=self.loop.events_run,
            delivery_rule=c.delivery_rule,
            lorises=sum(1 for s in self.servers if s.hold_step_s),
            shadows=None
            if self.shadows is None
            else {"fraction": c.shadow_fraction, "kv": c.shadow_kv, "rows": c.shadow_rows},
        )
