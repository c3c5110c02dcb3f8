"""An unheard race pair's referees asked again after the race (`client.session.unheard_pairs`, decision 0253): the
jobs are capped per client, one per pair, and end with the client; a lent standing spent on "unheard" is held aside
(`BanList.spend`), given back by a later split, forfeited by any disagreement. The races themselves:
`test_client_slow_servers.py` (`-k "heard_later or bounded_number or shuts_down"`)."""

from __future__ import annotations

import asyncio

import pytest

from corolla.client import background_loop
from corolla.client.routing.bans import BanList
from corolla.client.session import unheard_pairs
from corolla.client.session.replacement_race import RaceEvent
from corolla.client.session.unheard_pairs import RETRIES_MAX, UnheardPair, rejudge, retries_of
from corolla.client.verification.witnesses import UNCHECKED, Rechecked
from helpers.fake_chain import FakeManager, FakeServer, vouch


def _pair(index: int, ask, events: list[RaceEvent], spent: tuple[tuple[str, int], ...] = (), watch=None) -> UnheardPair:
    return UnheardPair((0, 2), (f"A{index}", f"B{index}"), "L", "W", spent, watch, ask, events)


def test_retry_jobs_are_capped_per_client_one_per_pair_and_end_with_the_client(monkeypatch: pytest.MonkeyPatch):
    """An attacker making pair after pair unheard (each pair's referees silent, their asks held for good): at most
    `RETRIES_MAX` jobs run for the client, a second job for a pair already asked again is not started, and the
    client's shutdown ends every job, none started after (0248's verdict stands for the rest). On main no pair was
    asked again (no `unheard_pairs`)."""
    monkeypatch.setattr(unheard_pairs, "RETRY_WAITS_S", (0.0,))
    manager = FakeManager({}, 4)
    asked = 0
    held = asyncio.Event()

    async def ask() -> Rechecked:
        nonlocal asked
        asked += 1
        await held.wait()  # (never set: a referee held for good)
        return UNCHECKED

    events: list[RaceEvent] = []
    retries = retries_of(manager)

    async def start_many() -> list[bool]:
        started = [retries.start(manager, _pair(i, ask, events)) for i in range(RETRIES_MAX + 8)]
        started.append(retries.start(manager, _pair(0, ask, events)))  # the same pair, in another race
        for _ in range(20):
            await asyncio.sleep(0.01)
        return started

    started = background_loop.run(start_many(), timeout_s=10)
    assert started == [True] * RETRIES_MAX + [False] * 9
    assert retries.running == RETRIES_MAX and asked == RETRIES_MAX
    manager.shutdown()
    assert retries.running == 0 and events == []
    assert not background_loop.run(_start(retries, manager, _pair(99, ask, events)), timeout_s=5)
    assert retries_of(manager) is retries


async def _start(retries: unheard_pairs.UnheardRetries, manager: FakeManager, pair: UnheardPair) -> bool:
    return retries.start(manager, pair)


@pytest.mark.parametrize(
    ("rechecked", "verdict"),
    [
        (Rechecked("confirmed", (("R",),)), "split"),
        (Rechecked("split", (("R",),), 1), "split"),
        (Rechecked("refuted", (), 1), "refuted"),
        (UNCHECKED, "unheard"),
    ],
    ids=["confirmed", "split", "refuted", "unchecked"],
)
def test_rejudge(rechecked: Rechecked, verdict: str):
    """0238's judgement of a lost pair, by the referees heard later: a confirming referee gives back what "unheard"
    spent and ends the pair's watch; none confirming refutes both (standing lost, avoided); none answering leaves
    0248's verdict (spent, watched)."""
    manager = FakeManager({name: FakeServer(0, 4) for name in ("A0", "B0", "L", "R")}, 4)
    vouch(manager, "A0")
    spend_id = manager.bans.spend("A0")
    watch = manager.disputes.open("L", ("A0", "B0"), 300.0)
    events: list[RaceEvent] = []
    assert rejudge(manager, _pair(0, None, events, spent=(("A0", spend_id),), watch=watch), rechecked) == verdict
    assert events == [RaceEvent((0, 2), "rejudged", ("A0", "B0"), verdict)]
    steps = manager.config.witness_standing_steps
    assert manager.bans.agreed_in_a_row("A0") == (steps if verdict == "split" else 0)
    assert manager.disputes.watched() == ({"A0", "B0"} if verdict == "unheard" else set())
    assert manager.avoided_peers() == ({"A0", "B0"} if verdict == "refuted" else set())


def test_a_spent_standing_is_given_back_unless_a_disagreement_forfeited_it():
    bans = BanList(1.0)
    for _ in range(8):
        bans.record_verified("A", agreed=True)
        bans.record_verified("B", agreed=True)
    spent_a, spent_b = bans.spend("A"), bans.spend("B")
    assert bans.agreed_in_a_row("A") == bans.agreed_in_a_row("B") == 0
    bans.record_verified("A", agreed=True)  # verified while watched, agreeing: counted on top of what comes back
    bans.record_verified("B", agreed=False)  # a disagreement since: what was spent is lost
    bans.give_back("A", spent_a)
    bans.give_back("B", spent_b)
    assert bans.agreed_in_a_row("A") == 9 and bans.agreed_in_a_row("B") == 0
    bans.give_back("A", spent_a)  # given back once
    assert bans.agreed_in_a_row("A") == 9
