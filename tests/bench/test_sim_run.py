"""A small end-to-end simulation through the real placement and routing functions: reproducible for a seed, tokens
served, and churn accounted for (every join, departure and move counted once, reload time charged per move)."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.sim import petals_policy
from benchmarks.sim.scenarios import SCENARIOS, scenario
from benchmarks.sim.simulation import Simulation
from corolla.protocol.records import ServerState
from corolla.swarm import cache_refusals
from corolla.swarm.corolla_policy import CorollaPolicy
from corolla.swarm.policy import MoveDecision


@pytest.fixture(scope="module")
def tiny_run() -> tuple[Simulation, dict]:
    """The tiny scenario under Petals' policy (the baseline; its chains are one hop, the swarm holds every block)."""
    sim = Simulation(scenario("tiny", seed=1, policy="petals"))
    report = sim.run()
    return sim, dataclasses.asdict(report)


@pytest.fixture(scope="module")
def corolla_tiny_run() -> tuple[Simulation, dict]:
    """The same under corolla's policy (the default), whose chains here have two hops."""
    sim = Simulation(scenario("tiny", seed=1))
    report = sim.run()
    return sim, dataclasses.asdict(report)


def test_a_tiny_swarm_serves_its_clients(tiny_run: tuple[Simulation, dict]) -> None:
    _, report = tiny_run
    assert report["decode_tps"] > 0 and report["sessions"]["completed"] > 10
    assert 0 < report["tpot_s"]["p50"] <= report["tpot_s"]["p99"] < 5.0
    assert 0 < report["ttft_s"]["p50"] <= report["ttft_s"]["p99"]
    assert report["sessions"]["failed_while_covered"] <= report["sessions"]["failed"]
    assert report["flow_efficiency"] and all(0 < s["efficiency"] <= 1.0 for s in report["flow_efficiency"])


def test_the_same_seed_gives_the_same_report(corolla_tiny_run: tuple[Simulation, dict]) -> None:
    _, first = corolla_tiny_run
    second = dataclasses.asdict(Simulation(scenario("tiny", seed=1)).run())
    third = dataclasses.asdict(Simulation(scenario("tiny", seed=2)).run())
    for report in (first, second, third):
        report.pop("wall_s")
        report.pop("cpu_s")
        report.pop("calls_wall_s")
    assert first == second
    assert first != third


@pytest.mark.parametrize("run", ["tiny_run", "corolla_tiny_run"])
def test_churn_accounting(run: str, request: pytest.FixtureRequest) -> None:
    sim, report = request.getfixturevalue(run)
    gone = [s for s in sim.servers if s.state is None]
    assert report["churn"]["leaves"] + report["churn"]["crashes"] == len(gone) > 0
    joined = [s for s in sim.servers if s.num_blocks > 0]
    assert report["churn"]["joins"] == len(joined)
    assert report["churn"]["moves"] == sum(s.num_moves for s in sim.servers)
    assert report["churn"]["reload_s"] >= report["churn"]["moves"] * 30.0
    for server in sim.servers:  # nothing is left reserved on a server no session uses
        assert server.rows >= 0 and all(tokens > 0 for tokens in server.kv_reserved.values())
        if not server.sessions:
            assert not server.kv_reserved
        if server.state is None:
            assert not sim.view.servers.get(server.peer_id)
    online = [s for s in sim.view.servers.values() if s.state == ServerState.ONLINE]
    decoding = [x for x in sim.clients.sessions.values() if x.phase == "decode"]
    assert decoding and sum(s.rows for s in online) == sum(len(x.route or ()) for x in decoding)  # a row per hop


def test_moves_are_charged_their_load_time() -> None:
    # balance_quality > 1 is Petals' debug mode: every check moves, so moves happen in a short run
    config = scenario("tiny", seed=3, duration_s=900.0, policy="petals")
    sim = Simulation(config)
    sim.policy = petals_policy.PetalsPolicy(balance_quality=1.5)
    report = sim.run()
    assert report.churn["moves"] > 0
    expected = sum(s.load_s(s.num_blocks) for s in sim.servers for _ in range(s.num_moves))
    assert report.churn["reload_s"] == pytest.approx(expected)
    assert report.sessions["retries"] >= 0


def test_the_real_policy_functions_are_called(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"place": 0, "route": 0}
    real_place, real_route = petals_policy.choose_best_span, petals_policy.make_min_latency_route

    def place(*args, **kwargs):
        calls["place"] += 1
        return real_place(*args, **kwargs)

    def route(*args, **kwargs):
        calls["route"] += 1
        return real_route(*args, **kwargs)

    monkeypatch.setattr(petals_policy, "choose_best_span", place)
    monkeypatch.setattr(petals_policy, "make_min_latency_route", route)
    report = Simulation(scenario("tiny", seed=1, duration_s=900.0, policy="petals")).run()
    assert calls["place"] == report.churn["joins"] > 0
    assert calls["route"] == report.churn["route_calls"] > 0


def test_clients_keep_several_conversations_from_their_region() -> None:
    config = scenario("tiny", seed=1, duration_s=700.0)
    workload = dataclasses.replace(config.workload, concurrent_clients=3, sessions_per_client=4)
    sim = Simulation(dataclasses.replace(config, workload=workload))
    sim.run()
    assert len(sim.client_regions) == 3
    slots = {session.slot for session in sim.clients.sessions.values()}
    assert slots <= set(range(12)) and len(slots) > 3
    for session in sim.clients.sessions.values():
        assert session.slot is not None
        assert session.conversation.region == sim.client_regions[session.slot // 4]
    assert set(sim.routed) <= {0, 1, 2} and sim.routed  # each client counts the sessions it routed


def test_corolla_servers_know_their_curve_and_petals_servers_do_not() -> None:
    for policy, has_curve in (("petals", False), ("corolla", True)):
        sim = Simulation(scenario("tiny", seed=1, duration_s=300.0, policy=policy))
        sim.run()
        server = sim.servers[0]
        assert bool(server.capacity.capacity_tps) is has_curve
        if has_curve:  # what it announces is its tokens/s at the span it holds
            assert server.capacity.throughput_for(server.num_blocks) == min(
                server.perf.capacity_tps(server.num_blocks, sim.typical_context), server.perf.network_tps
            )


def test_a_clients_sessions_share_its_bans_and_bans_never_uncover_a_block() -> None:
    config = scenario("tiny", seed=1, duration_s=700.0)
    workload = dataclasses.replace(config.workload, concurrent_clients=2, sessions_per_client=3)
    sim = Simulation(dataclasses.replace(config, workload=workload))
    sim.run()
    sessions = [s for s in sim.clients.sessions.values() if s.slot is not None]
    for a in sessions:
        for b in sessions:
            assert (a.banned is b.banned) == (a.slot // 3 == b.slot // 3)
    session = sessions[0]
    everyone = {peer: sim.loop.now_s + 60.0 for peer in sim.view.servers}
    session.banned.update(everyone)  # banning every server would leave every block without one: bans are ignored
    assert sim._route(session)
    session.banned.clear()


def test_a_departed_server_leaves_the_clients_view_and_a_full_swarm_turns_away(tiny_run) -> None:
    """As the real client: a call to a server that left (its view older than the departure) bans it until the view
    is re-read (no longer holding it), and a session that found the swarm full during its wait and then gives up
    was turned away, not failed, whatever its last attempt hit."""
    sim, _ = tiny_run
    session = next(s for s in sim.clients.sessions.values() if s.route is not None)
    server = session.route[0][0]
    before = sim.metrics.sessions_turned_away, sim.metrics.sessions_failed
    sim._depart(server, crash=False)  # the session's chain is gone; the clients' view still lists the server
    if session.event is not None:  # its retry, scheduled by the departure
        session.event.cancel()
    session.full = True  # an earlier attempt of this wait found the servers out of cache
    sim.clients.route_fn = lambda s: [(server.peer_id, 0, sim.config.model.num_blocks)]
    session.counted = True
    assert not sim.clients._reroute(session)
    assert session.banned[server.peer_id] >= sim.loop.now_s + sim.config.client_update_period_s
    sim.clients._close(session, completed=False)
    assert (sim.metrics.sessions_turned_away, sim.metrics.sessions_failed) == (before[0] + 1, before[1])


def test_corolla_peers_announce_cache_early_and_a_refused_client_rereads_and_reroutes_at_once(tiny_run) -> None:
    """The simulator runs corolla's lifecycle for corolla peers only: servers re-announce when their free cache moved
    much (`swarm.early_announce`, never sooner than its min interval), and a client refused for cache avoids that
    server for `AVOID_S`, re-reads the records (routing on them until the next periodic read) and retries at once;
    Petals' peers keep the heartbeat and the ban with back-off."""
    petals_sim, report = tiny_run
    assert report["churn"]["early_announcements"] == 0 and report["churn"]["rereads"] == 0
    # 64 clients: enough sessions to move a server's free cache by 10% (corolla's layout holds much KV)
    busy = dataclasses.replace(SCENARIOS["tiny"].workload, concurrent_clients=64)
    sim = Simulation(scenario("tiny", seed=1, policy="corolla", duration_s=900.0, workload=busy))
    sim.run()
    assert sim.metrics.early_announcements > 0
    session = sim.clients.start(sim.workload.conversation(sim.loop.now_s, None), slot=0)
    session.event.cancel()  # its prefill: it routes again instead, as if its chain were gone
    sim.clients._release(session)
    server = next(s for s in sim.view.servers.values() if s.state == ServerState.ONLINE and s.num_blocks)
    sim.clients.route_fn = lambda s: [(server.peer_id, server.start, server.end)] if s is session else []
    server.reserve(server.start, server.end, server.kv_capacity_tokens)  # full, while its record announces room
    rereads = sim.metrics.rereads
    assert not sim.clients._reroute(session)
    server.reserve(server.start, server.end, -server.kv_capacity_tokens)
    assert session.banned[server.peer_id] == pytest.approx(sim.loop.now_s + cache_refusals.AVOID_S)
    assert sim.metrics.rereads == rereads + 1  # its own read of the records as the servers last announced them
    assert sim._client_view(session) == (sim.view.routing_spans(), -1)
    sim.clients._backoff(session, lambda: None)
    assert session.event is not None and session.event.time_s == sim.loop.now_s  # at once
    assert petals_sim.clients.on_cache_refusal is None  # Petals' client: a ban for its timeout, then back-off


class MovesOnce(CorollaPolicy):
    """corolla's policy, but every server asks to move once its first check comes (to see the move's lifecycle)."""

    def choose_move(self, me, spans, total_blocks, **kwargs):  # type: ignore[no-untyped-def]
        mine = next(s for s in spans if s.peer_id == me.peer_id)
        if me.peer_id in MOVED:
            return MoveDecision(None, 1.0, 1.0, "stay")
        return MoveDecision(range(mine.start, mine.end), 1.0, 2.0, "test move")


MOVED: set[str] = set()


class AsksOnce(CorollaPolicy):
    """corolla's policy, but a server asks to move at its first check only: asked again, it stays."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: set[str] = set()

    def choose_move(self, me, spans, total_blocks, **kwargs):  # type: ignore[no-untyped-def]
        if me.peer_id in self.asked:
            return MoveDecision(None, 1.0, 1.0, "stay")
        self.asked.add(me.peer_id)
        mine = next(s for s in spans if s.peer_id == me.peer_id)
        return MoveDecision(range(mine.start, mine.end), 1.0, 2.0, "test move")


def test_a_move_no_longer_wanted_stops_its_fetch_at_the_next_check() -> None:
    """A corolla server's balance checks go on while it fetches a move's span: the first that finds the move no
    longer wanted drops it and stops the fetch, which is charged only the seconds it ran (before, every dropped move
    fetched its whole span first: a quarter of the scale scenario's fetching, decision 0281)."""
    sim = Simulation(scenario("tiny", seed=3, policy="corolla"))
    sim.policy = AsksOnce()
    whole_s: list[float] = []
    original = sim._check_during_fetch

    def check_during_fetch(server, fetched):  # type: ignore[no-untyped-def]
        whole_s.append(fetched.time_s - sim.loop.now_s)  # called once a fetch here: its first check drops it
        original(server, fetched)

    sim._check_during_fetch = check_during_fetch  # type: ignore[method-assign]
    report = sim.run()
    churn = report.churn
    assert churn["moves"] == 0 and churn["moves_dropped"] == len(whole_s) >= 3
    assert churn["fetch_dropped_s"] == pytest.approx(churn["fetch_s"])
    assert 0 < churn["fetch_s"] < 0.25 * sum(whole_s)  # stopped early: checks come every 30 s on average here


def test_a_corolla_server_serves_its_span_while_it_fetches_the_next() -> None:
    """corolla's server keeps serving (ONLINE, its old span) while it fetches the new span's weights, asks its policy
    again, and only then stops, loading from its disk copy: offline for `local_load_s`, not `load_s` (Petals' move,
    whose accounting `test_moves_are_charged_their_load_time` checks). On the old code the server went OFFLINE at once
    and reloaded for `load_s`."""
    sim = Simulation(scenario("tiny", seed=3, policy="corolla"))
    sim.policy = MovesOnce()
    seen: list[tuple[str, ServerState | None, int]] = []
    original = sim._fetched

    def fetched(server, moves, reason):  # type: ignore[no-untyped-def]
        if server.state is not None:  # not gone meanwhile: still announced and serving its old span
            announced = sim.view.servers[server.peer_id]
            seen.append((server.peer_id, announced.state, server.num_moves))
            # its record says where it moves, as the real server's does (`SwarmSeat.load_fields`)
            assert announced.info is not None and server.fetching is not None
            assert announced.info.moving_to == (server.fetching.start, server.fetching.stop)
        original(server, moves, reason)
        MOVED.add(server.peer_id)

    sim._fetched = fetched  # type: ignore[method-assign]
    MOVED.clear()
    report = sim.run()
    assert seen and all(state == ServerState.ONLINE and moves == 0 for _, state, moves in seen)
    moved = [s for s in sim.servers if s.num_moves]
    assert moved and report.churn["moves"] == len(moved) == sum(s.num_moves for s in sim.servers)
    assert report.churn["reload_s"] == pytest.approx(sum(s.local_load_s(s.num_blocks) for s in moved))
    assert report.churn["fetch_s"] >= sum(s.fetch_s(s.num_blocks) for s in moved) > report.churn["reload_s"]
    assert report.churn["move_reasons"] == {"test move": len(moved)}
    # servers fetching at each snapshot are in the report, as many as the simulator saw
    assert [f["fetching"] for f in report.flow_efficiency] == [f.fetching for f in sim.metrics.flow]
