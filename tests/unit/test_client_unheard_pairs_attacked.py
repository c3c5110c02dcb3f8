"""Review 0256 of decision 0253 (an unheard race pair's referees asked again after the race), as an attacker with free
identities and one lie would: each test judges a race's lost pairs as `InferenceSession._judge_lost_pairs` does after
a race (their referees silent at the seating: "unheard"), then lets the later asks answer as the attacker arranges.
The races themselves: `test_client_slow_servers.py` (`-k "heard_later or bounded_number or shuts_down"`)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Awaitable, Callable

import pytest

from corolla.client import background_loop
from corolla.client.routing.dispute_repeats import avoid_s
from corolla.client.session import unheard_pairs
from corolla.client.session.inference_session import InferenceSession
from corolla.client.session.unheard_pairs import RETRIES_MAX, retries_of
from corolla.client.verification.witnesses import UNCHECKED, Rechecked
from helpers.fake_chain import FakeManager, FakeServer, vouch

Ask = Callable[[], Awaitable[Rechecked]]


@pytest.fixture(autouse=True)
def one_ask_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(unheard_pairs, "RETRY_WAITS_S", (0.0,))


def _manager(*names: str) -> FakeManager:
    return FakeManager({name: FakeServer(0, 4) for name in (*names, "L", "W")}, 4)


def _judge(manager: FakeManager, pairs: list[tuple[tuple[str, str], Ask]]) -> InferenceSession:
    """One race's lost `pairs` (each with the ask of its referees later) judged as after a race that W won against
    L's outputs, every pair's referees silent at the seating; returns the session (its race events)."""
    session = InferenceSession(manager, max_length=8)

    async def judge() -> None:
        lost = []
        for pair, ask in pairs:
            referees: asyncio.Future[Rechecked] = asyncio.get_running_loop().create_future()
            referees.set_result(UNCHECKED)
            lost.append((list(pair), referees, ask))
        await session._judge_lost_pairs((0, 2), "L", "W", lost)

    background_loop.run(judge(), timeout_s=10)
    return session


def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    waited = time.monotonic()
    while not condition() and time.monotonic() - waited < timeout_s:
        time.sleep(0.02)
    return condition()


def _rejudged(session: InferenceSession) -> list[str | None]:
    return [event.verdict for event in session.race_events if event.action == "rejudged"]


async def _silent_for_good() -> Rechecked:
    await asyncio.Event().wait()  # (never set: the attacker's span has no honest outsider, its referees never answer)
    return UNCHECKED


async def _silent() -> Rechecked:
    return UNCHECKED


def _confirming_once(confirm: threading.Event) -> Callable[[], Awaitable[Rechecked]]:
    """A pair's recheck that an outside referee (S3) confirms once `confirm` is set."""

    async def confirming_later() -> Rechecked:
        while not confirm.is_set():
            await asyncio.sleep(0.01)
        return Rechecked("confirmed", (("S3",),))

    return confirming_later


def test_seven_identities_with_standing_do_not_hold_every_retry_slot():
    """0253 says a retry slot costs the attacker a standing spent (lent) or held (two of its own). The jobs were one
    per pair, and 7 identities with standing (S0..S6, on blocks no honest server holds: their referees are theirs,
    silent for good) make 21 pairs of two standings: each race one of them loses unheard spends nothing (0248) and
    holds a slot for the retries' minutes: 16 slots held by 7 standings. H1's honest pair (its standing lent to a
    fresh H2), judged unheard next (0249 (a): the attacker kept its honest outsiders busy for the round), was then
    refused its retry (0248's verdict alone: H1's standing spent, watched). Now every job needs a peer of standing
    that holds no other job: 7 identities hold 7 slots at most, the honest pair is asked again."""
    attackers = [f"S{i}" for i in range(7)]
    manager = _manager(*attackers, "H1", "H2")
    vouch(manager, *attackers, "H1")
    for pair in itertools.combinations(attackers, 2):  # one race each
        _judge(manager, [(pair, _silent_for_good)])
    retries = retries_of(manager)
    held = retries.running
    try:
        _judge(manager, [(("H1", "H2"), _silent_for_good)])
        assert held <= len(attackers) < RETRIES_MAX, held
        assert retries.running == held + 1, (held, retries.running)
        assert manager.bans.agreed_in_a_row("H1") == 0  # (spent, held aside until a referee is heard)
    finally:
        manager.shutdown()
    assert retries.running == 0


def test_an_honest_peer_made_to_hold_the_attackers_job_keeps_a_slot_for_its_own():
    """The attacker's La (standing) pairs with H1 (honest, standing) in a race, La computing honestly for the trial
    (two standings, unheard: the honest outsiders kept busy for the round), and keeps the pair's referees silent:
    the job is held by H1 (the pair's first peer); La holds another job of its own with Lb. H1, in a lent pair with a
    fresh H2 next (its standing spent), then had no peer free to hold its job, refused (0248's drain) on 73a9d871's
    first-free holder. Now the running jobs' holders move among their own pairs (La's job to Lb, H1's first job to
    La): H1's own pair is asked again, and the attacker's 2 identities hold 2 slots."""
    manager = _manager("H1", "H2", "La", "Lb")
    vouch(manager, "H1", "La", "Lb")
    _judge(manager, [(("La", "Lb"), _silent_for_good)])
    _judge(manager, [(("H1", "La"), _silent_for_good)])
    retries = retries_of(manager)
    try:
        assert retries.running == 2
        _judge(manager, [(("H1", "H2"), _silent_for_good)])
        assert retries.running == 3
        _judge(manager, [(("Lb", "H1"), _silent_for_good)])  # (a third job on 2 identities: no slot)
        assert retries.running == 3
    finally:
        manager.shutdown()


def test_a_peer_in_several_pairs_of_one_race_is_refuted_once_when_asked_again():
    """0238 refutes a peer once per race however many of its pairs lost (`_judge_lost_pairs`'s `refuted_peers`).
    One racer agreeing with several others is in several pairs of one race (each later racer pairs with the first
    earlier dissenter it agrees with): H1 (honest, standing) with La, Lb, Lc (the attacker's, standing, computing
    honestly for the trial), all unheard (the honest outsiders kept busy for the round). Asked again, the attacker's
    referees answer against the pairs while the honest ones are kept busy: each pair's job refuted H1 again, 3
    refutations from one race (avoided `avoid_s(2)`, 4x the first's, k pairs: 2^(k-1)x). Now once per race, as at the
    seating; each of La, Lb, Lc once."""
    manager = _manager("H1", "La", "Lb", "Lc")
    vouch(manager, "H1", "La", "Lb", "Lc")

    async def refuting() -> Rechecked:
        return Rechecked("refuted", (), 1)

    session = _judge(manager, [(("H1", peer), refuting) for peer in ("La", "Lb", "Lc")])
    assert _until(lambda: retries_of(manager).running == 0 and len(_rejudged(session)) == 3), session.race_events
    assert manager.repeats.lost("H1") == 1, manager.repeats.lost("H1")
    assert [manager.repeats.lost(peer) for peer in ("La", "Lb", "Lc")] == [1, 1, 1]
    assert manager.repeats.refuted("H1") == avoid_s(1)  # (its next loss: the second)
    manager.shutdown()


def test_a_split_gives_back_what_its_own_race_spent_not_another_races():
    """The held-aside standing was one sum per peer: a split of one race gave back what every race's "unheard" had
    spent. S1 (the attacker's, standing) lends it to fresh F1 in race A, unheard (spent, held aside, asked again);
    S1 earns its standing again (8 verified steps) and lends it to fresh F2 in race B on a span without an honest
    outsider: unheard for good, 0248's price for the liar pair's free retry of the frame (the standing spent). Race
    A's asks then hear S1's third identity confirm the pair ("split"): it gave back 16, race B's 8 too, so race B's
    pair lost its round for free. Now each verdict gives back its own spend: 8."""
    manager = _manager("S1", "F1", "F2")
    steps = manager.config.witness_standing_steps
    vouch(manager, "S1")
    confirm = threading.Event()
    confirming_later = _confirming_once(confirm)

    race_a = _judge(manager, [(("S1", "F1"), confirming_later)])
    assert manager.bans.agreed_in_a_row("S1") == 0
    vouch(manager, "S1")
    race_b = _judge(manager, [(("S1", "F2"), _silent)])
    assert _until(lambda: _rejudged(race_b) in ([], ["unheard"]) and retries_of(manager).running == 1)
    assert manager.bans.agreed_in_a_row("S1") == 0
    confirm.set()
    assert _until(lambda: _rejudged(race_a) == ["split"]), race_a.race_events
    assert manager.bans.agreed_in_a_row("S1") == steps, manager.bans.agreed_in_a_row("S1")
    manager.shutdown()


def test_a_split_after_a_refutation_elsewhere_gives_nothing_back():
    """Not real (kept): a pair's peer refuted in another race while its retry runs loses what was held aside (a
    disagreement forfeits it), and a later split of the first race gives nothing back; it stays avoided."""
    manager = _manager("S1", "F1")
    vouch(manager, "S1")
    confirm = threading.Event()
    confirming_later = _confirming_once(confirm)

    race = _judge(manager, [(("S1", "F1"), confirming_later)])
    vouch(manager, "S1")  # earned again meanwhile
    manager.bans.record_verified("S1", agreed=False)  # then refuted or outvoted elsewhere
    manager.avoid("S1", 60.0)
    confirm.set()
    assert _until(lambda: _rejudged(race) == ["split"]), race.race_events
    assert manager.bans.agreed_in_a_row("S1") == 0 and "S1" in manager.avoided_peers()
    manager.shutdown()


def test_a_pair_judged_unheard_after_the_clients_shutdown_is_not_asked_again():
    """The jobs end with the client (0253): its shutdown cancels those running, and starts none after. But the
    cancelling was registered at the client's first job: a race's judgement still awaiting its referees (past the
    session's close: `_JUDGING_AFTER_CLOSE`) when the client shut down, its first unheard pair judged after, started
    a job on the shut client, asking for up to 300 s (its p2p gone). Now no job starts on a client shut down."""
    manager = _manager("H1", "H2")
    vouch(manager, "H1")
    session = InferenceSession(manager, max_length=8)

    async def judging() -> tuple[asyncio.Future[Rechecked], asyncio.Future[None]]:
        referees: asyncio.Future[Rechecked] = asyncio.get_running_loop().create_future()
        lost = [(["H1", "H2"], referees, _silent_for_good)]
        return referees, asyncio.ensure_future(session._judge_lost_pairs((0, 2), "L", "W", lost))

    referees, judged = background_loop.run(judging(), timeout_s=10)
    manager.shutdown()
    background_loop.get_loop().call_soon_threadsafe(referees.set_result, UNCHECKED)
    assert _until(judged.done)
    try:
        assert retries_of(manager).running == 0
    finally:
        retries_of(manager).cancel()
