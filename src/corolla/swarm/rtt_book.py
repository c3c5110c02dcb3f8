"""`RttBook`: the RTTs a server measured to other servers, kept from one balance check to the next.

A policy that places by region (`SwarmPolicy.uses_rtts`) needs to know which servers are near. A server pings
`PLACEMENT_PINGS` servers a check; a fresh random sample each time let a server of a 1,000-server swarm see a
different ~13 of its region's ~200 servers at every check, so each check weighed a different swarm and the moves
oscillated (6,419 moves in the simulated hour of `python -m benchmarks.sim run --scenario large`, decision 0025). RTTs between two
hosts barely change, so the book keeps every figure it measured and pings first the servers it has not measured:
its view of its region only grows, and once it has measured every server announced it is the whole region, the
same for every server of that region."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class RttBook:
    rtts_s: dict[str, float] = field(default_factory=dict)  # peer id -> RTT (s) it measured (inf: unreachable)

    def to_ping(self, peers: Iterable[str], limit: int, rng: random.Random) -> list[str]:
        """Up to `limit` of `peers` (the servers announced now) to ping: those never measured first, then those that
        did not answer (`inf`: perhaps a lost packet), each group at random."""
        peers = set(peers)
        unknown = sorted(peers - self.rtts_s.keys())
        chosen = rng.sample(unknown, min(limit, len(unknown)))
        silent = sorted(p for p in peers & self.rtts_s.keys() if math.isinf(self.rtts_s[p]))
        return chosen + rng.sample(silent, min(limit - len(chosen), len(silent)))

    def record(self, measured: Mapping[str, float]) -> None:
        """Keeps what a round of pings measured (a later figure replaces an earlier one)."""
        self.rtts_s.update(measured)

    def known(self, peers: Iterable[str]) -> dict[str, float]:
        """The RTTs it holds to `peers` (the servers announced now); figures of servers gone are forgotten."""
        present = set(peers)
        for gone in self.rtts_s.keys() - present:
            del self.rtts_s[gone]
        return dict(self.rtts_s)
