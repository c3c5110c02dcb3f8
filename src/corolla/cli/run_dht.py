"""`corolla-dht`: a bootstrap DHT node (no blocks). Prints the multiaddrs others pass as `--initial_peers`, keeps
its routing table fresh, and stops cleanly on SIGINT/SIGTERM (its DHT process and p2pd die with it in any case)."""

from __future__ import annotations

import argparse
import secrets
import signal
import sys
import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

import configargparse

from corolla.cli.errors import add_common_flags, check_initial_peers, exit_now, run_cli
from corolla.swarm.dht import (
    PRIVATE_HOST_MADDRS,
    PUBLIC_HOST_MADDRS,
    SwarmConfig,
    create_dht,
    get_visible_maddrs,
    run_in_dht,
    shutdown_dht,
)
from corolla.swarm.local import DHT_PEER_PREFIX
from corolla.swarm.membership import SwarmKey, load_swarm_key
from corolla.swarm.reachability import attach_reachability_protocol
from corolla.utils.interrupts import event_wait
from corolla.utils.logging import get_logger

logger = get_logger("corolla.cli.run_dht")  # not __name__: it is "__main__" under `python -m`

REFRESH_TIMEOUT_S = 30.0


def build_parser() -> configargparse.ArgParser:
    parser = configargparse.ArgParser(
        prog="corolla-dht",
        description="Run a bootstrap DHT node for a corolla/Petals swarm. Without --initial_peers it starts a new "
        "private swarm. It listens on 127.0.0.1 unless you pass --host_maddrs (e.g. /ip4/0.0.0.0/tcp/31337 to be "
        "reachable from other machines) or join the public Petals swarm (then the reference defaults "
        f"{' '.join(PUBLIC_HOST_MADDRS)} apply).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("-c", "--config", is_config_file=True, help="YAML/INI config file with the same keys")
    parser.add_argument(
        "--initial_peers",
        nargs="*",
        default=[],
        help="multiaddrs of peers of an existing swarm to join; empty = start a new swarm",
    )
    parser.add_argument(
        "--host_maddrs",
        nargs="+",
        default=None,
        help=f"multiaddrs to listen on; default {' '.join(PRIVATE_HOST_MADDRS)} (loopback only) for private "
        f"swarms, {' '.join(PUBLIC_HOST_MADDRS)} when joining the public swarm",
    )
    parser.add_argument("--announce_maddrs", nargs="+", default=None, help="visible multiaddrs to announce")
    parser.add_argument("--use_ipfs", action="store_true", help="bootstrap via the public IPFS DHT (sends traffic out)")
    parser.add_argument(
        "--identity_path", default=None, help="libp2p private key file for a stable peer id (created if absent)"
    )
    parser.add_argument(
        "--new_swarm_key",
        default=None,
        metavar="PATH",
        help="write a new random swarm key to PATH (readable by you only), print its fingerprint and exit",
    )
    parser.add_argument(
        "--no_relay",
        action="store_true",
        help="disable libp2p circuit relays (they are off anyway unless joining the public swarm)",
    )
    parser.add_argument(
        "--use_auto_relay", action="store_true", help="look for relays to become reachable from behind a NAT"
    )
    parser.add_argument(
        "--refresh_period", type=float, default=30.0, help="seconds between routing-table refreshes and status logs"
    )
    parser.add_argument(
        "--startup_timeout", type=float, default=60.0, help="seconds to wait for the p2p daemon and bootstrap"
    )
    add_common_flags(parser, swarm=True)
    return parser


def config_from_args(args: argparse.Namespace) -> SwarmConfig:
    return SwarmConfig(
        initial_peers=list(args.initial_peers),
        host_maddrs=args.host_maddrs,
        announce_maddrs=args.announce_maddrs,
        identity_path=args.identity_path,
        use_relay=False if args.no_relay else None,
        use_auto_relay=True if args.use_auto_relay else None,
        startup_timeout_s=args.startup_timeout,
        extra_dht_kwargs={"use_ipfs": True} if args.use_ipfs else {},
        swarm_key=load_swarm_key(args.swarm_key_file),
    )


async def _refresh(_dht: Any, node: Any, *, key: str) -> int:
    await node.get(key, latest=True)
    return len(node.protocol.routing_table.uid_to_peer_id)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: runs the node, then exits at once (interpreter teardown of torch takes seconds)."""
    return exit_now(run_cli("corolla-dht", lambda: run(argv), argv))


def run(argv: Sequence[str] | None = None) -> int:
    """Runs a bootstrap node until SIGINT/SIGTERM; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.refresh_period <= 0:
        raise SystemExit("corolla-dht: --refresh_period must be > 0")
    if args.new_swarm_key:
        key = SwarmKey.generate()
        try:
            key.save(args.new_swarm_key)
        except FileExistsError:
            raise SystemExit(f"corolla-dht: {args.new_swarm_key} exists; not overwriting a swarm key") from None
        print(f"corolla-dht: new swarm key {key.fingerprint} written to {args.new_swarm_key}", flush=True)
        return 0
    check_initial_peers(args.initial_peers)
    config = config_from_args(args)

    stop = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        logger.info(f"dht.stop_requested(signal={signal.Signals(signum).name})")
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    dht = create_dht(config)
    try:
        maddrs = get_visible_maddrs(dht)
        for maddr in maddrs:
            print(f"{DHT_PEER_PREFIX}{maddr}", flush=True)
        print(f"corolla-dht: to join this swarm, pass --initial_peers {' '.join(maddrs)}", flush=True)
        if config.is_public:
            attach_reachability_protocol(dht)
        while not event_wait(stop, args.refresh_period):  # in slices: see utils.interrupts
            try:
                heartbeat_key = f"heartbeat_{secrets.token_hex(16)}"
                size = run_in_dht(
                    dht, partial(_refresh, key=heartbeat_key), timeout_s=REFRESH_TIMEOUT_S, what="refresh"
                )
                logger.info(f"dht.refresh(routing_table_size={size})")
            except Exception as e:  # a slow refresh must not kill the bootstrap node
                logger.warning(f"dht.refresh_failed: {e!r:.200}")
    finally:
        shutdown_dht(dht)
        logger.info("dht.stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
