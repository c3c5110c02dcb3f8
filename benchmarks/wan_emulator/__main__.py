"""`python -m benchmarks.wan_emulator --listen 127.0.0.1:9000 --target 127.0.0.1:31337 --delay_ms 25`: one WAN proxy in front of
one server until SIGINT/SIGTERM. Start the server with `--announce_maddrs /ip4/127.0.0.1/tcp/<listen port>` (and
`--host_maddrs /ip4/127.0.0.1/tcp/<target port>`) so that every peer reaches it through the proxy."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from benchmarks.wan_emulator.config import LinkConfig
from benchmarks.wan_emulator.proxy import WanProxy
from corolla.utils.logging import get_logger

logger = get_logger(__name__)
READY_PREFIX = "corolla-wan: listening on "


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port in [0, 65535], got {text!r}")
    return host, int(port)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wan_emulator", description=__doc__)
    p.add_argument("--listen", type=_host_port, default=("127.0.0.1", 0), help="HOST:PORT to listen on (port 0: any)")
    p.add_argument("--target", type=_host_port, required=True, help="HOST:PORT of the server behind the proxy")
    p.add_argument("--delay_ms", type=float, default=0.0, help="one-way delay added in each direction")
    p.add_argument("--jitter_ms", type=float, default=0.0, help="extra delay per chunk, uniform in [0, jitter_ms]")
    p.add_argument("--bandwidth_bytes_per_s", type=float, default=None, help="token-bucket rate cap per direction")
    p.add_argument(
        "--reply_bandwidth_bytes_per_s", type=float, default=None, help="server->client cap (default: the same)"
    )
    p.add_argument("--burst_bytes", type=int, default=64 * 1024, help="token-bucket size")
    p.add_argument("--stall_probability", type=float, default=0.0, help="chance per chunk of a retransmission stall")
    p.add_argument("--stall_ms", type=float, default=200.0, help="how long a stall holds the direction")
    p.add_argument("--max_in_flight_bytes", type=int, default=4 << 20, help="back-pressure bound per direction")
    p.add_argument("--seed", type=int, default=None, help="seed of the jitter and stall draws")
    return p.parse_args(argv)


async def _serve(args: argparse.Namespace) -> None:
    config = LinkConfig(
        delay_ms=args.delay_ms,
        jitter_ms=args.jitter_ms,
        bandwidth_bytes_per_s=args.bandwidth_bytes_per_s,
        reply_bandwidth_bytes_per_s=args.reply_bandwidth_bytes_per_s,
        burst_bytes=args.burst_bytes,
        stall_probability=args.stall_probability,
        stall_ms=args.stall_ms,
        max_in_flight_bytes=args.max_in_flight_bytes,
        seed=args.seed,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    proxy = WanProxy(
        target_host=args.target[0],
        target_port=args.target[1],
        listen_host=args.listen[0],
        listen_port=args.listen[1],
        config=config,
    )
    async with proxy:
        print(f"{READY_PREFIX}{proxy.address} target={args.target[0]}:{args.target[1]}", flush=True)
        await stop.wait()
    print(f"corolla-wan: stopped {proxy.stats}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        asyncio.run(_serve(args))
    except ValueError as e:
        print(f"corolla-wan: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"corolla-wan: cannot listen on {args.listen[0]}:{args.listen[1]}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
