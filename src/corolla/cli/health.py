"""`corolla-health`: a web page and JSON API (`/api/v1/state`, shaped like health.petals.dev's) showing which
servers hold which blocks of each model in a swarm, private swarms included. Listens on 127.0.0.1 by default."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import configargparse

from corolla.api.serving import http_cli_parser, serve_until_signalled
from corolla.cli.errors import (
    add_common_flags,
    check_initial_peers,
    check_model_argument,
    check_port_free,
    exit_now,
    run_cli,
)
from corolla.health.app import create_app
from corolla.health.collector import HealthConfig, StateCollector
from corolla.health.state import ModelEntry
from corolla.models.config import default_dht_prefix, is_local_path, load_config
from corolla.swarm.dht import SwarmConfig, create_dht, shutdown_dht
from corolla.swarm.membership import load_swarm_key
from corolla.swarm.records_io import get_verified_model_infos
from corolla.utils.errors import ConfigurationError


def build_parser() -> configargparse.ArgParser:
    parser = http_cli_parser(
        "corolla-health",
        "Monitor a corolla/Petals swarm: block coverage and servers of each model, as a page and JSON.",
        default_port=8090,
    )
    parser.add_argument("--initial_peers", nargs="+", required=True, help="multiaddrs of peers of the swarm")
    parser.add_argument(
        "--model", nargs="*", default=[], help="models to watch (repo or local path; prefix and blocks from its config)"
    )
    parser.add_argument(
        "--dht_prefix",
        nargs="*",
        default=[],
        help="DHT prefixes to watch, as PREFIX:NUM_BLOCKS (or PREFIX alone if it is in the swarm's model index)",
    )
    parser.add_argument(
        "--no_models_index", action="store_true", help="watch only --model/--dht_prefix, not every announced model"
    )
    parser.add_argument("--refresh_period", type=float, default=30.0, help="seconds between state refreshes")
    parser.add_argument("--ping_timeout", type=float, default=3.0, help="seconds before a server counts as unreachable")
    parser.add_argument("--no_reachability", action="store_true", help="do not ping servers")
    add_common_flags(parser, swarm=True)
    return parser


def model_entry_from_model(name_or_path: str) -> ModelEntry:
    config = load_config(name_or_path)
    repository = None if is_local_path(name_or_path) else f"https://huggingface.co/{name_or_path}"
    return ModelEntry(
        dht_prefix=default_dht_prefix(name_or_path, config),
        num_blocks=int(config.num_hidden_layers),
        repository=repository,
    )


def model_entries(args: argparse.Namespace, dht) -> list[ModelEntry]:
    entries = [model_entry_from_model(m) for m in args.model]
    index = None
    for spec in args.dht_prefix:
        prefix, _, num_blocks = spec.rpartition(":") if ":" in spec else (spec, "", "")
        if num_blocks:
            entries.append(ModelEntry(dht_prefix=prefix, num_blocks=int(num_blocks)))
            continue
        if index is None:
            index = get_verified_model_infos(dht)
        if spec not in index:
            served = ", ".join(sorted(index)) or "none"
            raise ConfigurationError(
                f"--dht_prefix {spec!r} is not in the swarm's model index (it has: {served}); "
                f"pass it as {spec}:NUM_BLOCKS"
            )
        entries.append(
            ModelEntry(dht_prefix=spec, num_blocks=index[spec].num_blocks, repository=index[spec].repository)
        )
    return entries


def main(argv: Sequence[str] | None = None) -> int:
    """A mistake (taken port, bad or unreachable peers) ends with one line on stderr and exit code 2 or 1. Exits at
    once when done (the DHT is shut down by then; torch's teardown would delay a swarm's stop by seconds)."""
    return exit_now(run_cli("corolla-health", lambda: _main(argv), argv))


def _main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_port_free(args.host, args.port)  # before joining the swarm
    check_initial_peers(args.initial_peers)
    for model in args.model:
        check_model_argument(model)
    # the DHT forks: create it before any thread starts
    swarm_key = load_swarm_key(args.swarm_key_file)
    dht = create_dht(SwarmConfig(initial_peers=list(args.initial_peers), client_mode=True, swarm_key=swarm_key))
    try:
        config = HealthConfig(
            refresh_period_s=args.refresh_period,
            ping_timeout_s=args.ping_timeout,
            check_reachability=not args.no_reachability,
            use_models_index=not args.no_models_index,
            initial_peers=tuple(args.initial_peers),
        )
        with StateCollector(dht, model_entries(args, dht), config) as collector:
            serve_until_signalled(
                create_app(collector), host=args.host, port=args.port, banner="corolla-health: serving at {url}/"
            )
    finally:
        shutdown_dht(dht)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
