"""`corolla-findings MODEL FILE... --initial_peers ... --findings_dir DIR`: re-checks findings other peers shared (the
`<peer id>.finding` files a client keeps in its `ClientConfig.findings_dir` when it catches a server lying) against
the live swarm, first-hand (`client.verification.finding_check`), and prints one verdict a file: "caught" (the accused
answered this machine wrong too, outvoted 2:1 by two replicas: it is recorded in DIR's `liars`, which a client given
`findings_dir=DIR` bans at start, and this machine's own finding is kept in DIR), "refuted" (the claimed outputs are
right) or "unverifiable" (nothing could be confirmed: nothing changes). A finding is never trusted as such: a forged
one against an honest server cannot get it banned. Exit 0 when every file was checked; a bad file: one line, exit 2."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from corolla.cli.errors import add_common_flags, check_initial_peers, check_model_argument, run_cli
from corolla.cli.witness_flags import add_witness_flags
from corolla.client import background_loop
from corolla.client.config import ClientConfig
from corolla.client.routing.findings import MAX_FINDING_BYTES, Finding, decode_finding
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.verification.finding_check import check_finding
from corolla.models.config import default_dht_prefix, load_config
from corolla.protocol.uids import make_uid

DEFAULT_TIMEOUT_S = 300.0  # the longest the whole check may take (each request is bounded by --request_timeout_s)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corolla-findings", description=__doc__)
    parser.add_argument("model", help="model repository or local directory (only its config is read)")
    parser.add_argument("files", nargs="+", help="finding files (`<peer id>.finding`) to re-check")
    parser.add_argument("--initial_peers", nargs="+", default=(), help="multiaddrs of swarm members")
    parser.add_argument(
        "--findings_dir",
        required=True,
        help="this machine's findings directory (ClientConfig.findings_dir): a server caught is banned there",
    )
    parser.add_argument("--dht_prefix", default=None, help="DHT prefix the servers announce (default: from model)")
    parser.add_argument(
        "--reporter", default=None, help="peer id of the server that sent the findings (never asked to re-check them)"
    )
    parser.add_argument("--request_timeout_s", type=float, default=60.0, help="wait for one server response")
    parser.add_argument("--timeout_s", type=float, default=DEFAULT_TIMEOUT_S, help="the longest the check may take")
    add_witness_flags(parser)
    add_common_flags(parser, swarm=True, verbose_help="show logs (on stderr) and tracebacks; quiet by default")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_cli("corolla-findings", lambda: _main(argv), argv, quiet=True)


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_model_argument(args.model)
    check_initial_peers(args.initial_peers)
    findings = [(path, read_finding(Path(path))) for path in args.files]  # a bad file fails before the swarm starts
    model_config = load_config(args.model)
    prefix = args.dht_prefix or default_dht_prefix(args.model, model_config)
    config = ClientConfig(
        initial_peers=tuple(args.initial_peers), dht_prefix=prefix, swarm_key_file=args.swarm_key_file,
        findings_dir=args.findings_dir, request_timeout_s=args.request_timeout_s,
        witness_standing_steps=args.witness_standing_steps,
    )  # fmt: skip
    manager = RemoteSequenceManager(config, [make_uid(prefix, i) for i in range(model_config.num_hidden_layers)])
    try:
        manager.wait_ready()
        verdicts = background_loop.run(
            asyncio.wait_for(check_all(manager, [f for _, f in findings], args.reporter), args.timeout_s)
        )
    finally:
        manager.shutdown()
    for (path, finding), verdict in zip(findings, verdicts, strict=True):
        print(f"{path}: {verdict} (accused {finding.peer_id}, blocks {finding.blocks[0]}:{finding.blocks[1]})")
    return 0


async def check_all(manager: RemoteSequenceManager, findings: list[Finding], reporter: str | None) -> list[str]:
    return [await check_finding(manager, finding, reporter=reporter) for finding in findings]


def read_finding(path: Path) -> Finding:
    """The finding in `path` (ValueError naming the file when it is too large or malformed)."""
    size = path.stat().st_size
    if size > MAX_FINDING_BYTES:
        raise ValueError(f"{path}: a finding is at most {MAX_FINDING_BYTES} bytes, this file has {size}")
    try:
        return decode_finding(path.read_bytes())
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


if __name__ == "__main__":
    sys.exit(main())
