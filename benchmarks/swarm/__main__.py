"""`python -m benchmarks.swarm [--part helix|scale|large] [--policy petals corolla] [--seed N]`: runs the parts asked
for through `benchmarks.sim`, prints markdown tables and writes every report as JSON under `--out`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

from benchmarks.sim.helix import reproduction
from benchmarks.sim.scenarios import scenario
from benchmarks.sim.simulation import Simulation

COLUMNS = ("policy", "decode_tok_s", "ttft_p50_s", "tpot_p50_s", "tpot_p99_s", "sessions_completed", "failed",
           "failed_covered", "turned_away", "retried", "moves", "reload_s", "flow_eff", "wall_s", "cpu_s", "calls_wall_s")  # fmt: skip


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(row[c]) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def run_scenario(name: str, policies: list[str], seed: int, out: Path, **overrides: object) -> list[dict]:
    rows = []
    for policy in policies:

        def progress(simulated_s: float, cpu_s: float, policy: str = policy) -> None:
            print(f"{name}/{policy}: simulated {simulated_s:.0f} s in {cpu_s:.1f} CPU seconds", flush=True)

        report = Simulation(scenario(name, policy=policy, seed=seed, **overrides)).run(on_progress=progress)
        (out / f"{name}-{policy}-seed{seed}.json").write_text(report.to_json())
        rows.append(report.summary())
        print(f"{name}/{policy}: {json.dumps(report.summary())}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser("benchmarks.swarm", description=__doc__)
    parser.add_argument(
        "--part", nargs="+", choices=("helix", "scale", "scale-low", "large"), default=["helix", "scale"]
    )
    parser.add_argument("--policy", nargs="+", default=["petals", "corolla"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--helix_time_limit_s", type=float, default=60.0)
    parser.add_argument("--duration_s", type=float, default=None, help="override the scenarios' simulated seconds")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results") / f"swarm-{time.strftime('%Y%m%d-%H%M')}"
    )
    args = parser.parse_args()
    logging.disable(logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    overrides = {} if args.duration_s is None else {"duration_s": args.duration_s}
    sections = [f"CPUs available to this process: {cpus}"]
    if "helix" in args.part:
        figures = reproduction(args.helix_time_limit_s)
        (args.out / "helix.json").write_text(json.dumps(figures, indent=2))
        sections.append(
            "## Helix 24-node cluster (LLaMA-2-70B), Helix's capacity model\n\n" + json.dumps(figures, indent=2)
        )
    for part in ("scale", "scale-low", "large"):
        if part in args.part:
            rows = run_scenario(part, args.policy, args.seed, args.out, **overrides)
            sections.append(f"## {part} (seed {args.seed})\n\n" + markdown(rows))
    text = "\n\n".join(sections)
    (args.out / "RESULTS.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
