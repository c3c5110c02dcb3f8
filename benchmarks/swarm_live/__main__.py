"""`python -m benchmarks.swarm_live`: Petals' against corolla's swarm policies on live loopback swarms (`live`);
prints the JSON result and writes it under --out."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

from benchmarks.swarm_live.live import LiveConfig, default_servers, run_live


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.swarm_live", description=__doc__)
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    parser.add_argument("--servers", type=int, default=10, help="the first N of the 10 default servers")
    parser.add_argument("--rounds", type=int, default=3, help="windows per phase, interleaved (default 3)")
    parser.add_argument("--measure_s", type=float, default=15.0, help="measured seconds per window (default 15)")
    parser.add_argument("--warmup_s", type=float, default=5.0, help="unmeasured seconds per window (default 5)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/swarm_live.json"))
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops every child
    config = LiveConfig(
        servers=default_servers()[: args.servers], num_clients=args.clients, rounds=args.rounds,
        measure_s=args.measure_s, warmup_s=args.warmup_s,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="swarm-live-") as tmp:
        result = run_live(config, Path(tmp))
    text = json.dumps(result, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
