"""Prefix caching in the swarm simulator (issue 34): stateless multi-turn chats (each turn is its own inference
session, as behind an OpenAI-style API, re-sending the whole conversation), a prefix cache per server
(`sim_cache.ServerPrefixCache`: capacity in tokens, least recently used forgotten first) and, optionally,
cache-affine routing by the real client function (`client.prefix.prefix_routes.PrefixRoutes.route_for`: a conversation goes
back to the chain that held it unless a server of it left, is overloaded, or a slower chain costs more than the
prefill it saves).

A turn's prefill computes the conversation minus the shortest hit along its chain (the client starts every server
after the shortest, as the real one does). `compare` runs one scenario three ways with the same seed: no cache, the
cache with the policy's plain routing, the cache with cache-affine routing; and reports the prefill tokens saved and
the time to first token of the turns that could reuse (turn 2 on)."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

from benchmarks.prefix.sim_cache import ServerPrefixCache
from benchmarks.sim.client_model import ClientDriver, SimSession
from benchmarks.sim.metrics import Report
from benchmarks.sim.simulation import SimConfig, Simulation
from benchmarks.sim.workload import WorkloadConfig
from corolla.client.prefix.prefix_chain import PrefixChain
from corolla.client.prefix.prefix_routes import PrefixRoutes
from corolla.protocol.prefix import PREFIX_BLOCK_TOKENS
from corolla.protocol.records import RemoteSpanInfo

ROOT = b"corolla.sim.prefix"  # the chain root of every simulated conversation (one model, no adapter)


@dataclass(frozen=True)
class PrefixSimConfig:
    """cache_tokens_per_server: each server's prefix cache (0: no cache); affine: cache-affine routing."""

    cache_tokens_per_server: int = 0
    affine: bool = False


@dataclass
class PrefixCounters:
    """What the prefix scenario measured (turns opened after the warm-up)."""

    prompt_tokens: int = 0  # positions the turns' prefills covered (history + new prompt)
    reused_tokens: int = 0  # of those, taken from the servers' caches
    affine_routes: int = 0  # turns routed to the chain that held their conversation
    later_ttft_s: list[float] = field(default_factory=list)  # time to first token of turns 2, 3, ...

    def summary(self) -> dict[str, Any]:
        ttft = sorted(self.later_ttft_s)
        return {
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "saved_prefill": round(self.reused_tokens / self.prompt_tokens, 3) if self.prompt_tokens else 0.0,
            "affine_routes": self.affine_routes,
            "later_turns": len(ttft),
            "later_ttft_p50_s": round(statistics.median(ttft), 3) if ttft else 0.0,
            "later_ttft_mean_s": round(statistics.fmean(ttft), 3) if ttft else 0.0,
        }


class StatelessPrefixDriver(ClientDriver):
    """The clients, each turn a fresh session: at a turn's end its chain's servers keep the conversation in their
    caches and the session closes (its KV reservation released); the next turn routes anew and prefills all but the
    shortest cached run of its chain."""

    def __init__(self, *args: Any, prefix: PrefixSimConfig, routes: PrefixRoutes | None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.prefix = prefix
        self.routes = routes
        self.caches: dict[str, ServerPrefixCache] = {}  # by peer id: a server that left takes its cache along
        self.chains: dict[int, PrefixChain] = {}  # by session id: the conversation's token ids so far
        self.counters = PrefixCounters()

    def cache_of(self, peer_id: str) -> ServerPrefixCache:
        cache = self.caches.get(peer_id)
        if cache is None:
            cache = self.caches[peer_id] = ServerPrefixCache(self.prefix.cache_tokens_per_server)
        return cache

    def chain_of(self, session: SimSession) -> PrefixChain:
        """The conversation's chain hashes over its `context` positions: synthetic token ids, the first one the
        session id (a chain hash covers every block before it, so no two conversations share a key), then p at p."""
        chain = self.chains.setdefault(session.sid, PrefixChain(ROOT))
        if len(chain) < session.context:
            known = len(chain)
            chain.set(known, [session.sid % 2**31 if p == 0 else p for p in range(known, session.context)])
        return chain

    def _reroute(self, session: SimSession) -> bool:
        if not super()._reroute(session):
            return False
        assert session.route is not None
        if self.prefix.cache_tokens_per_server > 0 and session.context > 0:
            hits = [self.cache_of(server.peer_id).hit(session.sid, start, end) for server, start, end in session.route]
            session.kv_on_route = min(min(hits), session.context // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS)
        return True

    def _prefill(self, session: SimSession, new_tokens: int) -> None:
        super()._prefill(session, new_tokens)
        if session.phase == "prefill" and session.record_ttft and session.counted:
            self.counters.prompt_tokens += session.context + new_tokens
            self.counters.reused_tokens += session.kv_on_route

    def _first_token(self, session: SimSession, new_tokens: int) -> None:
        if session.record_ttft and session.turn > 0 and session.counted:
            self.counters.later_ttft_s.append(self.loop.now_s - session.turn_start_s)
        super()._first_token(session, new_tokens)

    def _end_turn(self, session: SimSession) -> None:
        assert session.route is not None
        if self.prefix.cache_tokens_per_server > 0:
            for server, start, end in session.route:
                self.cache_of(server.peer_id).store(session.sid, start, end, session.context)
            if self.routes is not None:
                spans = [
                    RemoteSpanInfo(server.peer_id, start, end, server.info or server.make_info())
                    for server, start, end in session.route
                ]
                self.routes.remember(self.chain_of(session), spans, session.context)
        self._leave_batches(session)
        self._release(session)  # the turn's session closes: its KV goes back (the cache model keeps the prefix)
        session.phase = "idle"
        session.turn += 1
        if session.turn < len(session.conversation.turns):
            session.event = self.loop.after(self.think_s(), self._open_turn, session)
        else:
            self.chains.pop(session.sid, None)
            self._close(session, completed=True)


class PrefixSimulation(Simulation):
    """A `Simulation` whose clients run stateless turns over servers with prefix caches (`PrefixSimConfig`)."""

    def __init__(self, config: SimConfig, prefix: PrefixSimConfig):
        super().__init__(config)
        self.prefix = prefix
        self.routes = PrefixRoutes() if prefix.affine and prefix.cache_tokens_per_server > 0 else None
        self.clients = StatelessPrefixDriver(
            self.loop,
            self.view,
            self.metrics,
            self._route,
            self.rngs["route"],
            self.workload.think_s,
            self._ended,
            sessions_per_client=config.workload.sessions_per_client,
            view_age_max_s=config.client_update_period_s,
            prefix=prefix,
            routes=self.routes,
        )

    def _route(self, session: SimSession) -> list[tuple[str, int, int]]:
        """The chain that held the conversation where `PrefixRoutes` keeps it (none of its servers banned for this
        session), else the policy's chain."""
        if self.routes is not None and session.context > 0:
            assert isinstance(self.clients, StatelessPrefixDriver)
            now = self.loop.now_s
            banned = {peer for peer, until in session.banned.items() if until > now}
            output = session.conversation.turns[session.turn][1]
            route = self.routes.route_for(
                self.view.client_spans(), self.clients.chain_of(session), 0, self.config.model.num_blocks,
                new_tokens=output,
            )  # fmt: skip
            if route is not None and not any(span.peer_id in banned for span in route):
                if session.counted:
                    self.clients.counters.affine_routes += 1
                client = self._client(session)
                if client is not None:  # the client's routed load counts the session, as a planned route's does
                    client.note((span.peer_id for span in route), now)
                return [(span.peer_id, span.start, span.end) for span in route]
        return super()._route(session)


PREFIX_WORKLOAD = WorkloadConfig(  # multi-turn chat: 5 turns of LMSYS-sized prompts and answers
    concurrent_clients=16, mean_turns=5.0, mean_think_s=10.0, region_weights={"us-east": 1.0, "europe": 1.0}
)


def compare(config: SimConfig, cache_tokens_per_server: int) -> dict[str, dict[str, Any]]:
    """The scenario three ways with one seed -> {way: its Report's summary + the prefix counters}."""
    ways = {
        "no cache": PrefixSimConfig(),
        "cache, plain routing": PrefixSimConfig(cache_tokens_per_server),
        "cache, affine routing": PrefixSimConfig(cache_tokens_per_server, affine=True),
    }
    results: dict[str, dict[str, Any]] = {}
    for way, prefix in ways.items():
        simulation = PrefixSimulation(config, prefix)
        report: Report = simulation.run()
        assert isinstance(simulation.clients, StatelessPrefixDriver)
        results[way] = {**report.summary(), **simulation.clients.counters.summary()}
    return results


def prefix_config(base: SimConfig, **overrides: Any) -> SimConfig:
    """`base` with the multi-turn chat workload (`PREFIX_WORKLOAD`) and `overrides`."""
    return dataclasses.replace(base, workload=PREFIX_WORKLOAD, **overrides)
