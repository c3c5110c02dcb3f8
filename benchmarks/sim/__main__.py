"""`python -m benchmarks.sim`: run a swarm scenario in simulated time with a placement/routing policy, compare policies on the
same scenario and seed, or reproduce Helix's max-flow anchor; prints a table and optionally writes JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from benchmarks.sim.client_book import UNMEASURED_RULES
from benchmarks.sim.helix import reproduction
from benchmarks.sim.policies import POLICY_NAMES
from benchmarks.sim.scenarios import SCENARIOS, scenario
from benchmarks.sim.shadow_rows import ROW_COSTS
from benchmarks.sim.simulation import DELIVERY_RULES, Simulation
from benchmarks.sim.workload import WorkloadConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("python -m benchmarks.sim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate a scenario with one or more policies (same seed, one row each)")
    run.add_argument("--scenario", choices=sorted(SCENARIOS), default="scale")
    run.add_argument(
        "--policy",
        nargs="+",
        default=["corolla"],
        choices=POLICY_NAMES,
        help="policies to compare on the same seed: corolla (what corolla-server and the client run) and petals "
        "(the reference's, the baseline), e.g. --policy petals corolla",
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--servers", type=int, default=None, help="override the scenario's server count")
    run.add_argument("--duration_s", type=float, default=None, help="override the scenario's simulated seconds")
    run.add_argument("--clients", type=int, default=None, help="concurrent clients instead of the scenario's workload")
    run.add_argument(
        "--sessions_per_client", type=int, default=None, help="conversations each closed-loop client keeps open"
    )
    run.add_argument("--trace", default=None, help="a JSON-lines workload trace instead of the generator")
    run.add_argument("--bound_time_limit_s", type=float, default=None, help="MILP seconds per flow snapshot")
    run.add_argument(
        "--unmeasured",
        choices=UNMEASURED_RULES,
        default=None,
        help="what clients know of servers they never pinged (default: known, every RTT at once; decision 0145)",
    )
    run.add_argument("--fakes", type=int, default=None, help="made-up records claiming every block at a great speed")
    run.add_argument(
        "--delivery_rule",
        nargs="+",
        default=None,
        choices=DELIVERY_RULES,
        help="how clients weigh a span's server, one row each on the same seed: announced (the records' figures "
        "alone: main before decision 0189) and judged (by what it delivers too: 0189, what the client runs); "
        "default: the scenario's",
    )
    run.add_argument("--lorises", type=float, default=None, help="the share of servers that are lorises (0-1)")
    run.add_argument(
        "--shadow_fraction",
        type=float,
        nargs="+",
        default=None,
        help="shares of span sessions mirrored by shadow sessions on a replica (issue 37, decision 0268), one row each "
        "on the same seed (0: none, the default; the client's own is 0.75)",
    )
    run.add_argument(
        "--shadow_kv",
        choices=("held", "none"),
        default="held",
        help="whether shadows hold their KV on the replica (none: their rows' cost alone)",
    )
    run.add_argument(
        "--shadow_rows",
        choices=ROW_COSTS,
        default="calibrated",
        help="a shadow row's cost to the replica's step: fitted to decision 0260's measurement, or the roofline's",
    )
    run.add_argument("--json", type=Path, default=None, help="write the full reports here")
    helix = sub.add_parser("helix", help="reproduce Helix's 24-node max-flow figures under its capacity model")
    helix.add_argument("--time_limit_s", type=float, default=60.0, help="MILP seconds for the best-known search")
    parser.add_argument("-v", "--verbose", action="store_true", help="log events")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not args.verbose:
        logging.disable(logging.INFO)
    if args.command == "helix":
        print(json.dumps(reproduction(args.time_limit_s), indent=2))
        return
    overrides = {
        key: value
        for key, value in (
            ("servers", args.servers),
            ("duration_s", args.duration_s),
            ("bound_time_limit_s", args.bound_time_limit_s),
            ("unmeasured", args.unmeasured),
            ("fake_servers", args.fakes),
            ("loris_fraction", args.lorises),
        )
        if value is not None
    }
    base = scenario(
        args.scenario, seed=args.seed, shadow_kv=args.shadow_kv == "held", shadow_rows=args.shadow_rows, **overrides
    )
    if args.trace is not None:
        base = dataclasses.replace(base, workload=WorkloadConfig(trace_path=args.trace))
    elif args.clients is not None or args.sessions_per_client is not None:
        workload = base.workload
        if args.clients is not None:
            workload = dataclasses.replace(workload, concurrent_clients=args.clients, sessions_per_hour=None)
        if args.sessions_per_client is not None:
            workload = dataclasses.replace(workload, sessions_per_client=args.sessions_per_client)
        base = dataclasses.replace(base, workload=workload)
    reports = []
    for policy in args.policy:
        for rule in args.delivery_rule or [base.delivery_rule]:
            for fraction in args.shadow_fraction or [base.shadow_fraction]:
                config = dataclasses.replace(base, policy=policy, delivery_rule=rule, shadow_fraction=fraction)
                report = Simulation(config).run()
                reports.append(report)
                print(report.table(), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps([json.loads(r.to_json()) for r in reports], indent=2))


if __name__ == "__main__":
    main()
