"""`RemoteSequenceManager`: keeps a fresh view of which servers hold which blocks (background refresh from the DHT,
bans, allow/block lists, pings) and turns it into chains of server spans for inference or forward/backward."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from corolla.client import background_loop
from corolla.client.config import ClientConfig
from corolla.client.prefix.prefix_routes import PrefixRoutes
from corolla.client.routing.bans import BanList
from corolla.client.routing.dispute_repeats import DisputeRepeats
from corolla.client.routing.disputes import Disputes
from corolla.client.routing.finding_store import FindingStore
from corolla.client.routing.observed_steps import ObservedSteps
from corolla.client.routing.push_suspects import PushSuspects
from corolla.client.transport.direct_transport import DirectOffers, connection_ips, dialable
from corolla.client.transport.p2p_stream import InferenceStream, P2PInferenceStream
from corolla.protocol.auth import MEMBER_PROOF_KEY, join_info_uid
from corolla.protocol.direct_stream import DirectOffer
from corolla.protocol.metadata import decode_metadata
from corolla.protocol.records import RemoteModuleInfo, RemoteSpanInfo, ServerState
from corolla.protocol.rpc import TransformerConnectionHandler, handle_name
from corolla.protocol.uids import CHAIN_DELIMITER
from corolla.swarm.cache_refusals import AVOID_S, may_avoid
from corolla.swarm.corolla_policy import CorollaPolicy
from corolla.swarm.dht import PUBLIC_INITIAL_PEERS, SwarmConfig, create_dht, get_peer_id, shutdown_dht
from corolla.swarm.membership import RpcMembership, SwarmKeyAuthorizer, load_swarm_key
from corolla.swarm.ping import PingAggregator, ping
from corolla.swarm.policy import PLACEMENT_PINGS, RouteMode, SwarmPolicy
from corolla.swarm.records_io import get_remote_module_infos, get_verified_model_infos
from corolla.swarm.route_planning import covers, proven_where_they_cover
from corolla.swarm.routed_load import RoutedLoad
from corolla.swarm.spans import compute_spans
from corolla.utils.interrupts import event_wait
from corolla.utils.logging import get_logger
from corolla.utils.peer_tables import remember, worth_itself

logger = get_logger(__name__)

PING_EMA_ALPHA = 0.2  # weight of the newest RTT sample
MIN_REREAD_S = 1.0  # a cache refusal re-reads the records at once unless they were read this recently


class RemoteSequenceManager:
    """Routing state for a sequence of block uids (usually all blocks of one model).

    A daemon thread refreshes block records every `update_period_s` (or at once when a failure leaves a block
    uncovered); `make_sequence` plans a chain from the latest view by corolla's routing (`swarm.corolla_policy`).
    Servers in state JOINING are never used. `policy` is a benchmark and test seam, not a user option
    (`benchmarks.swarm_live` passes Petals' policy to measure its baseline on the same swarm).
    """

    def __init__(
        self,
        config: ClientConfig,
        block_uids: Sequence[str],
        *,
        dht: Any | None = None,
        start_updates: bool = True,
        p2p: Any | None = None,
        policy: SwarmPolicy = CorollaPolicy(),
    ):
        if not block_uids:
            raise ValueError("block_uids must name at least one block")
        self.config = config
        self.block_uids = list(block_uids)
        key = load_swarm_key(config.swarm_key_file)
        # a private swarm: every request carries a membership proof, every ping the authorizer's signature
        self.membership = None if key is None else RpcMembership(key)
        self.authorizer = None if key is None else SwarmKeyAuthorizer(key)
        self._own_dht = dht is None and start_updates
        if self._own_dht:
            initial_peers = list(config.initial_peers) or list(PUBLIC_INITIAL_PEERS)
            timeout_s = config.daemon_startup_timeout_s
            dht = create_dht(SwarmConfig(initial_peers, client_mode=True, startup_timeout_s=timeout_s, swarm_key=key))
        self.dht = dht
        self.bans = BanList(config.ban_timeout_s, config.ban_backoff_rate)
        # servers caught lying first-hand (`client.routing.finding_store`): banned again by a client given their dir
        self.findings = FindingStore(
            config.findings_dir, max_count=config.findings_max_count, max_bytes=config.findings_max_bytes
        )
        for peer_id in self.findings.liars():
            self.bans.ban_liar(peer_id)
        # outvotes by witnesses short of standing: the accused avoided, the witnesses watched (decision 0190)
        self.disputes = Disputes()
        # disputes each server lost and accusations it made: a repeat is avoided longer (decision 0225)
        self.repeats = DisputeRepeats()
        self.prefix_routes = PrefixRoutes()  # which chain held which conversation's prefix (cache-affine routing)
        self.push_suspects = PushSuspects()  # pushes whose answers failed the checks: not named for a while (0169)
        self.rng = random.Random()
        self.policy = policy
        self.routed = RoutedLoad()  # sessions this client routed lately, by peer (time.monotonic())
        # decode step times this client measured on servers: routes price a server by what it delivered (0189)
        self.observed_steps = ObservedSteps()
        self._lock = threading.Lock()
        self._spans: list[RemoteSpanInfo] = []
        # smoothed RTTs, never forgotten but past `peer_tables.PEERS_KEPT_MAX` servers (decision 0211): the servers seen
        # on time last, then those that answered (a measured server is what routes trust over announced ones, 0137)
        self._rtts = PingAggregator(ema_alpha=PING_EMA_ALPHA, expiration_s=math.inf, worth=self._rtt_worth)
        # until then (time.monotonic()), servers this client never measured count as unreachable when routing: one of
        # them failed (decision 0137)
        self._unmeasured_suspect_until = 0.0
        # until then, a server this client never saw answer a step on time is left out of routes where servers it saw
        # do cover its blocks: a loris was caught (decision 0163)
        self._unproven_suspect_until = 0.0
        self._ready = threading.Event()
        self._update_requested = threading.Event()
        self._attempted = threading.Event()  # set after the first update attempt, failed or not
        self._closed = threading.Event()
        # run by `shutdown`: work of this client's sessions that outlives them ends there (decision 0253)
        self.on_shutdown: list[Callable[[], None]] = []
        self._last_update_error: BaseException | None = None
        self._update_lock = threading.Lock()
        self._avoid_until: dict[str, float] = {}  # servers that refused for cache -> time.monotonic() to skip them to
        # the spans of servers avoided now (as last read): never routed, but asked to recheck a dispute (decision 0228)
        self._set_aside: dict[str, RemoteSpanInfo] = {}
        # servers seen answering a step within its deadline, not avoided for their pace or failed since: raced first
        # (decisions 0163, 0231); an ordered set, the latest seen last (`peer_tables`: the least recently seen go first
        # past its bound)
        self._on_time: dict[str, None] = {}
        # servers some session of this client steps through or knocks on (`stepping_through`, `link_down`) -> how many
        # sessions: the refresh does not ping them
        self._in_use: dict[str, int] = {}
        self._read_started_at = -math.inf  # time.monotonic() at the start of the last read of the records
        self._drain_reads: dict[str, float] = {}  # draining server -> when its drain first asked for a read
        self._p2p: Any = p2p  # None: the DHT's replica, made on first use
        self._stubs: dict[str, Any] = {}
        self._input_compressions: dict[str, int] = {}  # peer -> compression its rpc_info asks for
        self.direct_offers = DirectOffers(self._ask_direct_ticket)  # servers' direct ports
        self._thread: threading.Thread | None = None
        if start_updates:
            self._thread = threading.Thread(target=self._update_loop, name="corolla-routing-update", daemon=True)
            self._thread.start()

    # ---------------------------------------------------------------- view of the swarm

    @property
    def num_blocks(self) -> int:
        return len(self.block_uids)

    @property
    def spans(self) -> list[RemoteSpanInfo]:
        with self._lock:
            return list(self._spans)

    @property
    def client_rtts_s(self) -> dict[str, float]:
        with self._lock:
            return self._rtts.to_dict()

    def fetch_module_infos(self) -> list[RemoteModuleInfo]:
        """Reads the block records (subclasses and tests may override the source)."""
        return get_remote_module_infos(
            self.dht,
            self.block_uids,
            active_adapter=self.config.active_adapter or None,
            latest=True,
            timeout_s=self.config.dht_timeout_s,
        )

    async def ping_s(self, peer_id: str) -> float:
        """Round-trip time in seconds to one server (inf = unreachable); runs on the client loop."""
        try:
            p2p = await self._get_p2p()
            return float(
                await ping(PeerID.from_base58(peer_id), p2p, self.config.ping_timeout_s, None, self.authorizer)
            )
        except Exception as e:  # a failed ping means "unreachable", never a crash of the caller
            logger.debug("routing.ping_failed(peer=...%s, error=%r)", peer_id[-6:], e)
            return math.inf

    def measure_rtts_s(self, peer_ids: Sequence[str]) -> dict[str, float]:
        """Round-trip times in seconds (inf = unreachable) to `peer_ids`, measured concurrently."""
        if self.dht is None or not peer_ids:
            return {}

        async def _ping_all() -> dict[str, float]:
            rtts = await asyncio.gather(*(self.ping_s(peer) for peer in peer_ids))
            return dict(zip(peer_ids, rtts, strict=True))

        return background_loop.run(_ping_all(), timeout_s=self.config.ping_timeout_s + 10)

    def update(self) -> None:
        """Refreshes the view now (blocking): records -> filters -> spans -> pings."""
        with self._update_lock:
            self._read()

    def _read(self) -> None:
        self._read_started_at = time.monotonic()
        infos = self.fetch_module_infos()
        set_aside = self._spans_avoided(infos)
        infos = self._filter_servers(infos)
        spans_by_peer = compute_spans(infos, min_state=ServerState.ONLINE)
        spans = sorted(spans_by_peer.values(), key=lambda span: span.length, reverse=True)
        to_ping = self._choose_peers_to_ping(infos)
        rtts = self.measure_rtts_s(to_ping) if to_ping else {}
        with self._lock:
            self._spans = spans
            self._set_aside = set_aside
            for peer_id, rtt in rtts.items():
                self._rtts.update(peer_id, rtt)
        self._ready.set()
        logger.debug("routing.updated(servers=%d, pinged=%d)", len(spans), len(rtts))

    def _filter_servers(
        self, infos: list[RemoteModuleInfo], excluded: set[str] | None = None
    ) -> list[RemoteModuleInfo]:
        """`infos` with the servers the config allows, less `excluded` (default: `excluded_peers`)."""
        allowed = set(self.config.allowed_servers) if self.config.allowed_servers is not None else None
        blocked = set(self.config.blocked_servers or ())
        banned = self.excluded_peers() if excluded is None else excluded
        adapter = self.config.active_adapter or None
        result = []
        for info in infos:
            servers = {
                peer: server
                for peer, server in info.servers.items()
                if (allowed is None or peer in allowed)
                and peer not in blocked
                and (adapter is None or adapter in server.adapters)
            }
            usable = {peer: server for peer, server in servers.items() if peer not in banned}
            if servers and not usable:
                logger.debug("routing.ignoring_bans(uid=%s): every server of this block is banned", info.uid)
                usable = servers
            result.append(dataclasses.replace(info, servers=usable))
        return result

    def _spans_avoided(self, infos: list[RemoteModuleInfo]) -> dict[str, RemoteSpanInfo]:
        """The spans in `infos` of servers avoided now and not banned (`avoided_spans`)."""
        avoided = self.avoided_peers() - self.bans.banned_peers()
        if not avoided:
            return {}
        kept = [
            dataclasses.replace(info, servers={peer: s for peer, s in info.servers.items() if peer in avoided})
            for info in self._filter_servers(infos, excluded=set())
        ]
        return compute_spans(kept, min_state=ServerState.ONLINE)

    def _choose_peers_to_ping(self, infos: list[RemoteModuleInfo]) -> list[str]:
        """Samples up to `max_pinged` servers from each of the first, middle and last blocks (Petals' refresh); a
        policy that routes by region (`uses_rtts`: the client's region is the servers within its RTT bound) adds up
        to `PLACEMENT_PINGS` servers it has never measured, so that it knows its whole region after a few refreshes
        (the RTTs are kept: a pair of hosts' RTT barely changes)."""
        if self.config.max_pinged <= 0 or not infos:
            return []
        with self._lock:
            down = set(self._in_use)
        chosen: set[str] = set()
        for index in sorted({0, len(infos) // 2, len(infos) - 1}):
            peers = [
                peer
                for peer, server in infos[index].servers.items()
                if server.state == ServerState.ONLINE and peer not in down
            ]
            chosen.update(self.rng.sample(peers, min(len(peers), self.config.max_pinged)))
        if self.policy.uses_rtts:
            known = self._rtts.to_dict()
            online = {
                peer for info in infos for peer, server in info.servers.items() if server.state == ServerState.ONLINE
            }
            unknown = sorted(online - known.keys() - chosen - down)
            chosen.update(self.rng.sample(unknown, min(len(unknown), PLACEMENT_PINGS)))
        return sorted(chosen)

    def _update_loop(self) -> None:
        while not self._closed.is_set():
            try:
                self.update()
                self._last_update_error = None
            except Exception as e:
                self._last_update_error = e
                logger.warning("routing.update_failed(error=%r)", e)
            self._attempted.set()
            self._update_requested.wait(self.config.update_period_s)
            self._update_requested.clear()

    def request_update(self) -> None:
        """Asks the background thread to refresh now (non-blocking)."""
        self._update_requested.set()

    def wait_ready(self, timeout_s: float | None = None) -> None:
        timeout_s = self.config.dht_timeout_s + self.config.ping_timeout_s + 10 if timeout_s is None else timeout_s
        if self._thread is not None and event_wait(self._attempted, timeout_s) and not self._ready.is_set():
            raise ConnectionError(f"routing: cannot read block records: {self._last_update_error!r}")
        if not event_wait(self._ready, timeout_s):
            raise TimeoutError(
                f"routing: no view of the swarm after {timeout_s} s (last error: {self._last_update_error!r})"
            )

    # ---------------------------------------------------------------- planning

    def make_sequence(
        self,
        start: int = 0,
        end: int | None = None,
        *,
        mode: RouteMode,
        cache_tokens_needed: int | None = None,
        waited_s: float = 0.0,
        step_tokens: int = 0,
    ) -> list[RemoteSpanInfo]:
        """A chain of spans covering blocks `[start, end)`; raises MissingBlocksError if some block has no server.
        waited_s: how long the caller has been failing to get a chain (the policy may route differently then);
        step_tokens: the positions the chain's first step sends (a prompt, a replay: `ObservedSteps.priced`)."""
        end = self.num_blocks if end is None else end
        if not 0 <= start < end <= self.num_blocks:
            raise ValueError(f"block range [{start}, {end}) is outside [0, {self.num_blocks})")
        self.wait_ready()
        spans, rtts = self.spans, self.client_rtts_s
        if mode not in ("min_latency", "max_throughput"):
            raise ValueError(f"mode must be 'min_latency' or 'max_throughput', got {mode!r}")
        now = time.monotonic()
        if now < self._unmeasured_suspect_until:  # made-up records may be among them: measured servers first
            rtts = {**{span.peer_id: math.inf for span in spans}, **rtts}
        if now < self._unproven_suspect_until:  # lorises may be among them: servers seen on time first
            spans = proven_where_they_cover(spans, self.answered_on_time())
        spans = self.observed_steps.priced(spans, now, step_tokens)  # one seen slower than it announces costs that
        route = self.policy.choose_route(
            spans, start, end, mode=mode, client_rtts_s=rtts, cache_tokens_needed=cache_tokens_needed,
            client_load=self.routed.load(now), waited_s=waited_s, rng=self.rng,
        )  # fmt: skip
        if mode == "min_latency":  # an inference session holds its servers until it ends
            self.note_routed(route, now)
        show = self.config.show_route == "always" or (self.config.show_route == "inference" and mode == "min_latency")
        (logger.info if show else logger.debug)(
            "routing.route(blocks=%d:%d, mode=%s) %s",
            start,
            end,
            mode,
            " => ".join(f"{span.start}:{span.end} via ...{span.peer_id[-6:]}" for span in route),
        )
        return route

    def note_routed(self, route: Sequence[RemoteSpanInfo], now_s: float | None = None) -> None:
        """An inference session opened on `route` counts as this client's load on its servers (`make_sequence`'s
        routes, and cache-affine ones chosen by `prefix_routes`)."""
        self.routed.note((span.peer_id for span in route), time.monotonic() if now_s is None else now_s)

    def on_request_failure(self, peer_id: str | None) -> None:
        """Bans the peer and drops it from the current view; refreshes at once if a block became uncovered. A server
        this client never measured that fails makes every unmeasured server count as unreachable in routes for
        `update_period_s`, and refreshes at once (whose pings measure up to `PLACEMENT_PINGS` of them): anyone can
        announce made-up servers, which a route would otherwise try one by one (decision 0137)."""
        if peer_id is None:
            self.request_update()
            return
        if not self._rtts.measured(peer_id):
            self._unmeasured_suspect_until = time.monotonic() + self.config.update_period_s
            self.request_update()
        duration_s = self.bans.ban(peer_id)
        if duration_s:
            logger.info("routing.ban(peer=...%s, duration_s=%.0f)", peer_id[-6:], duration_s)
        with self._lock:  # (`note_on_time` trims the on-time table under it: decision 0231)
            self._on_time.pop(peer_id, None)
            remaining = [span for span in self._spans if span.peer_id != peer_id]
            self._spans = remaining
        if not covers(remaining, 0, self.num_blocks):
            self.request_update()

    def avoided_peers(self) -> set[str]:
        """Servers skipped for now (`avoid`): they refused a session for want of KV cache, or were too slow to keep one."""
        now = time.monotonic()
        with self._lock:
            for peer in [peer for peer, until in self._avoid_until.items() if until <= now]:
                del self._avoid_until[peer]
            return set(self._avoid_until)

    def avoided_spans(self) -> list[RemoteSpanInfo]:
        """The spans of servers avoided now (`avoid`) and not banned, as last read. Never routed, but asked to recheck
        a dispute (`StretchReferees.outsiders`, decision 0228): an avoidance proves nothing against a server (two free
        identities get any server avoided), so those who got the honest outsiders avoided do not get the seats."""
        excluded = self.bans.banned_peers()
        avoided = self.avoided_peers()
        with self._lock:
            return [span for peer, span in self._set_aside.items() if peer in avoided and peer not in excluded]

    def excluded_peers(self) -> set[str]:
        """Servers routes leave out now: banned (they failed) or avoided (`avoid`)."""
        return self.bans.banned_peers() | self.avoided_peers()

    def stepping_through(self, peer_id: str) -> None:
        """A session of this client opened a stream to `peer_id` (`SpanSession.open`); until as many `stepped_off`,
        the refresh does not ping it: its steps measure it, and a ping that fails during an outage puts the address in
        libp2p's dial back-off, which the session's own dial would meet once the link is back (decision 0217)."""
        with self._lock:
            self._in_use[peer_id] = self._in_use.get(peer_id, 0) + 1

    def stepped_off(self, peer_id: str) -> None:
        """A stream `stepping_through` counted is closed."""
        with self._lock:
            if (left := self._in_use.pop(peer_id, 0) - 1) > 0:
                self._in_use[peer_id] = left

    @contextlib.contextmanager
    def link_down(self, peer_id: str) -> Iterator[None]:
        """While a session knocks on `peer_id`'s listener (`client.transport.link_probe`: its link is down), the refresh
        does not ping it either (as `stepping_through`), whether or not the session still holds a stream to it (a
        replacement stream that failed to open does not count): the knock answers the same question without p2pd."""
        self.stepping_through(peer_id)
        try:
            yield
        finally:
            self.stepped_off(peer_id)

    def may_avoid(self, peer_id: str) -> bool:
        """Whether `avoid(peer_id, ...)` would take: the other servers of the view cover every block, and, with a policy
        that routes by region, the client's region too if it did with it (`cache_refusals.may_avoid`)."""
        rtts = self.client_rtts_s
        with self._lock:
            return may_avoid(self._spans, peer_id, self.num_blocks, rtts, self.policy.route_region_rtt_s)

    def avoid(self, peer_id: str, duration_s: float, *, keep_region: bool = True, slow: bool = False) -> bool:
        """Skips `peer_id` in routes for `duration_s` (not a failure: its ban record stays as it was), and drops it
        from the view now; returns whether it did. Like a ban, it is ignored where `may_avoid` says no (not recorded
        at all then: every re-read would drop it from the view again); `keep_region` False: only where the rest of
        the view would lose a block (a session leaving a server for a chain it priced, RTTs included, faster:
        decision 0196). Used for a server out of KV cache (`on_cache_refusal`), one too slow to keep a session
        (decisions 0144, 0189), and one outvoted or out of range (`verification`). `slow`: avoided for its pace, so
        no longer seen on time either (`answered_on_time`); any other avoidance says nothing of its pace and keeps
        that mark (decision 0231: else two free identities outvoting a server kept it out of routes)."""
        rtts = self.client_rtts_s
        region_rtt_s = self.policy.route_region_rtt_s if keep_region else None
        with self._lock:
            if not may_avoid(self._spans, peer_id, self.num_blocks, rtts, region_rtt_s):
                return False
            until = max(self._avoid_until.get(peer_id, 0.0), time.monotonic() + duration_s)
            remember(self._avoid_until, peer_id, until, worth=worth_itself)  # (those over first, the longest kept)
            self._set_aside.update((span.peer_id, span) for span in self._spans if span.peer_id == peer_id)
            self._spans = [span for span in self._spans if span.peer_id != peer_id]
            if slow:
                self._on_time.pop(peer_id, None)
        return True

    def suspect_unproven(self, duration_s: float) -> None:
        """A server that answered pings held a step past its deadline and the late budget (a loris, or an overloaded
        server): for `duration_s`, routes leave out every server this client never saw answer a step within its
        deadline where servers it saw do cover its blocks (announced figures are free; what the client measured is
        not), so that its next sessions do not start on the loris's peers (decision 0163)."""
        self._unproven_suspect_until = max(self._unproven_suspect_until, time.monotonic() + duration_s)

    def note_on_time(self, peer_id: str) -> None:
        """`peer_id` answered a step of this client within the step's deadline (`client.session.stalls`): what the
        client measured, not what the server announced (`answered_on_time`)."""
        with self._lock:
            remember(self._on_time, peer_id, None)

    def unprove(self, peer_id: str) -> None:
        """`peer_id` answered within a deadline something the client could not use (a race's trial whose outputs
        disagreed, `replacement_race.TrialDisagrees`): an answer on time proves nothing then (`answered_on_time`)."""
        with self._lock:
            self._on_time.pop(peer_id, None)

    def answered_on_time(self) -> set[str]:
        """Servers seen answering a step within its deadline and not avoided for their pace (`avoid`'s `slow`) or
        failed since: a replacement race tries them first (`client.session.replacement_race`)."""
        with self._lock:
            return set(self._on_time)

    def _rtt_worth(self, peer_id: str, rtt_s: float) -> float:
        """What an RTT is worth keeping (`peer_tables.forget_least`; read under the RTTs' lock, so without this
        manager's, which the refresh holds while it stores them): a server seen on time most, then one that answered."""
        return 2.0 if peer_id in self._on_time else 0.0 if math.isinf(rtt_s) else 1.0

    def on_cache_refusal(self, peer_id: str) -> None:
        """`peer_id` had no KV cache for a session: skip it for `AVOID_S` (`avoid`) and re-read the records now
        (blocking, unless read within `MIN_REREAD_S`), so that the re-route that follows sees the servers' fresh
        free-cache figures."""
        self.avoid(peer_id, AVOID_S)
        logger.info("routing.cache_refusal(peer=...%s, avoid_s=%.0f)", peer_id[-6:], AVOID_S)
        self.reread()

    def reread(self, newer_than: float | None = None) -> None:
        """Re-reads the records now (blocking) unless a read started at or after `newer_than` (a `time.monotonic()`;
        default: `MIN_REREAD_S` ago): for a caller that needs the swarm as it is (a replacement for a server that
        refused or drains). Concurrent callers wait for one read, not one each. A failed read asks the background
        thread to try again and keeps the old view."""
        cutoff = time.monotonic() - MIN_REREAD_S if newer_than is None else newer_than
        try:
            with self._update_lock:
                if self._read_started_at < cutoff:
                    self._read()
        except Exception as e:  # the background thread tries again
            logger.warning("routing.reread_failed(error=%r)", e)
            self.request_update()

    def reread_for_drain(self, peer_id: str, newer_than: float) -> None:
        """`reread(newer_than)` for a replacement of draining `peer_id`, but one read per peer per `update_period_s`
        (later calls take its view): else a server that marks every reply draining, the only one of its blocks, would
        make every token of its sessions wait for a read of the records."""
        now = time.monotonic()
        with self._lock:
            first = self._drain_reads.get(peer_id)
            if first is None or now - first >= self.config.update_period_s:
                for peer in [p for p, at in self._drain_reads.items() if now - at >= self.config.update_period_s]:
                    del self._drain_reads[peer]
                self._drain_reads[peer_id] = first = now
        self.reread(min(newer_than, first))

    def describe_missing(self, missing: Sequence[int], timeout_s: float = 5.0) -> str:
        """What the swarm does serve, for a missing-blocks message: the DHT prefix asked for, the prefixes in the
        swarm's model index (`_petals.models`), and a `--dht_prefix` hint when ours is not among them."""
        prefix = self.block_uids[0].rsplit(".", 1)[0]
        blocks = f"{min(missing)}:{max(missing) + 1}" if missing else "?"
        text = f"blocks {blocks} of DHT prefix {prefix!r} have no server"
        if self.dht is None:
            return text
        try:
            served = sorted(get_verified_model_infos(self.dht, timeout_s=timeout_s))
        except Exception as e:  # a diagnosis must not hide the real error
            return f"{text} (could not read the swarm's model index: {type(e).__name__})"
        others = [p for p in served if p != prefix]
        if not served:
            return f"{text}; the swarm announces no models (are servers up and joined to these --initial_peers?)"
        text += f"; the swarm serves DHT prefixes: {', '.join(repr(p) for p in served[:8])}"
        if prefix not in served and others:
            text += f" (if the servers run the same model under another name, pass --dht_prefix {others[0]})"
        return text

    def on_request_success(self, peer_id: str) -> None:
        self.bans.clear(peer_id)

    # ---------------------------------------------------------------- RPC plumbing

    def make_chain(self, start: int, end: int) -> str:
        """The uid chain `"prefix.start ... prefix.end-1"` that names a span in requests."""
        return CHAIN_DELIMITER.join(self.block_uids[start:end])

    def request_metadata(self, peer_id: str | None = None) -> dict[str, Any]:
        """Metadata every request carries; in a private swarm also the membership proof for server `peer_id`."""
        metadata: dict[str, Any] = {"points": self.config.points, "active_adapter": self.config.active_adapter or ""}
        if self.membership is not None and peer_id is not None:
            proof = self.membership.make_proof(sender=self._local_peer_id(), receiver=peer_id)
            metadata[MEMBER_PROOF_KEY] = proof.to_wire()
        return metadata

    def _local_peer_id(self) -> str:
        if self._p2p is not None:
            return self._p2p.peer_id.to_base58()
        return get_peer_id(self.dht).to_base58()

    async def _get_p2p(self) -> Any:
        if self._p2p is None:
            if self.dht is None:
                raise RuntimeError("routing.no_p2p: this sequence manager has neither a p2p instance nor a DHT")
            self._p2p = await self.dht.replicate_p2p()
        return self._p2p

    async def get_stub(self, peer_id: str) -> Any:
        """RPC stub of a server (must be awaited on the client loop)."""
        stub = self._stubs.get(peer_id)
        if stub is None:
            stub = TransformerConnectionHandler.get_stub(await self._get_p2p(), PeerID.from_base58(peer_id))
            remember(self._stubs, peer_id, stub)
        return stub

    async def open_inference_stream(self, peer_id: str, rpc: str = "rpc_inference") -> InferenceStream:
        """An `rpc_inference` stream (or another streaming rpc's: `rpc_forward_stream`, `rpc_backward_stream`) to a
        server through p2pd (must be awaited on the client loop; the caller bounds the time)."""
        return await P2PInferenceStream.open(await self._get_p2p(), peer_id, rpc)

    async def _ask_direct_ticket(self, peer_id: str) -> DirectOffer:
        """A ticket for `peer_id`'s direct port, asked for over p2p (must be awaited on the client loop), with the
        hosts the client may dial (`direct_transport.dialable`: a host local to the client only where p2p reached
        the server there); raises where the server has none (a stock Petals server does not know the RPC), answers
        nonsense or offers only hosts local to the client."""
        uid = ""
        if self.membership is not None:  # a private swarm's server wants the proof on the uid, as for rpc_info
            uid = join_info_uid(uid, self.membership.make_proof(sender=self._local_peer_id(), receiver=peer_id))
        p2p = await self._get_p2p()
        call = p2p.call_protobuf_handler(
            PeerID.from_base58(peer_id), handle_name("rpc_direct_ticket"), runtime_pb2.ExpertUID(uid=uid),
            runtime_pb2.ExpertInfo,
        )  # fmt: skip
        response = await asyncio.wait_for(call, self.config.request_timeout_s)
        offer = DirectOffer.from_dict(decode_metadata(response.serialized_info))
        peers = await asyncio.wait_for(p2p.list_peers(), self.config.request_timeout_s)
        return dialable(
            offer, connection_ips(a for info in peers if info.peer_id.to_base58() == peer_id for a in info.addrs)
        )

    def cached_input_compression(self, peer_id: str) -> int | None:
        """`input_compression` if already known (any thread), else None."""
        return self._input_compressions.get(peer_id)

    async def input_compression(self, peer_id: str, block_uid: str) -> int:
        """The compression a server asks clients to send activations in (its `rpc_info` schema, as Petals clients
        read it; servers started with `--compression`); NONE when it says nothing or cannot be asked now."""
        cached = self._input_compressions.get(peer_id)
        if cached is not None:
            return cached
        try:
            stub = await self.get_stub(peer_id)
            if self.membership is not None:  # rpc_info has no metadata: the proof rides on the uid
                proof = self.membership.make_proof(sender=self._local_peer_id(), receiver=peer_id)
                block_uid = join_info_uid(block_uid, proof)
            response = await stub.rpc_info(runtime_pb2.ExpertUID(uid=block_uid), timeout=self.config.request_timeout_s)
            info = decode_metadata(response.serialized_info)
        except Exception as e:  # the request that follows reports a dead server; don't cache a guess
            logger.debug(f"routing.rpc_info_failed(peer=...{peer_id[-6:]}): {e!r}")
            return runtime_pb2.CompressionType.NONE
        compression = runtime_pb2.CompressionType.NONE
        for key in ("forward_schema", "inference_schema"):
            try:
                compression = int(info[key][0][0].compression)
                break
            except (KeyError, IndexError, TypeError, AttributeError, ValueError):
                continue
        remember(self._input_compressions, peer_id, compression)
        return compression

    @property
    def closed(self) -> bool:
        """Whether `shutdown` began (work that outlives sessions starts no more: decision 0256)."""
        return self._closed.is_set()

    def shutdown(self) -> None:
        self._closed.set()
        for hook in list(self.on_shutdown):
            hook()
        self._update_requested.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.config.dht_timeout_s + self.config.ping_timeout_s + 15)
        if self._p2p is not None:
            try:
                background_loop.run(self._p2p.shutdown(), timeout_s=5)
            except Exception as e:
                logger.debug("routing.p2p_shutdown_failed(error=%r)", e)
            self._p2p = None
        if self._own_dht and self.dht is not None:
            shutdown_dht(self.dht)
            self.dht = None

    def __enter__(self) -> RemoteSequenceManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
