"""`python -m benchmarks.swarm.kv_by_block [--scenario scale] [--policy corolla] [--duration_s 1500] [--seed 0]`:
runs a scenario, then shows where the free KV cache is, per block and per region: how many sessions of the waiting
sessions' median need fit at the scarcest block and at the median block (a chain needs room on every hop, so the
scarcest block bounds admission however much KV the swarm has free in total)."""

from __future__ import annotations

import argparse
import logging

from benchmarks.sim.scenarios import scenario
from benchmarks.sim.server_model import SimServer
from benchmarks.sim.simulation import Simulation
from corolla.protocol.records import ServerState


def fitting_by_block(servers: list[SimServer], num_blocks: int, need_tokens: int) -> list[int]:
    """Sessions of `need_tokens` that fit at each block: each server's free KV holds whole sessions only."""
    fits = [0] * num_blocks
    for server in servers:
        for block in range(server.start, server.end):
            fits[block] += server.kv_free_tokens(block, block + 1) // max(need_tokens, 1)
    return fits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenario", default="scale")
    parser.add_argument("--policy", default="corolla")
    parser.add_argument("--duration_s", type=float, default=1500.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.disable(logging.INFO)
    sim = Simulation(scenario(args.scenario, policy=args.policy, duration_s=args.duration_s, seed=args.seed))
    sim.run()
    n = sim.config.model.num_blocks
    online = [s for s in sim.view.servers.values() if s.state == ServerState.ONLINE]
    sessions = list(sim.clients.sessions.values())
    waiting = [x for x in sessions if x.route is None and x.wait_start_s is not None]
    needs = sorted(x.conversation.total_tokens for x in waiting) or [1]
    need = needs[len(needs) // 2]
    decoding = sum(1 for x in sessions if x.phase == "decode")
    print(f"at {args.duration_s:.0f} s: {len(online)} servers online, {decoding} sessions decoding, {len(waiting)} "
          f"waiting (median need {need} tokens)")  # fmt: skip
    print("| region | servers | KV reserved | waiting | sessions fitting at the scarcest block | at the median block "
          "| blocks with room for < 5 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for region in [*sorted({s.region for s in online}), None]:
        servers = [s for s in online if region is None or s.region == region]
        capacity = sum(s.kv_capacity_tokens * s.num_blocks for s in servers)
        reserved = sum(s.kv_reserved_token_blocks for s in servers) / max(capacity, 1)
        fits = fitting_by_block(servers, n, need)
        scarcest = min(range(n), key=lambda b: fits[b])
        in_region = sum(1 for x in waiting if region is None or x.conversation.region == region)
        print(f"| {region or 'all'} | {len(servers)} | {reserved:.2f} | {in_region} | {fits[scarcest]} (block "
              f"{scarcest}) | {sorted(fits)[n // 2]} | {sum(1 for f in fits if f < 5)} |")  # fmt: skip


if __name__ == "__main__":
    main()
