"""Regions and round-trip times: a symmetric matrix of typical RTTs between regions, from public inter-city ping
tables (WonderNetwork's global ping statistics, wondernetwork.com/pings, and AWS inter-region latency tables such
as cloudping.co; rounded medians of New York/Virginia, California, Frankfurt/London, Singapore, Sydney), and a
deterministic per-pair spread: 2-20 ms inside a region, +-10% between regions."""

from __future__ import annotations

import random
from collections.abc import Sequence

REGIONS = ("us-east", "us-west", "europe", "asia", "australia")
INTRA_REGION_RTT_S = (0.002, 0.020)
INTER_REGION_SPREAD = 0.10

_RTT_MS = {
    ("us-east", "us-west"): 65,
    ("us-east", "europe"): 85,
    ("us-west", "europe"): 145,
    ("us-east", "asia"): 215,
    ("us-west", "asia"): 170,
    ("europe", "asia"): 160,
    ("us-east", "australia"): 200,
    ("us-west", "australia"): 145,
    ("europe", "australia"): 260,
    ("asia", "australia"): 95,
}


def base_rtt_s(a: str, b: str) -> float:
    """Typical RTT between two regions (the middle of the intra-region range for a == b)."""
    if a == b:
        return sum(INTRA_REGION_RTT_S) / 2
    ms = _RTT_MS.get((a, b), _RTT_MS.get((b, a)))
    if ms is None:
        raise ValueError(f"unknown region pair {a!r}, {b!r}; regions are {REGIONS}")
    return ms / 1000


class RttModel:
    """RTT between two endpoints (servers or clients) named by id, each in a region; the same pair always gets the
    same RTT for a given seed (a symmetric, reproducible spread around the regions' typical figure)."""

    def __init__(self, seed: int, regions: Sequence[str] = REGIONS):
        for region in regions:
            if region not in REGIONS:
                raise ValueError(f"unknown region {region!r}; regions are {REGIONS}")
        self.seed = seed

    def rtt_s(self, a_id: str, a_region: str, b_id: str, b_region: str) -> float:
        lo_id, hi_id = sorted((a_id, b_id))
        spread = random.Random(f"{self.seed}/{lo_id}/{hi_id}").random()
        if a_region == b_region:
            return INTRA_REGION_RTT_S[0] + spread * (INTRA_REGION_RTT_S[1] - INTRA_REGION_RTT_S[0])
        return base_rtt_s(a_region, b_region) * (1 + INTER_REGION_SPREAD * (2 * spread - 1))
