"""The simulator's model of what each client measured (`benchmarks.sim.client_book`, decision 0145): a fresh client
knows the servers its first refresh pinged, more at each refresh; after a server it never measured fails, every
unmeasured server counts as unreachable for one refresh period (the real client's rule, decision 0137); made-up
records are tried a bounded number of times and cost failed dials, not failed sessions."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.sim.client_book import FIRST_PINGS, ClientBooks, fake_records, is_fake
from benchmarks.sim.scenarios import scenario
from benchmarks.sim.simulation import Simulation
from corolla.protocol.records import RemoteSpanInfo
from corolla.swarm.policy import PLACEMENT_PINGS

PERIOD_S = 60.0


def _swarm(honest: int, fakes: int) -> tuple[list[RemoteSpanInfo], dict[str, float]]:
    made_up = fake_records(fakes, 8)
    info = made_up[0].server_info if made_up else fake_records(1, 8)[0].server_info
    spans = [RemoteSpanInfo(f"sim{i:05d}", 0, 8, info) for i in range(honest)] + made_up
    return spans, {span.peer_id: 0.01 + i / 1000 for i, span in enumerate(spans[:honest])}


def test_a_fresh_clients_book_fills_by_its_pings() -> None:
    spans, region = _swarm(400, 600)
    books = ClientBooks("after_failure", PERIOD_S, random.Random(0))
    first = books.rtts("c", spans, region, 10.0)
    assert len(first) == FIRST_PINGS  # its first refresh's pings
    assert all(math.isinf(rtt) == is_fake(peer) for peer, rtt in first.items())  # a made-up one never answers
    assert all(rtt == region[peer] for peer, rtt in first.items() if not is_fake(peer))
    assert len(books.rtts("c", spans, region, 69.0)) == FIRST_PINGS  # no refresh yet
    assert len(books.rtts("c", spans, region, 130.0)) == FIRST_PINGS + 2 * PLACEMENT_PINGS  # two refreshes missed
    assert len(books.rtts("other", spans, region, 130.0)) == FIRST_PINGS  # each client its own book
    books.forget("c")
    assert len(books.rtts("c", spans, region, 131.0)) == FIRST_PINGS


def test_after_a_never_measured_server_fails_the_unmeasured_count_as_unreachable_for_a_period() -> None:
    spans, region = _swarm(400, 600)
    books = ClientBooks("after_failure", PERIOD_S, random.Random(1))
    measured = set(books.rtts("c", spans, region, 0.0))
    books.on_failure("c", next(iter(measured)), spans, 5.0)  # one it measured: nothing changes
    assert set(books.rtts("c", spans, region, 5.0)) == measured
    unmeasured = next(span.peer_id for span in spans if span.peer_id not in measured)
    books.on_failure("c", unmeasured, spans, 5.0)
    during = books.rtts("c", spans, region, 6.0)
    assert len(during) == len(spans)  # every server has a figure: the unmeasured ones unreachable
    now_measured = [peer for peer in during if peer in measured or not math.isinf(during[peer])]
    assert len(set(now_measured) - measured) > 0  # its refresh at once measured more (honest ones answer)
    after = books.rtts("c", spans, region, 5.0 + PERIOD_S + 1)
    assert len(after) < len(spans)  # the period is over: unmeasured ones are unknown again, not unreachable


def test_known_rule_is_the_older_assumption() -> None:
    spans, region = _swarm(10, 5)
    books = ClientBooks("known", PERIOD_S, random.Random(2))
    rtts = books.rtts("c", spans, region, 0.0)
    assert {peer: rtt for peer, rtt in rtts.items() if not is_fake(peer)} == region
    assert sum(math.isinf(rtt) for rtt in rtts.values()) == 5
    with pytest.raises(ValueError, match="unmeasured rule"):
        ClientBooks("never", PERIOD_S, random.Random(0))


def test_made_up_records_cost_failed_dials_not_sessions() -> None:
    """1,000 made-up records in the tiny swarm, clients measuring what they ping: made-up servers are tried (a fresh
    client's first routes may take one it has not measured), at most once a refresh period per client, and every
    session still completes."""
    config = scenario("tiny", seed=1, duration_s=900.0, unmeasured="after_failure", fake_servers=1000)
    report = Simulation(config).run()
    clients = config.workload.concurrent_clients
    assert 0 < report.churn["fake_tries"] <= clients * (config.duration_s / config.client_update_period_s + 1)
    assert report.sessions["failed"] == 0 and report.sessions["completed"] > 10
