"""How many made-up server records a client's min-latency route tries before an honest server (decision 0137):
fakes claim the whole model (optionally at 1e9 blocks/s), are never pinged, and each one tried is dropped (as a
failed dial bans it); the honest server is measured at a given RTT or not at all. Pure route math, no network.

    .venv/bin/python benchmarks/flooded_route_tries.py
"""

from __future__ import annotations

import random

from corolla.protocol.records import RemoteSpanInfo, ServerInfo, ServerState
from corolla.swarm.corolla_policy import CorollaPolicy

BLOCKS = 80


def _span(peer_id: str, inference_rps: float | None) -> RemoteSpanInfo:
    info = ServerInfo(
        ServerState.ONLINE, 300.0, start_block=0, end_block=BLOCKS, inference_rps=inference_rps,
        cache_tokens_left=10**9,
    )  # fmt: skip
    return RemoteSpanInfo(peer_id, 0, BLOCKS, info)


def fakes_tried(num_fakes: int, fake_rps: float | None, honest_rtt_s: float | None, seed: int = 0) -> int:
    rng = random.Random(seed)
    policy = CorollaPolicy()
    spans = [_span(f"fake{i}", fake_rps) for i in range(num_fakes)] + [_span("honest", 300.0)]
    rtts = {} if honest_rtt_s is None else {"honest": honest_rtt_s}
    tried = 0
    while True:
        route = policy.choose_route(
            spans, 0, BLOCKS, mode="min_latency", client_rtts_s=rtts, cache_tokens_needed=64, rng=rng
        )
        fakes = {span.peer_id for span in route if span.peer_id != "honest"}
        if not fakes:
            return tried
        tried += len(fakes)
        spans = [span for span in spans if span.peer_id not in fakes]


def main() -> None:
    for fake_rps in (None, 1e9):
        for honest_rtt_s in (0.05, 0.3, None):
            for num_fakes in (10, 1000):
                tried = fakes_tried(num_fakes, fake_rps, honest_rtt_s)
                print(
                    f"fake inference_rps={fake_rps} honest rtt_s={honest_rtt_s} fakes={num_fakes}: {tried} tried first"
                )


if __name__ == "__main__":
    main()
