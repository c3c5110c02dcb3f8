"""A server that loses dispute after dispute is avoided longer each time (decision 0225), and escalation costs its
accusers as much: fresh identities cannot escalate, and witnesses refuted by an outside server lose the dispute
themselves. In process fakes (`tests/helpers/fake_chain`), a fresh client, a simulated hour on a controlled clock
(the routing's `time`, the disputes' clock): a new session each simulated minute, the records re-read before it."""

from __future__ import annotations

import random
import time

import pytest
import torch
from hivemind.proto import runtime_pb2
from tests.unit.test_client_distrust import Framer, FramersFirst, Server

from corolla.client.routing import sequence_manager
from corolla.client.routing.dispute_repeats import (
    DISPUTE_AVOID_MAX_S,
    DISPUTE_AVOID_S,
    REPEATS_FORGIVEN_STEPS,
    DisputeRepeats,
    avoid_s,
)
from corolla.client.routing.disputes import Disputes
from corolla.client.verification.witnesses import UNCHECKED, outvote
from corolla.protocol.codecs import deserialize_tensor, serialize_tensor
from corolla.utils.peer_tables import PEERS_KEPT_MAX
from helpers.fake_chain import HIDDEN, FakeManager
from helpers.framed_session import framed_client, run_framed

HOUR_S = 3600.0
SESSION_EVERY_S = 60.0


class Clock:
    """The routing module's `time`, `offset_s` ahead of the real one (no real 300 s waits)."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset_s

    def __getattr__(self, name: str):
        return getattr(time, name)


class Hour:
    """A fresh client's hour: one 5-token session a simulated minute; records each avoidance (peer, from, until) on
    the hour's clock and each wrong step detected (a verified step outvoted)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, manager: FakeManager, clock: Clock):
        self.manager, self.clock = manager, clock
        self.avoided: list[tuple[str, float, float]] = []
        self.detections = 0
        self.sessions_on: list[str] = []  # the first span's server of each session, as it ended
        avoid = manager.avoid

        def recorded(peer_id: str, duration_s: float, **kwargs) -> bool:
            took = avoid(peer_id, duration_s, **kwargs)
            if took:
                self.avoided.append((peer_id, clock.offset_s, clock.offset_s + duration_s))
            return took

        monkeypatch.setattr(manager, "avoid", recorded)

    def run(self, rng_framers_first: bool = False, each_minute=None) -> None:
        torch.manual_seed(0)
        tokens = torch.randn(1, 5, HIDDEN)
        minute = 0
        while self.clock.offset_s < HOUR_S:
            if each_minute is not None:
                each_minute(minute)
            self.manager.update()  # the refresh: servers whose avoidance ended are back in the view
            framed = run_framed(self.manager, tokens, FramersFirst() if rng_framers_first else None)
            self.detections += framed.num_rejected
            self.sessions_on.append(framed.route[0])
            self.clock.offset_s += SESSION_EVERY_S
            minute += 1

    def avoided_s(self, peers: set[str]) -> float:
        """Seconds of the hour each of `peers` spent avoided, summed (overlapping avoidances of one peer counted once)."""
        total = 0.0
        for peer in peers:
            spans = sorted((start, min(end, HOUR_S)) for p, start, end in self.avoided if p == peer)
            covered_until = 0.0
            for start, end in spans:
                start = max(start, covered_until)
                if end > start:
                    total += end - start
                    covered_until = end
        return total


def _fresh_client(monkeypatch: pytest.MonkeyPatch, servers: dict) -> tuple[FakeManager, Clock]:
    clock = Clock()
    monkeypatch.setattr(sequence_manager, "time", clock)
    manager = framed_client(servers)
    manager.disputes = Disputes(clock.monotonic)
    return manager, clock


def test_a_liar_in_a_span_of_three_is_kept_out_longer_each_time(monkeypatch):
    """L lies on every step (finite garbage), announces the best figures; H1 and H2 (honest) are the only other
    servers of its blocks and fresh (no standing: no ban, 0190's Left b), so each verified step of L is outvoted by
    them and L avoided; nobody outside the three rechecks. Main: L avoided 300 s, back as the witnesses' 300 s watch
    ends (their agreement with each other earns no standing meanwhile), lies again: a wrong step detected (replayed,
    the session moved) every 5 minutes, 12 in the hour, never banned. Now 300 s, then 600 s: the watch ends while L
    is out, H1 and H2 earn standing verifying each other, and L's third lie bans it for good: 3 detections."""
    servers = {
        "L": Server(0, 2, "garbage", inference_rps=1e6),
        "H1": Server(0, 2),
        "H2": Server(0, 2),
        "B": Server(2, 4),
        "B2": Server(2, 4),
    }
    manager, clock = _fresh_client(monkeypatch, servers)
    hour = Hour(monkeypatch, manager, clock)
    hour.run()
    assert [(start, end) for peer, start, end in hour.avoided if peer == "L"] == [(0.0, 300.0), (300.0, 900.0)]
    assert hour.detections == 3 and manager.bans.is_liar("L")
    assert hour.sessions_on.count("L") == 0  # each session it was routed to replayed its step elsewhere
    assert not hour.avoided_s({"H1", "H2"}) and not manager.bans.banned_peers() & {"H1", "H2"}


def test_the_same_identities_framing_an_honest_server_pay_at_least_what_it_pays(monkeypatch):
    """S1 and S2, one attacker's fresh identities, referee H (honest, routed first) with the same made-up outputs
    each time they are drawn (first, the draw the attack hopes for); H2 is an honest server of the same blocks.
    Main: H avoided 300 s at each return, the whole hour, S1 and S2 never. Now a second framing by the same
    witnesses would escalate, so it is rechecked first: H2 refutes them, they lose the dispute (avoided for their own
    count: 300, 600, 1,200 s ... and their accusations forgotten), H is avoided 300 s as a tie and its disputes lost
    forgotten. In the hour: main H 3,600 s, S1 and S2 1,200 s each (0208's recheck refuted them each time they had
    earned standing again); now H 2,400 s, S1 and S2 2,400 s each, H no more than either."""
    servers = {
        "H": Server(0, 2, inference_rps=1e6),
        "S1": Framer(0, 2, inference_rps=1e4),
        "S2": Framer(0, 2, inference_rps=1e4),
        "H2": Server(0, 2),
        "H3": Server(0, 2, inference_rps=50.0),
        "B": Server(2, 4),
        "B2": Server(2, 4),
    }
    manager, clock = _fresh_client(monkeypatch, servers)
    hour = Hour(monkeypatch, manager, clock)
    hour.run(rng_framers_first=True)
    h_s, s1_s, s2_s = hour.avoided_s({"H"}), hour.avoided_s({"S1"}), hour.avoided_s({"S2"})
    assert all(end - start == DISPUTE_AVOID_S for peer, start, end in hour.avoided if peer == "H"), hour.avoided
    assert h_s <= min(s1_s, s2_s), (h_s, s1_s, s2_s)
    assert [end - start for peer, start, end in hour.avoided if peer == "S1"][:3] == [300.0, 600.0, 1200.0]
    assert (h_s, s1_s, s2_s) == (2400.0, 2400.0, 2400.0)
    assert not manager.bans.is_liar("H") and manager.repeats.lost("H") <= 1


def test_fresh_identities_framing_an_honest_server_cannot_escalate(monkeypatch):
    """Each framing by a new pair of fresh identities (S<i>a, S<i>b; the last pair gone) as H comes back, every 5
    minutes: H is avoided 300 s each time, as on main (doubling on H's count alone would have kept it out 300, 600,
    1,200 s ... and counted its later framings against it for a day)."""
    servers: dict = {
        "H": Server(0, 2, inference_rps=1e6),
        "H2": Server(0, 2),
        "H3": Server(0, 2, inference_rps=50.0),
        "B": Server(2, 4),
        "B2": Server(2, 4),
    }
    manager, clock = _fresh_client(monkeypatch, servers)

    def new_pair(minute: int) -> None:
        if minute % 5 == 0:  # (H is back every 5 minutes)
            for name in [name for name in servers if name.startswith("S")]:
                del servers[name]
            for side in "ab":
                servers[f"S{minute}{side}"] = Framer(0, 2, inference_rps=1e4)

    hour = Hour(monkeypatch, manager, clock)
    hour.run(rng_framers_first=True, each_minute=new_pair)
    framings = [(start, end) for peer, start, end in hour.avoided if peer == "H"]
    assert len(framings) == 12 and all(end - start == DISPUTE_AVOID_S for start, end in framings), hour.avoided
    assert hour.avoided_s({"H"}) == 12 * DISPUTE_AVOID_S
    assert manager.repeats.lost("H") == 12 and not manager.bans.is_liar("H")


def test_avoidances_double_to_a_day_and_a_long_honest_record_forgives():
    repeats = DisputeRepeats()
    assert [avoid_s(level) for level in range(4)] == [300.0, 600.0, 1200.0, 2400.0]
    assert avoid_s(9) == DISPUTE_AVOID_MAX_S and avoid_s(1000) == DISPUTE_AVOID_MAX_S
    durations = [repeats.outvoted("L", ["W1", "W2"], escalate=True) for _ in range(3)]
    assert durations == [300.0, 600.0, 1200.0]
    assert repeats.outvoted("L", ["W1", "W2"], escalate=False) == DISPUTE_AVOID_S  # a split: counted, not doubled
    assert repeats.level("L", ["W1", "fresh"]) == 0  # a fresh witness escalates nothing
    assert repeats.refuted("W1") == DISPUTE_AVOID_S and repeats.refuted("W1") == 600.0
    assert repeats.accusations("W1") == 0 and repeats.level("L", ["W1", "W2"]) == 0
    repeats.forgive("L")
    assert repeats.lost("L") == 0


def test_a_long_honest_record_clears_a_servers_disputes(monkeypatch):
    """`witnesses.outvote` forgives the accused's earlier disputes where it has `REPEATS_FORGIVEN_STEPS` verified
    outputs in a row agreeing with another server since (and counts the new one)."""
    servers = {"A": Server(0, 2), "W1": Server(0, 2), "W2": Server(0, 2), "W3": Server(0, 2), "B": Server(2, 4)}
    manager, clock = _fresh_client(monkeypatch, servers)
    for _ in range(3):
        outvote(manager, "A", ["W1", "W2"], "test", rechecked=UNCHECKED)
    assert manager.repeats.lost("A") == 3
    for _ in range(REPEATS_FORGIVEN_STEPS):
        manager.bans.record_verified("A", agreed=True)
    assert manager.repeats.level("A", ["W1", "W2"]) == 3
    outvote(manager, "A", ["W1", "W2"], "test", rechecked=UNCHECKED)
    assert manager.repeats.lost("A") == 1  # forgiven, then this dispute counted


def test_repeat_counts_outlast_a_flood_of_fresh_disputes():
    """Decision 0211's bound: 10,000 fresh identities each losing one dispute push out each other, not a repeat
    offender's record (nor its witnesses' accusations)."""
    repeats = DisputeRepeats()
    for _ in range(3):
        repeats.outvoted("L", ["W1", "W2"], escalate=True)
    for i in range(10_000):
        repeats.outvoted(f"fresh{i}", [f"fa{i}", f"fb{i}"], escalate=True)
    assert repeats.lost("L") == 3 and repeats.level("L", ["W1", "W2"]) == 3
    assert sum(repeats.lost(f"fresh{i}") for i in range(10_000)) <= PEERS_KEPT_MAX


class Smear(Server):
    """An attacker's identity that serves honestly and, as a referee (`rpc_forward`), answers made-up outputs while
    `lying` (set by the draw below: when it referees H1)."""

    lying = False

    async def rpc_forward(self, request, timeout=None):
        honest = await super().rpc_forward(request, timeout)
        if not self.lying:
            return honest
        return runtime_pb2.ExpertResponse(
            tensors=[serialize_tensor(torch.randn(deserialize_tensor(honest.tensors[0]).shape))]
        )


class SmearH1(random.Random):
    """The draw the attack hopes for, and the smear's cue: H1 and H2 referee L's steps; R referees H1's (a list
    without H1 but with its co-witness H2: H1 is verified), lying then; nobody else's."""

    def __init__(self, smear: Smear):
        super().__init__(0)
        self.smear = smear

    def shuffle(self, x: list) -> None:  # type: ignore[override]
        names = {span.peer_id for span in x}
        self.smear.lying = "H1" not in names and "H2" in names
        x.sort(key=lambda span: ["H1", "H2", "R"].index(span.peer_id) if span.peer_id in ("H1", "H2", "R") else 9)
        if self.smear.lying:
            x.sort(key=lambda span: span.peer_id != "R")


def test_one_fresh_referee_against_a_watched_servers_co_witness_escalates_nothing(monkeypatch):
    """Decision 0228, against 0225. L (a liar, the best figures) is outvoted by H1 and H2 (honest, fresh): L avoided,
    H1 and H2 watched. The session moves to H1; its step is verified by R (the attacker's fresh identity, the only
    referee outside the dispute) with made-up outputs and by H2, its co-witness, which agrees: one word each (0190),
    H1's output not used. 0225 counted that as a dispute H1 lost (`refuted`: its accusations forgotten, avoided for
    its own count): at L's next lie, 5 minutes on, L was avoided 300 s again (H1's accusations gone: level 0) and
    H1 600 s, then 1,200 s ...: the liar and one fresh identity kept an honest server out longer each time, with
    nothing rechecked, and the liar at 300 s. Now one referee's word against a co-witness's is no dispute lost: H1
    avoided 300 s each time, its accusations kept, and L's second lie escalates (600 s, rechecked first)."""
    smear = Smear(0, 2, inference_rps=1e2)
    servers = {
        "L": Server(0, 2, "garbage", inference_rps=1e6),
        "H1": Server(0, 2, inference_rps=1e4),
        "H2": Server(0, 2, inference_rps=1e3),
        "R": smear,
        "B": Server(2, 4),
        "B2": Server(2, 4),
    }
    manager, clock = _fresh_client(monkeypatch, servers)
    hour = Hour(monkeypatch, manager, clock)
    torch.manual_seed(0)
    tokens = torch.randn(1, 5, HIDDEN)
    for _ in range(2):  # L's first lie, and its next as it comes back
        manager.update()
        run_framed(manager, tokens, SmearH1(smear))
        clock.offset_s += DISPUTE_AVOID_S + 1
    avoided = {peer: [end - start for p, start, end in hour.avoided if p == peer] for peer in ("L", "H1", "H2")}
    assert avoided["H1"] == [DISPUTE_AVOID_S, DISPUTE_AVOID_S], avoided  # main: [300.0, 600.0]
    # and the liar escalates again (rechecked by R, honest there): main kept it at 300 s, H1's accusation forgotten
    assert avoided["L"] == [DISPUTE_AVOID_S, 2 * DISPUTE_AVOID_S], avoided
    assert not avoided["H2"] and not manager.bans.banned_peers() & {"H1", "H2"}
