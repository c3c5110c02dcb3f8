"""The server's seat in the swarm: reads every server's span from the DHT, asks corolla's swarm policy
(`swarm.corolla_policy`) which span to load and whether to move, and samples the load it announces."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from typing import Any

from corolla.protocol.records import RemoteSpanInfo, ServerState
from corolla.server.metrics import ServerMetrics
from corolla.swarm.corolla_policy import CorollaPolicy
from corolla.swarm.ping import PingAggregator
from corolla.swarm.policy import PLACEMENT_PINGS, ServerCapacity, SwarmPolicy
from corolla.swarm.records_io import get_remote_module_infos
from corolla.swarm.rtt_book import RttBook
from corolla.swarm.spans import compute_spans
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DHT_READ_TIMEOUT_S = 20.0
JOIN_PING_TIMEOUT_S = 2.0


class SwarmSeat:
    """Placement and rebalancing for one server by `policy` (corolla's; tests may pass Petals' baseline to compare);
    `load_s` is what the last span took to load (the cost of a move), `online_since` when it started serving it."""

    def __init__(
        self,
        *,
        dht: Any,
        module_uids: list[str],
        max_blocks: int,
        throughput_info: dict[str, float],
        metrics: ServerMetrics,
        cache_tokens_per_block: int | None = None,
        policy: SwarmPolicy = CorollaPolicy(),
    ):
        self.policy = policy
        self.dht = dht
        self.module_uids = module_uids
        self.max_blocks = max_blocks
        self.throughput_info = throughput_info
        self.metrics = metrics
        self.cache_tokens_per_block = cache_tokens_per_block
        self.peer_id = ""
        self.load_s: float | None = None
        self.online_since = time.monotonic()
        self.num_moves = 0
        self._busy_sample: tuple[float, float] | None = None  # (time.monotonic(), runtime busy seconds)
        self.rtt_book = RttBook()  # RTTs it measured to other servers, kept across balance checks
        self.next_span: range | None = None  # the span a move fetched, loaded next
        self.fetching: range | None = None  # the span a planned move fetches while this server serves its own
        self._fetch_started = 0.0
        self._rng = random.Random()

    def capacity(self, rtts_s: Mapping[str, float] | None = None) -> ServerCapacity:
        """This server as the policy sees it: the throughput it measured for `max_blocks` blocks, the RTTs it measured
        to other servers (none before it serves), and the KV cache it holds per block (`cache_tokens_per_block`, Petals'
        unit; None = unknown). No `capacity_tps` curve: its KV cache per block is fixed whatever the span length, so
        fewer blocks give no more rows per step."""
        cache = () if self.cache_tokens_per_block is None else (float(self.cache_tokens_per_block),) * self.max_blocks
        return ServerCapacity(
            peer_id=self.peer_id,
            max_blocks=self.max_blocks,
            throughput=float(self.throughput_info.get("throughput", 1.0)),
            network_rps=self.throughput_info.get("network_rps"),
            rtts_s=dict(rtts_s or {}),
            cache_tokens_per_block=cache,
        )

    def throughput_for(self, block_indices: range) -> float:
        """The throughput to announce for `block_indices` (a policy may choose fewer than `max_blocks` blocks)."""
        return self.capacity().throughput_for(len(block_indices))

    async def read_spans(self) -> list[RemoteSpanInfo]:
        """Every server's span as placement sees it (JOINING and ONLINE)."""
        infos = await asyncio.to_thread(
            get_remote_module_infos, self.dht, self.module_uids, latest=True, timeout_s=DHT_READ_TIMEOUT_S
        )
        return list(compute_spans(infos, min_state=ServerState.JOINING).values())

    async def choose_span(self) -> range:
        """The span to load: the one a move fetched (`moving_to`), else the policy's choice over the swarm now."""
        if self.next_span is not None:
            chosen, self.next_span = self.next_span, None
            logger.info(f"server.placed(policy={self.policy.name}, blocks={chosen.start}:{chosen.stop}, fetched=True)")
            return chosen
        spans = await self.read_spans()
        rtts_s = await self.ping_servers(spans) if self.policy.uses_rtts else {}
        chosen = self.policy.choose_span(self.capacity(rtts_s), spans, len(self.module_uids))
        logger.info(f"server.placed(policy={self.policy.name}, blocks={chosen.start}:{chosen.stop})")
        return chosen

    async def ping_servers(self, spans: list[RemoteSpanInfo]) -> dict[str, float]:
        """Every RTT (s) its book holds to the servers of `spans`, after pinging through the DHT up to
        `PLACEMENT_PINGS` of them it has not measured (`swarm.rtt_book`: kept across checks, so that every check
        weighs the same region, which grows until the server has measured the whole swarm)."""
        peers = {span.peer_id for span in spans} - {self.peer_id}
        to_ping = self.rtt_book.to_ping(peers, PLACEMENT_PINGS, self._rng)
        if to_ping and self.dht is not None:
            pings = PingAggregator(self.dht)
            try:
                await asyncio.to_thread(pings.ping, to_ping, timeout_s=JOIN_PING_TIMEOUT_S)
                self.rtt_book.record(pings.to_dict())
            except Exception as e:  # placing without RTTs is placing as if every server were far
                logger.warning(f"server.join_pings_failed({e!r})")
        return self.rtt_book.known(peers)

    def loaded(self, load_s: float) -> None:
        """A span finished loading in `load_s` and serves from now on."""
        self.load_s = load_s
        self.online_since = time.monotonic()
        self.metrics.span_loaded(load_s)

    async def plan_move(self, rtts_s: Mapping[str, float] | None = None) -> range | None:
        """Asks the policy whether to move now and, if so, returns the span to move to (the policy's choice over the
        swarm without this server, as at a join); None to stay. `rtts_s`: what the server measured to other servers;
        a policy that places by RTT also pings the servers it has not measured (`swarm.rtt_book`)."""
        try:
            spans = await self.read_spans()
            if self.policy.uses_rtts:
                self.rtt_book.record(rtts_s or {})
                rtts_s = await self.ping_servers(spans)
            me = self.capacity(rtts_s)
            decision = self.policy.choose_move(
                me, spans, len(self.module_uids), reload_s=self.load_s or 0.0,
                since_move_s=time.monotonic() - self.online_since, rng=random.Random(),
            )  # fmt: skip
            target = self.policy.choose_span(me, spans, len(self.module_uids)) if decision.move else None
        except Exception as e:
            logger.warning(f"server.balance_check_failed({e!r})")
            return None
        logger.info(
            f"server.balance_check(policy={self.policy.name}, move={decision.move}, reason={decision.reason}, "
            f"flow_now_tps={decision.flow_now_tps:.1f}, flow_after_tps={decision.flow_after_tps:.1f}"
            + (f", target={target.start}:{target.stop})" if target is not None else ")")
        )
        return target

    def fetch_started(self, span: range) -> None:
        """A planned move fetches `span`'s weights while the server keeps serving: announced (`moving_to`, so
        operators and `corolla-health` see the move in progress) and in the metrics (`corolla_span_fetching`)."""
        self.fetching, self._fetch_started = span, time.monotonic()
        self.metrics.fetch_started()

    def fetch_ended(self, *, dropped: bool) -> None:
        """The fetch is over: the server moves next, or (`dropped`) the policy asked again no longer wants the move."""
        self.fetching = None
        self.metrics.fetch_ended(time.monotonic() - self._fetch_started)
        if dropped:
            self.metrics.move_dropped()

    def moving_to(self, span: range) -> None:
        """The server leaves its span for `span` (whose weights it fetched): counted, and loaded next."""
        self.next_span = span
        self.num_moves += 1
        self.metrics.move_started()

    def load_fields(self, service: Any) -> dict[str, Any]:
        """What the announcer puts in `ServerInfo`'s load fields: open sessions, the share of the time since the last
        sample the runtime was busy, tokens served, moves made, the span a move fetches now (None: no fetch; always
        given, so that the announcer clears it) (`service`: the SpanService serving now, or None)."""
        fields: dict[str, Any] = {
            "tokens_served": self.metrics.tokens_total(),
            "num_moves": self.num_moves,
            "moving_to": None if self.fetching is None else (self.fetching.start, self.fetching.stop),
        }
        if service is None:
            return fields
        now, busy_s = time.monotonic(), sum(stats.busy_s for stats in service.runtime.stats().values())
        if self._busy_sample is not None and now > self._busy_sample[0] and busy_s >= self._busy_sample[1]:
            fraction = (busy_s - self._busy_sample[1]) / (now - self._busy_sample[0])
            fields["busy_fraction"] = float(min(max(fraction, 0.0), 1.0))
        self._busy_sample = (now, busy_s)
        fields["sessions_active"] = service.core.num_open  # through every front
        return fields
