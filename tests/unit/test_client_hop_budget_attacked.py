"""Review 0256 of decision 0254 (a recheck's hop budget spent in two passes, the second by record): identities with
a record, which the second pass ranks first, cannot take a recheck past its bound of hop forwards (in-process fakes,
no network)."""

from __future__ import annotations

import random

import pytest
from tests.unit.test_client_distrust import Server

from corolla.client.verification.chains import HOPS_PER_SEAT, hop_paths
from corolla.client.verification.stretches import StretchReferees
from corolla.client.verification.witnesses import OUTSIDERS_MAX, RECORD_SEATS
from corolla.protocol.records import RemoteSpanInfo
from helpers.fake_chain import FakeManager, record_of


@pytest.mark.parametrize("steps", [0, 1, 8], ids=["fresh", "1_step_each", "standing_each"])
def test_single_block_identities_with_a_record_keep_a_recheck_within_its_hop_bound(steps: int):
    """Not real (kept): 0250's layout (three identities on each of 80 blocks, X1 (0:40) > X2 (40:80) honest), the
    identities now with a record of `steps` verified steps each, so that 0254's second pass (the record seats and
    the chains the first cut, by record first) ranks their chains before the honest one. Each pass takes a chain only
    where the distinct hop forwards spent so far and its own fit the pass's ceiling (32, then 48): no draw asks more
    than 48 (43 at most in 50 draws, as on 0250's 01480b6b: X1 > X2 and X1 > 40 identities, sharing X1's forward),
    and X1 > X2 is asked wherever it is seated (24 of 50 draws fresh or 1 step each, as on 01480b6b). Identities with
    standing (8 steps each, 240 of them) take every seat before X1 > X2, which has no record, and none of their
    80-hop chains fits: nothing asked, 12 chains unheard (0208's standing-first seats and 0246's record seats, as on
    01480b6b; silence blocks a ban on one standing, 0232)."""
    servers = {f"F{block}.{i}": Server(block, block + 1) for block in range(80) for i in range(3)}
    servers |= {"X1": Server(0, 40), "X2": Server(40, 80)}
    manager = FakeManager(servers, 80)
    for _ in range(steps):
        for peer in servers:
            if peer.startswith("F"):
                manager.bans.record_verified(peer, agreed=True)
    span = RemoteSpanInfo("H", 0, 80, record_of(0, 80, 100.0))
    honest = 0
    for seed in range(50):
        outsiders = StretchReferees(manager, rng=random.Random(seed)).outsiders(span, {"H"})
        forwards = set().union(*map(hop_paths, outsiders.chains))
        assert len(forwards) <= HOPS_PER_SEAT * (OUTSIDERS_MAX + RECORD_SEATS), (seed, len(forwards))
        honest += ("X1", "X2") in [chain.peer_ids for chain in outsiders.chains]
        assert len(outsiders.chains) + outsiders.unheard >= OUTSIDERS_MAX, seed  # (a seat cut is counted silent)
    if steps < manager.config.witness_standing_steps:
        assert 12 <= honest <= 38, honest
