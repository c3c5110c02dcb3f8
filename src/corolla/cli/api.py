"""`corolla-api`: an OpenAI- and vLLM-compatible HTTP gateway (`/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/health`, `/version`, `/tokenize`, `/detokenize`, `/metrics`) in front of a swarm serving one model.
Listens on 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
from collections.abc import Sequence

import configargparse

from corolla.api.app import ApiConfig, create_app
from corolla.api.backend import default_model_id, load_swarm_backend
from corolla.api.serving import http_cli_parser, serve_until_signalled
from corolla.cli.errors import (
    add_common_flags,
    check_initial_peers,
    check_model_argument,
    check_port_free,
    exit_now,
    run_cli,
)
from corolla.cli.speculative_flags import add_speculative_flags, speculative_config
from corolla.client.speculative.acceptance import SpeculativeConfig
from corolla.models.config import load_config
from corolla.swarm.local import LocalSwarm, LocalSwarmConfig, even_block_ranges

# integer flags named as the ApiConfig fields they set (defaults: ApiConfig's), with their help
API_CONFIG_INT_FLAGS = {
    "max_concurrent_requests": "generations at once",
    "max_queued_requests": "requests that may wait for a generation thread; past them: 429 with Retry-After",
    "max_requests_per_client": "requests running or waiting from one non-loopback address; past them: 429",
    "retry_after_s": "the Retry-After (seconds) of a 429",
    "default_chat_max_tokens": "max_tokens of a chat request that sets none (at most the context left)",
    "max_n": "most choices per request (`n`); more: 400",
    "max_logprobs": "most `logprobs`/`top_logprobs` per token",
    "route_log_entries": "generations whose servers /corolla/route (and the chat page at /) can show; 0 = none",
    "max_request_bytes": "larger bodies get 413, unread (1 MiB)",
}


def build_parser() -> configargparse.ArgParser:
    parser = http_cli_parser(
        "corolla-api", "Serve an OpenAI-compatible API for a model hosted by a corolla/Petals swarm.", default_port=8000
    )
    parser.add_argument("--model", required=True, help="Hugging Face repo or local path of the model (client part)")
    swarm = parser.add_mutually_exclusive_group(required=True)
    swarm.add_argument("--initial_peers", nargs="+", help="multiaddrs of peers of an existing swarm")
    swarm.add_argument(
        "--new_swarm",
        type=int,
        metavar="NUM_SERVERS",
        help="local mode: start a private loopback swarm of this many servers splitting the model's blocks",
    )
    parser.add_argument(
        "--server_args", default="", help="extra corolla-server arguments for --new_swarm, as one quoted string"
    )
    parser.add_argument("--dht_prefix", default=None, help="DHT prefix of the model's blocks (default: from --model)")
    parser.add_argument(
        "--served_model_name",
        nargs="+",
        default=[],
        help="names clients use in `model`, the first one reported in responses (default: the basename of a local "
        "--model directory, else --model itself); the --model value is accepted too",
    )
    parser.add_argument(
        "--api_key",
        default=os.environ.get("COROLLA_API_KEY"),
        help="require `Authorization: Bearer <key>` (default: $COROLLA_API_KEY; unset = no key)",
    )
    for name, help_text in API_CONFIG_INT_FLAGS.items():
        parser.add_argument(f"--{name}", type=int, default=getattr(ApiConfig, name), help=help_text)
    parser.add_argument(
        "--max_retries", type=int, default=3, help="client fail-over retries before a request fails (503)"
    )
    parser.add_argument("--torch_dtype", default="float32", help="dtype of the local embeddings and LM head")
    add_speculative_flags(parser)
    add_common_flags(parser, swarm=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """A mistake (taken port, bad peers, missing model directory) ends with one line on stderr and exit code 2 or 1.
    Exits at once when done (the model is shut down by then; torch's teardown would delay a swarm's stop by seconds)."""
    return exit_now(run_cli("corolla-api", lambda: _main(argv), argv))


def _main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    speculative = speculative_config(args)  # a bad combination fails before anything starts
    check_port_free(args.host, args.port)  # before the slow part: uvicorn would only fail after the model loaded
    check_initial_peers(args.initial_peers)
    check_model_argument(args.model)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM during start-up also unwinds (stops the swarm)
    with contextlib.ExitStack() as stack:
        initial_peers = args.initial_peers
        if args.new_swarm is not None:
            server_args = tuple(shlex.split(args.server_args))
            config = LocalSwarmConfig(server_args=server_args, startup_timeout_s=180.0, stop_grace_s=10.0)
            swarm = stack.enter_context(LocalSwarm(config))
            swarm.start(args.model, even_block_ranges(load_config(args.model).num_hidden_layers, args.new_swarm))
            initial_peers = swarm.initial_peers
            print(f"corolla-api: started a local swarm; its initial peers: {' '.join(initial_peers)}", flush=True)
        serve(args, initial_peers, speculative)
    return 0


def serve(args: argparse.Namespace, initial_peers: Sequence[str], speculative: SpeculativeConfig | None = None) -> None:
    names = list(args.served_model_name) or [default_model_id(args.model)]
    backend = load_swarm_backend(
        args.model, initial_peers=initial_peers, dht_prefix=args.dht_prefix, model_id=names[0],
        max_retries=args.max_retries, torch_dtype=args.torch_dtype, swarm_key_file=args.swarm_key_file,
    )  # fmt: skip
    flags = {name: getattr(args, name) for name in ("api_key", *API_CONFIG_INT_FLAGS)}
    config = ApiConfig(
        **flags, model_aliases=tuple(names[1:]), unlisted_model_names=(str(args.model),), speculative=speculative
    )
    try:
        banner = f"corolla-api: serving {names[0]} at {{url}}/v1"
        serve_until_signalled(create_app(backend, config), host=args.host, port=args.port, banner=banner)
    finally:
        backend.model.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
