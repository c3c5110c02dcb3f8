"""A server's RTT book: it keeps what it measured across balance checks and pings first the servers it has not
measured, so its view of its region only grows (decision 0025)."""

from __future__ import annotations

import math
import random

from corolla.swarm.rtt_book import RttBook


def test_the_book_pings_the_unmeasured_first_and_keeps_every_figure():
    book, rng = RttBook(), random.Random(0)
    peers = [f"p{i:03d}" for i in range(200)]
    seen: set[str] = set()
    for _ in range(4):  # 64 a check: the whole swarm after 4 checks, each peer pinged once
        pinged = book.to_ping(peers, 64, rng)
        assert not seen & set(pinged)
        seen |= set(pinged)
        book.record({p: 0.01 for p in pinged})
    assert seen == set(peers) and book.to_ping(peers, 64, rng) == []
    assert book.known(peers) == {p: 0.01 for p in peers}


def test_silent_peers_are_pinged_again_after_the_unmeasured_and_departed_ones_forgotten():
    book, rng = RttBook(), random.Random(0)
    book.record({"a": 0.01, "b": math.inf, "gone": 0.02})
    assert book.to_ping(["a", "b", "c"], 1, rng) == ["c"]
    assert book.to_ping(["a", "b", "c"], 5, rng) == ["c", "b"]
    assert book.known(["a", "b", "c"]) == {"a": 0.01, "b": math.inf}
    assert "gone" not in book.rtts_s
