"""Stock Petals 2.2 on loopback, shared by the two scripts that the Petals venv's interpreter runs: `petals_side.py`
(`python -m benchmarks.wan`) and `tests/interop/petals_driver.py` (the interop tests). It imports nothing of corolla (the
Petals venv has no corolla), so both load it by its path.

`serve` runs petals' own `Server` until SIGTERM and prints one ready line, `<prefix> peer_id=<id> blocks=<a>:<b>
maddrs=<visible multiaddrs...>`; `loopback_client_dht` makes petals' client create its DHT the same way. Every DHT
listens on 127.0.0.1 only, with relays, AutoNAT and NAT port mapping off."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

os.environ.setdefault("PETALS_IGNORE_DEPENDENCY_VERSION", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

LOOPBACK = dict(use_relay=False, use_auto_relay=False, nat_port_map=False, auto_nat=False)
READY_POLL_S = 0.1


def add_server_args(
    parser: argparse.ArgumentParser, *, inference_max_length: int, ready_timeout_s: float
) -> argparse.ArgumentParser:
    """The `server` command's flags; the two callers differ only in these defaults."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--dht_prefix", required=True)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--block_indices")
    where.add_argument("--num_blocks", type=int)
    parser.add_argument("--initial_peers", nargs="*", default=[])
    parser.add_argument("--host_port", type=int, default=0, help="TCP port on 127.0.0.1 (0: any free one)")
    parser.add_argument("--announce_port", type=int, default=None, help="announce this port instead (a proxy's)")
    parser.add_argument("--cache_dir", default=None)
    parser.add_argument("--torch_dtype", default="float32")
    parser.add_argument("--compression", default="NONE")
    parser.add_argument("--update_period", type=float, default=5.0)
    parser.add_argument("--inference_max_length", type=int, default=inference_max_length)
    parser.add_argument("--ready_timeout_s", type=float, default=ready_timeout_s)
    return parser


def serve(args: argparse.Namespace, ready_prefix: str) -> int:
    """Serves `--block_indices` (or petals' own choice of `--num_blocks`) of `--model` with petals' own Server class
    until SIGTERM; 1 if it is not ready within `--ready_timeout_s`."""
    import torch
    from hivemind.proto.runtime_pb2 import CompressionType
    from petals.server.server import Server

    torch.set_num_threads(1)
    announce = {}
    if args.announce_port is not None:
        announce["announce_maddrs"] = [f"/ip4/127.0.0.1/tcp/{args.announce_port}"]
    server = Server(
        initial_peers=args.initial_peers,
        dht_prefix=args.dht_prefix,
        converted_model_name_or_path=args.model,
        block_indices=args.block_indices,
        num_blocks=args.num_blocks,
        throughput=1.0,  # a float skips the speedtest (network) and the compute benchmark
        device="cpu",
        torch_dtype=args.torch_dtype,
        compression=getattr(CompressionType, args.compression),
        num_handlers=2,
        update_period=args.update_period,
        mean_block_selection_delay=0.2,
        inference_max_length=args.inference_max_length,
        cache_dir=args.cache_dir,
        skip_reachability_check=True,
        reachable_via_relay=False,  # a full DHT peer; also skips the reachability probe
        host_maddrs=[f"/ip4/127.0.0.1/tcp/{args.host_port}"],
        **announce,
        **LOOPBACK,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    thread = threading.Thread(target=server.run, name="petals-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + args.ready_timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        container = server.module_container
        if container is not None and container.ready.is_set():
            break
        time.sleep(READY_POLL_S)
    else:
        print(f"{ready_prefix.split(':')[0]}: server not ready in time", flush=True)
        server.shutdown()
        return 1
    maddrs = " ".join(str(a) for a in server.dht.get_visible_maddrs())
    blocks = sorted(int(uid.rsplit(".", 1)[1]) for uid in server.module_container.module_backends)
    print(
        f"{ready_prefix} peer_id={server.dht.peer_id} blocks={blocks[0]}:{blocks[-1] + 1} maddrs={maddrs}", flush=True
    )
    stop.wait()
    server.shutdown()
    thread.join(10)
    return 0


def loopback_client_dht() -> None:
    """Makes petals' client create its DHT on 127.0.0.1 with no relay/NAT traffic (its API does not expose these)."""
    import petals.client.routing.sequence_manager as sequence_manager

    class LoopbackDHT(sequence_manager.DHT):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "host_maddrs": ["/ip4/127.0.0.1/tcp/0"], **LOOPBACK})

    sequence_manager.DHT = LoopbackDHT
