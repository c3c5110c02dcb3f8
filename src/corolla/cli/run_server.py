"""`corolla-server MODEL`: parse flags (the reference `run_server` names and defaults, config files, `COROLLA_*`
environment variables), build a `Server`, run it until SIGINT/SIGTERM and shut it down cleanly."""

from __future__ import annotations

import argparse
import resource
import signal
import sys
from collections.abc import Sequence
from typing import Any

import configargparse

from corolla.cli.errors import (
    add_common_flags,
    check_initial_peers,
    check_model_argument,
    check_port_free,
    exit_now,
    run_cli,
)
from corolla.server.config import COMPRESSION_NAMES, QUANT_TYPE_NAMES, TORCH_DTYPE_NAMES, ServerConfig
from corolla.server.core.limits import add_limit_flags
from corolla.server.server import Server
from corolla.server.startup_checks import check_settings
from corolla.utils.errors import ConfigurationError
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

ENV_PREFIX = "COROLLA_"


def build_parser() -> configargparse.ArgParser:
    parser = configargparse.ArgParser(
        prog="corolla-server",
        description="Serve a span of a model's blocks in a Petals-compatible swarm.",
        default_config_files=["config.yml"],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        auto_env_var_prefix=ENV_PREFIX,
    )
    parser.add("-c", "--config", required=False, is_config_file=True, help="config file (YAML) with the same keys")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add("model", nargs="?", default=None, help="model name on the Hugging Face Hub or local path")
    group.add("--converted_model_name_or_path", default=None, help="same as the positional model argument")

    parser.add("--public_name", default=None, help="name shown on the swarm's health monitor")
    token = parser.add_mutually_exclusive_group()
    token.add("--token", default=None, help="Hugging Face Hub token for gated models")
    token.add("--use_auth_token", action="store_true", help="use the token saved by `huggingface-cli login`")

    parser.add("--num_blocks", type=int, default=None, help="number of consecutive blocks to serve (auto if unset)")
    parser.add("--block_indices", default=None, help="fixed range start:end (end exclusive); disables rebalancing")
    parser.add("--dht_prefix", default=None, help="prefix of block uids (model-specific by default)")

    parser.add("--port", type=int, default=None, help="listen on all interfaces at this port (0 = random)")
    parser.add("--public_ip", default=None, help="announce this IPv4 address (needs --port)")
    parser.add("--no_auto_relay", action="store_false", dest="use_auto_relay", help="don't look for libp2p relays")
    parser.add("--host_maddrs", nargs="+", default=None, help="multiaddrs to listen on")
    parser.add("--announce_maddrs", nargs="+", default=None, help="multiaddrs to advertise")
    parser.add("--daemon_startup_timeout", type=float, default=60, help="seconds to wait for the p2p daemon")

    parser.add("--compression", type=str.upper, default="NONE", choices=COMPRESSION_NAMES, help="output compression")
    parser.add("--num_handlers", type=int, default=1, help="processes serving p2p streams (1: the server's own loop)")
    parser.add("--prefetch_batches", type=int, default=1, help="accepted, no effect (Petals compatibility)")
    parser.add("--sender_threads", type=int, default=1, help="accepted, no effect (Petals compatibility)")
    parser.add("--inference_max_length", type=int, default=None, help="max KV length per session (8192 GQA/2048)")
    parser.add("--min_batch_size", type=int, default=1, help="accepted, no effect (Petals compatibility)")
    parser.add("--max_batch_size", type=int, default=None, help="max tokens (batch x length) per task (8192/2048)")
    parser.add("--max_chunk_size_bytes", type=int, default=256 * 1024 * 1024, help="attention chunk budget")
    parser.add("--attn_cache_tokens", type=int, default=None, help="KV cache budget in tokens per block (16384/4096)")
    parser.add("--cache_dir", default=None, help="cache for weights, throughput figures and locks")
    parser.add("--max_disk_space", default=None, help="cap on the cache dir size, e.g. 50GB or 100GiB")
    parser.add("--device", default=None, help="torch device (cuda, mps or cpu by default)")
    parser.add("--torch_dtype", default="auto", choices=TORCH_DTYPE_NAMES, help="block dtype")
    parser.add("--max_alloc_timeout", type=float, default=600, help="max seconds a session may wait for KV cache")
    parser.add("--revision", default=None, help="model revision on the Hub")
    parser.add(
        "--throughput",
        default="auto",
        help="tokens/s for placement, or auto (measure once), eval (re-measure), dry_run; the step rates announced are "
        "measured from the steps served either way",
    )
    parser.add("--update_period", type=float, default=120, help="seconds between DHT announcements")
    parser.add("--expiration", type=float, default=None, help="TTL of DHT records (default max(2 x period, 3))")
    parser.add("--request_timeout", type=float, default=180, help="timeout of forward/backward and pushes")
    parser.add("--session_timeout", type=float, default=1800, help="timeout of a whole inference session")
    parser.add("--step_timeout", type=float, default=300, help="max wait for the next inference step")
    peers = parser.add_mutually_exclusive_group()
    peers.add("--initial_peers", nargs="*", default=None, help="multiaddrs of peers to join (public swarm if unset)")
    peers.add("--new_swarm", action="store_true", help="start a new private swarm and print its address")
    parser.add(
        "--direct_port",
        type=int,
        default=None,
        help="also serve corolla clients' inference streams on this TCP port (0: any free port): a ticket over p2p, "
        "then sealed frames, skipping both p2pd daemons; forward it like --port. Off by default",
    )
    parser.add(
        "--direct_host",
        default=None,
        help="the IP address clients reach the direct port at (default: the IP of --announce_maddrs / --public_ip, "
        "or of --host_maddrs unless that is a wildcard)",
    )
    parser.add(
        "--no_local_socket",
        action="store_false",
        dest="local_socket",
        help="don't serve same-host corolla clients over a unix socket (they use p2p like everyone else)",
    )
    parser.add(
        "--busy_poll_ms",
        type=float,
        default=5.0,
        help="after a lone session's GPU step (with --num_handlers N > 1: after every message a handler process of a "
        "GPU server handles), poll this long for the next request instead of sleeping (0 = never)",
    )
    parser.add(
        "--drain_timeout_s",
        type=float,
        default=5.0,
        help="on SIGTERM or a move: announce OFFLINE and wait this long for open sessions to move (0 = cut at once)",
    )
    parser.add(
        "--no_kv_handoff",
        action="store_false",
        dest="kv_handoff",
        help="never export a draining session's KV cache nor import one (clients replay their history instead)",
    )
    parser.add(
        "--prefix_cache_shared",
        action="store_true",
        help="private swarms: let every client reuse prefixes other clients computed (by default a session reuses only "
        "its own client's cached prefixes: a client that computed one wrongly can harm only itself)",
    )
    parser.add(
        "--prefix_cache_tokens",
        type=int,
        default=None,
        help="cap on cached prefixes no session holds, in positions per block (default: every free page of the KV "
        "cache; 0 keeps none once their sessions end); past it the least recently used are evicted",
    )
    parser.add("--metrics_port", type=int, default=None, help="serve Prometheus metrics on 127.0.0.1:<port>")
    parser.add("--increase_file_limit", type=int, default=4096, help="raise RLIMIT_NOFILE to this (0 = keep)")
    parser.add("--stats_report_interval", type=float, default=None, help="log runtime stats every N seconds")
    parser.add("--custom_module_path", default=None, help="legacy hivemind option (ignored)")
    parser.add("--identity_path", default=None, help="libp2p private key file (stable peer id)")
    parser.add(
        "--balance_quality", type=float, default=0.75,
        help="Petals' flag: 0 turns rebalancing off; other values are accepted and not used (corolla's moves weigh "
        "their gain against the reload)",
    )  # fmt: skip
    parser.add("--mean_balance_check_period", type=float, default=60, help="mean seconds between balance checks")
    parser.add("--mean_block_selection_delay", type=float, default=5, help="mean random delay before choosing blocks")
    parser.add(
        "--quant_type",
        type=str.lower,
        default=None,
        choices=QUANT_TYPE_NAMES,
        help="default: nf4 on CUDA with bitsandbytes, else none",
    )
    parser.add("--tensor_parallel_devices", nargs="+", default=None, help="split every block across these devices")
    parser.add("--skip_reachability_check", action="store_true", help="skip the public reachability check")
    parser.add("--adapters", nargs="*", default=(), help="LoRA adapters to pre-load")
    add_limit_flags(parser)  # fair-use limits: --max_sessions_per_peer, --max_kv_fraction_per_peer, ...
    add_common_flags(parser, swarm=True)
    return parser


def parse_config(argv: Sequence[str] | None = None) -> ServerConfig:
    """Parses CLI flags (+ config files + environment) into a `ServerConfig`; bad combinations exit with a message."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    args.pop("config", None)
    args.pop("verbose", None)  # cli.errors reads it from argv
    use_auth_token = args.pop("use_auth_token")
    if use_auth_token:
        args["token"] = True
    if args.get("initial_peers") == []:
        args["initial_peers"] = ()
    model = args.pop("model")
    if model is not None:
        args["converted_model_name_or_path"] = model
    try:
        return ServerConfig.from_flags(args)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def increase_file_limit(limit: int) -> None:
    if limit <= 0:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new_hard = hard if hard == resource.RLIM_INFINITY or hard >= limit else limit
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(limit, new_hard)), new_hard))
    except (ValueError, OSError) as e:
        logger.warning(f"increase_file_limit.failed(limit={limit}): {e}")


def preflight(config: ServerConfig) -> None:
    """Mistakes found before anything slow starts (ConfigurationError, exit 2): a malformed `--initial_peers`, a local
    model path that is not there, a taken `--port` / `--host_maddrs` port (p2pd would silently come up on the other
    address family only) or `--metrics_port`."""
    check_initial_peers(config.initial_peers)
    check_model_argument(config.model_name_or_path)
    check_settings(config)  # a device, quantization or dtype that cannot run here (before anything slow starts)
    for maddr in config.resolved_host_maddrs:
        parts = maddr.split("/")  # /ip4/HOST/tcp/PORT
        if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp" and parts[4].isdigit():
            flag = "--port" if config.port is not None else "--host_maddrs"
            check_port_free(parts[2], int(parts[4]), flag=flag)
    if config.metrics_port:
        check_port_free("127.0.0.1", config.metrics_port, flag="--metrics_port")
    try:
        direct = config.resolved_direct()
    except ValueError as e:
        raise ConfigurationError(str(e)) from None
    if direct is not None:
        check_port_free(direct.bind_host, direct.port, flag="--direct_port")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: a mistake ends with one line on stderr and exit code 2 (1 for runtime failures). Run from
    the command line (argv None), the process exits right after the shutdown: the interpreter's teardown of torch
    and hivemind took ~4 s more after a SIGTERM."""
    code = run_cli("corolla-server", lambda: _main(argv), argv)
    if argv is None:
        exit_now(code)
    return code


def _main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    preflight(config)
    increase_file_limit(config.increase_file_limit)

    try:
        server = Server(config)
    except (ValueError, OSError) as e:  # bad settings (CPU + float16, blocks past the depth), unloadable model
        logger.debug(f"server.bad_settings: {e}")  # the one line on stderr is the print below
        print(f"corolla-server: error: {e}", file=sys.stderr, flush=True)
        return 2
    if config.throughput == "dry_run":
        return server.run()  # measures, prints the figures and returns: no swarm, no signal handlers

    stop_reason: dict[str, Any] = {}

    def _on_signal(signum: int, _frame: Any) -> None:
        stop_reason.setdefault("signal", signal.Signals(signum).name)
        server.request_stop()

    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return server.run()  # a ConfigurationError found while loading (a checkpoint missing offline): run_cli's line
    except KeyboardInterrupt:
        return 0
    finally:
        server.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if "signal" in stop_reason:
            logger.info(f"server.stopped(signal={stop_reason['signal']})")
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
