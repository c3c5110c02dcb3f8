"""Decision 0211: the client's tables keyed by peer id stay within `peer_tables.PEERS_KEPT_MAX` peers however many
identities an attacker announces, and a flood of them pushes out each other and stale entries, never the entries that
keep a liar or a loris out (a ban in force, a witness's standing, a server measured answering on time)."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.sim.policies import make_policy
from corolla.client.config import ClientConfig
from corolla.client.routing import sequence_manager
from corolla.client.routing.bans import BanList
from corolla.client.routing.dispute_repeats import DISPUTE_AVOID_S
from corolla.client.routing.observed_steps import OBSERVED_TTL_S, ObservedSteps
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.transport.direct_transport import DirectOffers
from corolla.client.verification.witnesses import trusted
from corolla.protocol.direct_stream import DirectOffer
from corolla.protocol.records import RemoteModuleInfo, ServerInfo, ServerState
from corolla.swarm.ping import PingAggregator
from corolla.utils.peer_tables import PEERS_KEPT_MAX, forget_least, remember

FAKES = 100_000
FAKES_A_READ = 100  # each read of the records announces this many identities never seen before


class FloodedManager(RemoteSequenceManager):
    """Records of two honest servers and, at each read, `FAKES_A_READ` fresh made-up ones (all of them answer
    pings: the worst case, an attacker's cheap reachable identities)."""

    def __init__(self, clock: list[float]):
        config = ClientConfig(witness_standing_steps=8)
        super().__init__(config, ["m.0", "m.1"], start_updates=False, policy=make_policy("corolla"))
        self.bans = BanList(config.ban_timeout_s, config.ban_backoff_rate, clock=lambda: clock[0])
        self.batch: list[str] = []

    def fetch_module_infos(self) -> list[RemoteModuleInfo]:
        record = ServerInfo(state=ServerState.ONLINE, start_block=0, end_block=2, throughput=1.0)
        servers = {peer: record for peer in ["honest", "witness", *self.batch]}
        return [RemoteModuleInfo(uid, dict(servers)) for uid in self.block_uids]

    def measure_rtts_s(self, peer_ids):
        return {peer: 0.01 if peer in ("honest", "witness") else 0.05 for peer in peer_ids}


def test_a_hundred_thousand_announced_identities_grow_no_table_past_its_bound_and_push_out_no_protection(
    caplog: pytest.LogCaptureFixture,
):
    """100,000 identities announced 100 a read; each one pinged where the refresh pings it, fails a request (banned),
    answers a step on time and agrees once with another server (every table it can reach). The honest server answers
    a step on time every read and was measured first; the witness earned its standing; the liar was caught. On main
    the RTT, ban, on-time and agreement tables held all they met (20,000 identities: 13,971 / 20,000 / 20,001 /
    20,000 entries, and the flood took 85 s: each failure copied the RTT table)."""
    caplog.set_level(logging.WARNING, logger="corolla.client.routing.sequence_manager")  # (a line a ban)
    clock = [0.0]
    manager = FloodedManager(clock)
    manager.update()
    assert manager.client_rtts_s.keys() >= {"honest", "witness"}
    for _ in range(8):
        manager.bans.record_verified("witness", agreed=True)
    manager.bans.ban_liar("liar")
    for _ in range(3):  # a server failing again after each ban: its third lasts 60 s, past the whole flood's
        manager.on_request_failure("loris")
        clock[0] += manager.bans.base_timeout_s * 2 + 0.1
    for start in range(0, FAKES, FAKES_A_READ):
        manager.batch = [f"fake{i}" for i in range(start, start + FAKES_A_READ)]
        manager.update()
        manager.note_on_time("honest")  # a session of this client steps on it
        for fake in manager.batch:
            manager.on_request_failure(fake)
            manager.note_on_time(fake)
            manager.bans.record_verified(fake, agreed=True)
        clock[0] += 0.001  # the flood's 100,000 failures within 1 s: every one of their bans in force
    tables = {
        "rtts": len(manager.client_rtts_s),
        "bans": len(manager.bans.banned_peers()),
        "on_time": len(manager.answered_on_time()),
        "agreed": sum(manager.bans.agreed_in_a_row(f"fake{i}") > 0 for i in range(FAKES)),
    }
    assert max(tables.values()) <= PEERS_KEPT_MAX, tables
    assert tables["rtts"] > 1000 and tables["on_time"] > 1000  # the bound, not a reset, keeps them there
    # what protects the client stays
    assert manager.bans.is_liar("liar") and manager.bans.is_banned("liar")
    assert trusted(manager, "witness")
    assert "honest" in manager.answered_on_time() and manager.client_rtts_s["honest"] == 0.01
    assert manager.bans.is_banned("loris")  # ends last of all the bans


def test_a_ban_in_force_outlasts_a_flood_of_bans_that_end_before_it():
    clock = [0.0]
    bans = BanList(15.0, 2.0, clock=lambda: clock[0])
    for _ in range(5):  # a server that keeps failing: banned 15 x 2^4 = 240 s
        bans.ban("flapping")
        clock[0] += bans.base_timeout_s * 2**4
    bans.ban("flapping")
    for i in range(3 * PEERS_KEPT_MAX):
        bans.ban(f"fake{i}")
    assert bans.is_banned("flapping")
    assert len(bans.banned_peers()) <= PEERS_KEPT_MAX


def test_a_repeat_failers_back_off_count_outlasts_a_flood_of_first_bans_in_force():
    """The ban table dropped ended bans first (0211: worth the ban's end), so fresh identities failing once each
    erased the count of a server failing again after each of its bans (hrev15's finding 4 in 0231): its next ban
    was the first's 15 s, not 15 x 2^4 = 240 s. A record is worth its count now; the flood's, one each, go first."""
    clock = [0.0]
    bans = BanList(15.0, 2.0, clock=lambda: clock[0])
    for _ in range(4):  # banned 15, 30, 60, 120 s; each ban over before its next failure
        bans.ban("flapping")
        clock[0] += bans.base_timeout_s * 2**4
    assert not bans.is_banned("flapping")
    for i in range(3 * PEERS_KEPT_MAX):
        bans.ban(f"fake{i}")
    assert bans.ban("flapping") == 15.0 * 2**4
    assert len(bans.banned_peers()) <= PEERS_KEPT_MAX


def test_a_flood_of_identities_measured_slower_does_not_push_out_a_server_measured_fast():
    """`ObservedSteps` dropped its oldest observation first: identities this client measured after an honest server
    (each delivering a judgment's decode steps) pushed it out, and with it out of 0214's first round of a move's race
    (`race_candidates`' measured first), where a fresh identity answering the trial at once wins (hrev15's finding 3
    in 0231). The slowest observation goes first now, those past `OBSERVED_TTL_S` before any."""
    table = ObservedSteps()
    table.note("stale", 0.001, 0.0)  # the fastest, but past its time by the flood's end
    table.note("honest", 0.01, OBSERVED_TTL_S / 2)
    table.note_long("honest", 0.002, OBSERVED_TTL_S / 2)
    now = OBSERVED_TTL_S + 1.0
    for i in range(3 * PEERS_KEPT_MAX):
        table.note(f"fake{i}", 0.05, now)  # measured, and slower
        table.note_long(f"fake{i}", 0.02, now)
    assert table.block_s("honest", now) == 0.01 and table.token_block_s("honest", now) == 0.002
    assert table.block_s("stale", 0.0) is None  # went first (at `now` it counts for nothing anyway)
    kept = sum(table.block_s(f"fake{i}", now) is not None for i in range(3 * PEERS_KEPT_MAX))
    assert 0 < kept < PEERS_KEPT_MAX


def test_standing_is_not_kept_for_a_disagreement_and_the_shortest_records_go_first():
    bans = BanList(15.0)
    bans.record_verified("w", agreed=True)
    bans.record_verified("w", agreed=False)
    assert bans.agreed_in_a_row("w") == 0
    for _ in range(3):
        bans.record_verified("long", agreed=True)
    for i in range(2 * PEERS_KEPT_MAX):
        bans.record_verified(f"fake{i}", agreed=True)
    assert bans.agreed_in_a_row("long") == 3
    assert sum(bans.agreed_in_a_row(f"fake{i}") for i in range(2 * PEERS_KEPT_MAX)) <= PEERS_KEPT_MAX


def test_the_rtts_keep_the_peers_that_answered_over_those_that_did_not():
    pings = PingAggregator(expiration_s=math.inf)
    pings.update("near", 0.01, now=0.0)
    for i in range(2 * PEERS_KEPT_MAX):
        pings.update(f"silent{i}", math.inf, now=1.0)
    rtts = pings.to_dict(now=2.0)
    assert rtts["near"] == 0.01 and len(rtts) <= PEERS_KEPT_MAX
    assert pings.measured("near", now=2.0) and not pings.measured("nobody", now=2.0)


def test_direct_offers_of_a_flood_of_servers_without_one_stay_bounded():
    async def no_offer(peer_id: str) -> DirectOffer:
        raise ConnectionError("no direct port")

    offers = DirectOffers(no_offer)

    async def flood() -> None:
        for i in range(2 * PEERS_KEPT_MAX):
            assert await offers.get(f"fake{i}") is None

    asyncio.run(flood())
    assert len(offers._none_until) <= PEERS_KEPT_MAX  # (the table itself: nothing public counts it)


def test_remember_keeps_the_latest_or_the_worthiest():
    table: dict[str, int] = {}
    for i in range(5):
        remember(table, f"p{i}", i, max_peers=3)
    assert list(table) == ["p2", "p3", "p4"]  # the oldest went first
    remember(table, "p2", 2, max_peers=3)
    assert list(table) == ["p3", "p4", "p2"]  # stored again: the latest
    worthy = {f"p{i}": i for i in range(16)}
    forget_least(worthy, 8, lambda peer, value: -value)  # the largest values worth least here
    assert sorted(worthy.values()) == list(range(7))  # down to 7/8 of 8


class _LockWatched:
    """The manager's lock, telling `reached` when thread `by` reaches for it (before it waits for it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reached = threading.Event()
        self.by: threading.Thread | None = None

    def __enter__(self) -> bool:
        if threading.current_thread() is self.by:
            self.reached.set()
        return self._lock.__enter__()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.__exit__(*exc_info)


class _TrimPaused(dict):
    """The on-time table, whose trim (`peer_tables.forget_least`, in thread `trimmer`) chooses its oldest entry, says
    so (`chosen`) and waits for `go` before dropping it: another thread's call then runs between the two."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.trimmer: threading.Thread | None = None
        self.chosen = threading.Event()
        self.go = threading.Event()

    def __iter__(self) -> Iterator[str]:
        if threading.current_thread() is not self.trimmer or self.chosen.is_set():
            return super().__iter__()
        oldest = next(super().__iter__())
        self.chosen.set()
        assert self.go.wait(30), "the failure never reached the manager's lock"
        return iter([oldest])


def test_a_failure_of_the_oldest_server_seen_on_time_while_the_table_is_trimmed_breaks_neither_call():
    """`on_request_failure` forgot its server's on-time mark outside the manager's lock while `note_on_time` trims the
    same table under it (hrev15's finding 1 in 0231): the failure of the server the trim chose ran between the choice
    and the drop, and the trim raised KeyError out of `note_on_time` (a session's step). Ordered by events: the trim
    waits, after choosing, until the failure reaches for the lock (on main it had forgotten the mark by then)."""
    manager = FloodedManager([0.0])
    lock, table = _LockWatched(), _TrimPaused((f"p{i}", None) for i in range(PEERS_KEPT_MAX))
    manager._lock, manager._on_time = lock, table  # type: ignore[assignment]  # (the seams of this race)
    lock.reached = table.go
    errors: list[BaseException] = []

    def run(call: Callable[[], None]) -> None:
        try:
            call()
        except BaseException as e:  # the test's verdict, not a crash of the thread
            errors.append(e)

    trimmer = threading.Thread(target=run, args=(lambda: manager.note_on_time("new"),))
    failer = threading.Thread(target=run, args=(lambda: manager.on_request_failure("p0"),))
    table.trimmer, lock.by = trimmer, failer
    trimmer.start()
    assert table.chosen.wait(30)
    failer.start()
    for thread in (trimmer, failer):
        thread.join(30)
        assert not thread.is_alive()
    assert errors == []
    on_time = manager.answered_on_time()
    assert "new" in on_time and "p0" not in on_time and len(on_time) <= PEERS_KEPT_MAX


class _TwoServers(RemoteSequenceManager):
    """Records of `honest` (measured at 10 ms) and the attacker's identity `proven` (20 ms), each holding both blocks;
    the routing's clock is `clock[0]`."""

    def __init__(self) -> None:
        super().__init__(ClientConfig(), ["m.0", "m.1"], start_updates=False, policy=make_policy("corolla"))

    def fetch_module_infos(self) -> list[RemoteModuleInfo]:
        record = ServerInfo(state=ServerState.ONLINE, start_block=0, end_block=2, throughput=1.0)
        return [RemoteModuleInfo(uid, {"honest": record, "proven": record}) for uid in self.block_uids]

    def measure_rtts_s(self, peer_ids):
        return {peer: 0.01 if peer == "honest" else 0.02 for peer in peer_ids}


def test_an_avoidance_that_says_nothing_of_a_servers_pace_keeps_its_on_time_mark(monkeypatch: pytest.MonkeyPatch):
    """`avoid` forgot the server's on-time mark whatever the avoidance was for (hrev15's finding 2 in 0231). Two free
    identities outvoting an honest server get it avoided (`witnesses`, short of standing: `DISPUTE_AVOID_S`); once
    back, while a caught loris has the routes leave out servers never seen on time (0163, 60 s each), it was left
    out in favour of the attacker's identity seen on time, and its RTT lost the protection of the mark (0211). An
    avoidance for its pace (`slow`: late past the budget, or outpaced) still forgets the mark."""
    clock = [100.0]
    monkeypatch.setattr(sequence_manager, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    manager = _TwoServers()
    manager.update()
    manager.note_on_time("honest")
    manager.note_on_time("proven")
    assert manager.avoid("honest", DISPUTE_AVOID_S)  # framed: outvoted by two fresh identities
    assert manager.answered_on_time() == {"honest", "proven"}
    clock[0] += DISPUTE_AVOID_S + 1
    manager.update()
    manager.suspect_unproven(60.0)  # a loris of the attacker's caught meanwhile
    manager.rng = random.Random(0)  # (the policy draws among near routes)
    routed = {span.peer_id for _ in range(8) for span in manager.make_sequence(mode="min_latency")}
    assert "honest" in routed  # on main never: only the attacker's identity was seen on time since
    assert manager.avoid("honest", 60.0, slow=True)
    assert manager.answered_on_time() == {"proven"}
