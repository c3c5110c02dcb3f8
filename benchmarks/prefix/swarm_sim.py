"""`python -m benchmarks.prefix.swarm_sim [--scenario scale-low] [--policy corolla] [--cache_tokens_per_server N]`:
prefix caching in python -m benchmarks.sim (`benchmarks.prefix.sim_scenario`): stateless multi-turn chats (5 turns of LMSYS-sized
prompts and answers), a prefix cache per server, one run each without the cache, with it under the policy's plain
routing and with cache-affine routing (the real `client.prefix.prefix_routes`), same seed. Prints one JSON line per way
and, with `--markdown`, a table for RESULTS.md."""

from __future__ import annotations

import argparse
import json

from benchmarks.prefix.sim_scenario import compare, prefix_config
from benchmarks.sim.scenarios import SCENARIOS, scenario

COLUMNS = ("saved_prefill", "affine_routes", "later_turns", "later_ttft_p50_s", "later_ttft_mean_s", "ttft_p50_s",
           "tpot_p50_s", "sessions_completed", "failed")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefix.swarm_sim", description=__doc__)
    parser.add_argument("--scenario", default="scale-low", choices=sorted(SCENARIOS))
    parser.add_argument("--policy", default="corolla")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration_s", type=float, default=None, help="default: the scenario's")
    parser.add_argument("--cache_tokens_per_server", type=int, default=16384)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    overrides = {"policy": args.policy, "seed": args.seed}
    if args.duration_s is not None:
        overrides["duration_s"] = args.duration_s
    config = prefix_config(scenario(args.scenario), **overrides)
    results = compare(config, args.cache_tokens_per_server)
    for way, summary in results.items():
        print(json.dumps({"way": way, "scenario": args.scenario, **summary}), flush=True)
    if args.markdown:
        print(f"\n| {args.scenario}, {args.policy}, seed {args.seed} | " + " | ".join(COLUMNS) + " |")
        print("|---" * (len(COLUMNS) + 1) + "|")
        for way, summary in results.items():
            print(f"| {way} | " + " | ".join(str(summary[c]) for c in COLUMNS) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
