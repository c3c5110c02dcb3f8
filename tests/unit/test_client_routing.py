"""Routing: route planning (pure), bans, retry schedule and the sequence manager's view of the swarm."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from types import SimpleNamespace

import pytest

import corolla.client.routing.sequence_manager as routing_module
from benchmarks.sim.policies import make_policy
from corolla.client.calls.retries import RetryBudget, has_alternative
from corolla.client.config import ClientConfig
from corolla.client.routing.bans import BanList
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.protocol.records import RemoteModuleInfo, RemoteSpanInfo, ServerInfo, ServerState
from corolla.swarm.cache_refusals import IMMEDIATE_REROUTES, is_cache_refusal
from corolla.swarm.route_planning import (
    find_missing_blocks,
    has_cache_for,
    make_max_throughput_route,
    make_min_latency_route,
)
from corolla.utils.errors import AllocationFailed, MissingBlocksError
from helpers.fake_chain import implied_throughput


def span(peer: str, start: int, end: int, **info) -> RemoteSpanInfo:
    info.setdefault("state", ServerState.ONLINE)
    info.setdefault("throughput", 1.0)
    return RemoteSpanInfo(peer, start, end, ServerInfo(start_block=start, end_block=end, **info))


def chain(route: list[RemoteSpanInfo]) -> list[tuple[str, int, int]]:
    return [(s.peer_id, s.start, s.end) for s in route]


def test_min_latency_prefers_faster_of_two_equivalent_chains():
    spans = [
        span("slowA", 0, 2, inference_rps=5.0),
        span("slowB", 2, 4, inference_rps=5.0),
        span("fastA", 0, 2, inference_rps=500.0),
        span("fastB", 2, 4, inference_rps=500.0),
    ]
    rtts = {p.peer_id: 0.01 for p in spans}
    assert chain(make_min_latency_route(spans, 0, 4, client_rtts_s=rtts)) == [("fastA", 0, 2), ("fastB", 2, 4)]
    # equal compute, but the client is far from one chain
    spans = [span(p, s, e) for p, s, e in [("nearA", 0, 2), ("nearB", 2, 4), ("farA", 0, 2), ("farB", 2, 4)]]
    rtts = {"nearA": 0.01, "nearB": 0.01, "farA": 0.5, "farB": 0.5}
    assert chain(make_min_latency_route(spans, 0, 4, client_rtts_s=rtts)) == [("nearA", 0, 2), ("nearB", 2, 4)]


def test_min_latency_prefers_one_long_span_and_uses_next_pings():
    spans = [span("long", 0, 4), span("a", 0, 2, next_pings={"b": 0.001}), span("b", 2, 4)]
    rtts = {"long": 0.05, "a": 0.05, "b": 0.05}
    assert chain(make_min_latency_route(spans, 0, 4, client_rtts_s=rtts)) == [("long", 0, 4)]
    # a sub-range starts mid-span and stops mid-span
    assert chain(make_min_latency_route(spans, 1, 3, client_rtts_s=rtts)) == [("long", 1, 3)]
    # a -> b is cheap only through the ping that `a` measured to `b`
    spans = [span("a", 0, 2, next_pings={"b": 0.001, "c": 2.0}), span("b", 2, 4), span("c", 2, 4)]
    rtts = {"a": 0.05, "b": 0.05, "c": 0.05}
    assert chain(make_min_latency_route(spans, 0, 4, client_rtts_s=rtts)) == [("a", 0, 2), ("b", 2, 4)]


def test_min_latency_avoids_servers_short_of_cache():
    spans = [
        span("full", 0, 4, cache_tokens_left=100, inference_rps=1000.0),
        span("roomy", 0, 4, cache_tokens_left=10**6),
    ]
    assert not has_cache_for(spans[0], 1024) and has_cache_for(spans[1], 1024)
    route = make_min_latency_route(spans, 0, 4, client_rtts_s={}, cache_tokens_needed=1024)
    assert chain(route) == [("roomy", 0, 4)]
    route = make_min_latency_route(spans, 0, 4, client_rtts_s={}, cache_tokens_needed=8)  # 8*2*4 <= 100
    assert chain(route) == [("full", 0, 4)]


def test_missing_blocks_are_named():
    spans = [span("a", 0, 2), span("b", 4, 6)]
    assert find_missing_blocks(spans, 0, 6) == [2, 3]
    for make in (make_min_latency_route, make_max_throughput_route):
        with pytest.raises(MissingBlocksError) as info:
            make(spans, 0, 6, client_rtts_s={})
        assert info.value.missing == [2, 3]
        assert "[2, 3]" in str(info.value)
    with pytest.raises(ValueError):
        make_min_latency_route(spans, 3, 3, client_rtts_s={})


def test_max_throughput_spreads_by_span_length_and_skips_unreachable():
    spans = [span("long", 0, 6), span("short", 0, 2), span("tail", 2, 6), span("dead", 0, 6)]
    rtts = {"dead": math.inf}
    rng = random.Random(0)
    firsts = Counter()
    for _ in range(600):
        route = make_max_throughput_route(spans, 0, 6, client_rtts_s=rtts, rng=rng)
        assert route[0].start == 0 and route[-1].end == 6
        assert all(a.end == b.start for a, b in itertools.pairwise(route))
        firsts[route[0].peer_id] += 1
    assert firsts["dead"] == 0
    assert 0.6 < firsts["long"] / 600 < 0.9  # weight 6 vs 2 -> 0.75


def test_bans_grow_and_clear_on_success():
    now = [0.0]
    bans = BanList(15.0, 2.0, clock=lambda: now[0])
    assert bans.ban("p") == 15.0 and bans.is_banned("p")
    assert bans.ban("p") == 0.0  # failures while banned do not extend the ban
    now[0] = 15.1
    assert not bans.is_banned("p")
    assert bans.ban("p") == 30.0
    now[0] += 30.1
    assert bans.ban("p") == 60.0
    bans.clear("p")
    assert not bans.is_banned("p") and bans.ban("p") == 15.0
    assert bans.banned_peers() == {"p"}


def test_retry_schedule_and_config_validation():
    config = ClientConfig(min_backoff_s=1.0, max_backoff_s=5.0, max_retries=3)
    assert [config.retry_delay_s(i) for i in range(6)] == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert not config.retries_exhausted(3) and config.retries_exhausted(4)
    assert ClientConfig(max_retries=None).retries_exhausted(10**6) is False
    with pytest.raises(ValueError, match="connect_timeout_s"):
        ClientConfig(connect_timeout_s=-1)
    with pytest.raises(ValueError, match="show_route"):
        ClientConfig(show_route="sometimes")
    assert ClientConfig(initial_peers="/ip4/127.0.0.1/tcp/1/p2p/x").initial_peers == ("/ip4/127.0.0.1/tcp/1/p2p/x",)


class FakeSwarmManager(RemoteSequenceManager):
    """A sequence manager whose block records come from a dict instead of the DHT."""

    def __init__(
        self, config: ClientConfig, servers: dict[str, ServerInfo], num_blocks: int, clock=None, policy: str = "corolla"
    ):
        uids = [f"m.{i}" for i in range(num_blocks)]
        super().__init__(config, uids, start_updates=False, policy=make_policy(policy))
        self.servers = servers
        if clock is not None:
            self.bans = BanList(config.ban_timeout_s, config.ban_backoff_rate, clock=clock)

    def fetch_module_infos(self) -> list[RemoteModuleInfo]:
        infos = []
        for i, uid in enumerate(self.block_uids):
            held = {p: s for p, s in self.servers.items() if s.start_block <= i < s.end_block}
            infos.append(RemoteModuleInfo(uid, held))
        return infos

    def measure_rtts_s(self, peer_ids):
        return {p: 0.01 for p in peer_ids}


def info(start: int, end: int, state=ServerState.ONLINE, **kw) -> ServerInfo:
    """A record; a server given its `inference_rps` announces the throughput it implies (`implied_throughput`)."""
    kw.setdefault("throughput", implied_throughput(start, end, kw["inference_rps"]) if "inference_rps" in kw else 1.0)
    return ServerInfo(state=state, start_block=start, end_block=end, **kw)


def test_manager_ignores_joining_and_applies_allow_block_lists():
    servers = {"joining": info(0, 4, ServerState.JOINING), "a": info(0, 2), "b": info(2, 4), "c": info(0, 4)}
    manager = FakeSwarmManager(ClientConfig(blocked_servers=["c"]), servers, 4)
    manager.update()
    assert {s.peer_id for s in manager.spans} == {"a", "b"}
    assert chain(manager.make_sequence(0, 4, mode="min_latency")) == [("a", 0, 2), ("b", 2, 4)]
    manager = FakeSwarmManager(ClientConfig(allowed_servers=["a"]), servers, 4)
    manager.update()
    with pytest.raises(MissingBlocksError) as e:
        manager.make_sequence(0, 4, mode="max_throughput")
    assert e.value.missing == [2, 3]


def test_banned_server_is_avoided_then_retried_after_its_ban():
    now = [100.0]
    servers = {"fast": info(0, 4, inference_rps=1000.0), "slow": info(0, 4, inference_rps=10.0)}
    manager = FakeSwarmManager(ClientConfig(ban_timeout_s=15.0), servers, 4, clock=lambda: now[0])
    manager.update()
    assert chain(manager.make_sequence(mode="min_latency")) == [("fast", 0, 4)]
    manager.on_request_failure("fast")
    assert chain(manager.make_sequence(mode="min_latency")) == [("slow", 0, 4)]
    manager.update()  # still banned after a refresh
    assert chain(manager.make_sequence(mode="min_latency")) == [("slow", 0, 4)]
    now[0] += 15.5
    manager.update()
    assert chain(manager.make_sequence(mode="min_latency")) == [("fast", 0, 4)]
    # a second failure without success in between: banned twice as long
    manager.on_request_failure("fast")
    now[0] += 16.0
    manager.update()
    assert chain(manager.make_sequence(mode="min_latency")) == [("slow", 0, 4)]
    now[0] += 15.0
    manager.update()
    assert chain(manager.make_sequence(mode="min_latency")) == [("fast", 0, 4)]


def test_corolla_client_measures_its_whole_region_and_routes_there_first():
    """Petals' client pings a few servers of the first, middle and last blocks; corolla's routes by region (near first,
    decision 0030), so it also pings the servers it never measured, and passes how long a session has waited."""
    servers = {f"s{i}": info(i, i + 1) for i in range(8)}
    pinged: list[list[str]] = []

    class Pinging(FakeSwarmManager):
        def measure_rtts_s(self, peer_ids):
            pinged.append(sorted(peer_ids))
            return {p: 0.01 for p in peer_ids}

    petals = Pinging(ClientConfig(max_pinged=1), servers, 8, policy="petals")
    petals.update()
    assert len(pinged[-1]) == 3  # one of block 0's, block 4's and block 7's servers
    corolla = Pinging(ClientConfig(max_pinged=1), servers, 8)
    corolla.update()
    assert pinged[-1] == sorted(servers) and set(corolla.client_rtts_s) == set(servers)
    corolla.update()
    assert len(pinged[-1]) == 3  # measured once, kept
    seen = []
    corolla.policy = SimpleNamespace(choose_route=lambda *a, **kw: seen.append(kw["waited_s"]) or [])
    corolla.make_sequence(0, 8, mode="min_latency", waited_s=7.0)
    assert seen == [7.0]


@pytest.mark.parametrize("policy", ["petals", "corolla"])
def test_a_server_whose_link_is_down_is_not_pinged_while_a_session_knocks_on_it(policy):
    """A ping dials through p2pd; one that fails late in an outage puts the address in libp2p's dial back-off and keeps
    the knocking session from the server after its link returns. The last block's only server is pinged on every
    refresh, except while some session knocks on it (`link_down`, nestable); afterwards it is pinged again."""
    servers = {"first": info(0, 2), "last": info(2, 4)}
    pinged: list[list[str]] = []

    class Pinging(FakeSwarmManager):
        def measure_rtts_s(self, peer_ids):
            pinged.append(sorted(peer_ids))
            return {p: 0.01 for p in peer_ids}

    manager = Pinging(ClientConfig(max_pinged=3), servers, 4, policy=policy)
    manager.update()
    assert "last" in pinged[-1]
    with manager.link_down("last"):
        with manager.link_down("last"):  # two sessions knock on it
            manager.update()
            assert pinged[-1] == ["first"]
        manager.update()
        assert pinged[-1] == ["first"]
        assert {s.peer_id for s in manager.spans} == {"first", "last"}  # still routed to: only the pings stop
    manager.update()
    assert "last" in pinged[-1]


def test_bans_are_ignored_when_they_would_leave_a_block_uncovered():
    manager = FakeSwarmManager(ClientConfig(), {"only": info(0, 3)}, 3)
    manager.update()
    manager.on_request_failure("only")
    assert manager.spans == []  # dropped from the current view at once
    manager.update()
    assert chain(manager.make_sequence(mode="min_latency")) == [("only", 0, 3)]


def test_active_adapter_selects_servers_that_hold_it():
    servers = {"plain": info(0, 2, inference_rps=1000.0), "tuned": info(0, 2, adapters=("my-lora",))}
    manager = FakeSwarmManager(ClientConfig(active_adapter="my-lora"), servers, 2)
    manager.update()
    assert chain(manager.make_sequence(mode="min_latency")) == [("tuned", 0, 2)]
    assert manager.request_metadata()["active_adapter"] == "my-lora"
    manager = FakeSwarmManager(ClientConfig(), servers, 2)
    manager.update()
    assert chain(manager.make_sequence(mode="min_latency")) == [("plain", 0, 2)]


def test_a_cache_refusal_rereads_avoids_the_server_and_reroutes_at_once(monkeypatch):
    """A server out of KV cache is not banned (its failures and ban back-off are untouched): the client re-reads the
    records, routes around it for `AVOID_S` and retries with no delay for the first `IMMEDIATE_REROUTES` refusals in
    a row, then backs off as after a failure. The refusal is recognized in the server's text (over p2p the client
    sees only hivemind's error message) as in the exception type."""
    servers = {"full": info(0, 4, inference_rps=1000.0), "roomy": info(0, 4, inference_rps=10.0)}
    manager = FakeSwarmManager(ClientConfig(min_backoff_s=1.0), servers, 4)
    reads = []
    fetch = manager.fetch_module_infos
    monkeypatch.setattr(manager, "fetch_module_infos", lambda: reads.append(1) or fetch())
    manager.update()
    assert chain(manager.make_sequence(mode="min_latency")) == [("full", 0, 4)]
    refusal = RuntimeError(
        "Failed to call handler `rpc_inference`: KV pool is full: need 4 pages, 1 free in all layers"
    )
    assert is_cache_refusal(refusal) and is_cache_refusal(AllocationFailed("no room"))
    assert not is_cache_refusal(ConnectionError("reset by peer"))
    budget = RetryBudget(manager)
    monkeypatch.setattr(routing_module, "MIN_REREAD_S", 0.0)
    for _ in range(IMMEDIATE_REROUTES):
        assert budget.on_failure(refusal, "full", (0, 4)) == 0.0
    assert len(reads) == 1 + IMMEDIATE_REROUTES  # re-read after each refusal
    assert chain(manager.make_sequence(mode="min_latency")) == [("roomy", 0, 4)]
    assert "full" not in manager.bans.banned_peers() and manager.avoided_peers() == {"full"}
    assert budget.on_failure(refusal, "full", (0, 4)) > 0  # refused again and again: the swarm looks full


def test_a_failing_sole_server_is_kept_and_the_records_are_read_again():
    """The only server of the blocks fails on the network: it is not banned (its link may come back), and the client
    asks for a fresh read of the records, so a replica that came online since the last read takes over instead of
    the retries going to the dead server alone until the budget runs out."""
    servers = {"lone": info(0, 4)}
    manager = FakeSwarmManager(ClientConfig(), servers, 4)
    manager.update()
    servers["replica"] = info(0, 4)  # online after the client's last read
    requested = []
    manager.request_update = lambda: requested.append(1) or manager.update()  # the background thread's refresh
    budget = RetryBudget(manager)
    assert budget.on_failure(ConnectionError("reset by peer"), "lone", (0, 4)) <= 1.0
    assert requested and "lone" not in manager.bans.banned_peers()
    assert has_alternative(manager, "lone", (0, 4))  # the replica is in the view now
    budget.on_failure(ConnectionError("reset by peer"), "lone", (0, 4))  # no longer the only one: banned
    assert chain(manager.make_sequence(mode="min_latency")) == [("replica", 0, 4)]


def test_a_cache_refusal_of_a_blocks_only_server_does_not_hide_it():
    """The only server of some blocks that refused for cache stays in the view, also after a re-read: avoiding it
    would turn a full server into MissingBlocksError until the avoidance ran out."""
    servers = {"lone": info(0, 4)}
    manager = FakeSwarmManager(ClientConfig(), servers, 4)
    manager.update()
    manager.on_cache_refusal("lone")
    manager.update()
    assert manager.avoided_peers() == set()
    assert chain(manager.make_sequence(mode="min_latency")) == [("lone", 0, 4)]


@pytest.mark.parametrize("policy", ["petals", "corolla"])
def test_a_cache_refusal_keeps_the_clients_region_whole_for_corolla(policy):
    """corolla's client does not avoid a refusing server where its region (servers within the policy's RTT bound)
    would lack a block without it: the session waits for room there rather than be routed out of its region by its own
    avoidance (decision 0030). Where the region keeps every block, or with Petals' policy, it is avoided as before."""
    servers = {"near_a": info(0, 2), "near_b": info(2, 4), "near_c": info(0, 2), "far": info(0, 4)}

    class Regional(FakeSwarmManager):
        def measure_rtts_s(self, peer_ids):
            return {p: 0.2 if p == "far" else 0.01 for p in peer_ids}

    manager = Regional(ClientConfig(), servers, 4, policy=policy)
    manager.update()
    manager.on_cache_refusal("near_b")  # the region's only server of blocks 2..3
    assert manager.avoided_peers() == (set() if policy == "corolla" else {"near_b"})
    manager.on_cache_refusal("near_a")  # near_c still holds blocks 0..1 in the region
    assert "near_a" in manager.avoided_peers()
