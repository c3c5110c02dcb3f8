"""The hostile client of the field soak: one process holding `identities` libp2p identities (a p2p daemon each) that,
until a wall-clock deadline, keeps as many sessions of `max_length` as every server it finds lets it open, holds them
with zero-token steps and opens again at once whatever is refused or ended (servers come and go under churn: the
view is refreshed from the DHT). Prints one `hoarder: {json}` line of counts at the end; it never decides pass or
fail. Run by `benchmarks.soak.churn` as `python -m benchmarks.soak.hoarder ...`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.field.hoarding import HoardStats, step_request
from benchmarks.soak.worker import wait_for_go
from corolla.cli.errors import exit_now

STATS_PREFIX = "hoarder: "
REFRESH_S = 2.0  # how often the view of the swarm is read again


async def hold_sessions(p2p: Any, peer_id: str, uid: str, max_length: int, hidden_size: int, deadline: float,
                        stats: HoardStats, keepalive_s: float) -> None:  # fmt: skip
    """One stream after another to one server until `deadline`: open with a zero-token step, hold with more."""
    from hivemind.p2p import PeerID

    from corolla.protocol.rpc import TransformerConnectionHandler

    stub = TransformerConnectionHandler.get_stub(p2p, PeerID.from_base58(peer_id))
    empty = torch.zeros(1, 0, hidden_size)  # [B, 0, H]
    while time.time() < deadline:
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(step_request(uid, empty, max_length=max_length))

        async def requests(queue: asyncio.Queue = queue) -> Any:
            while (item := await queue.get()) is not None:
                yield item

        opened = False
        try:
            responses = (await asyncio.wait_for(stub.rpc_inference(requests()), 20)).__aiter__()
            await asyncio.wait_for(responses.__anext__(), 20)
            opened = True
            stats.opened += 1
            while time.time() < deadline:
                await asyncio.sleep(keepalive_s)
                queue.put_nowait(step_request(uid, empty))
                await asyncio.wait_for(responses.__anext__(), 20)
        except Exception:  # refused, ended, or the server went away
            if opened:
                stats.ended += 1
            else:
                stats.refused += 1
            await asyncio.sleep(0.2)
        finally:
            queue.put_nowait(None)


async def run(args: argparse.Namespace) -> HoardStats:
    from hivemind.p2p import P2P

    from corolla.client.config import ClientConfig
    from corolla.client.routing.sequence_manager import RemoteSequenceManager
    from corolla.models.config import default_dht_prefix
    from corolla.protocol.uids import make_chain, make_uid

    model_config = json.loads((Path(args.model) / "config.json").read_text())
    num_blocks, hidden_size = int(model_config["num_hidden_layers"]), int(model_config["hidden_size"])
    from transformers import AutoConfig

    prefix = default_dht_prefix(args.model, AutoConfig.from_pretrained(args.model))
    config = ClientConfig(initial_peers=tuple(args.initial_peers), update_period_s=REFRESH_S, show_route="never")
    manager = RemoteSequenceManager(config, [make_uid(prefix, i) for i in range(num_blocks)])
    identities = [
        await P2P.create(
            initial_peers=args.initial_peers,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            nat_port_map=False,
            auto_nat=False,
            use_relay=False,
            use_auto_relay=False,
        )  # fmt: skip
        for _ in range(args.identities)
    ]
    stats = HoardStats()
    deadline = wait_for_go(args.go_file, args.go_timeout_s)
    holders: dict[tuple[int, str], asyncio.Task] = {}
    try:
        while time.time() < deadline:
            for span in manager.spans:
                uid = make_chain(prefix, span.start, span.end)
                for i, p2p in enumerate(identities):
                    for j in range(args.sessions_per_server):
                        key = (i * 1000 + j, span.peer_id)
                        if key not in holders or holders[key].done():
                            holders[key] = asyncio.create_task(hold_sessions(
                                p2p, span.peer_id, uid, args.max_length, hidden_size, deadline, stats,
                                args.keepalive_s,
                            ))  # fmt: skip
            await asyncio.sleep(REFRESH_S)
        await asyncio.wait(list(holders.values()), timeout=30)
    finally:
        for task in holders.values():
            task.cancel()
        for p2p in identities:
            with contextlib.suppress(Exception):
                await p2p.shutdown()
        manager.shutdown()
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--initial_peers", nargs="+", required=True)
    parser.add_argument("--go_file", type=Path, required=True, help="hoarding starts once this JSON file exists")
    parser.add_argument("--go_timeout_s", type=float, default=600.0)
    parser.add_argument("--identities", type=int, default=2)
    parser.add_argument("--sessions_per_server", type=int, default=2, help="per identity")
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--keepalive_s", type=float, default=1.0)
    args = parser.parse_args(argv)
    stats = asyncio.run(run(args))
    print(STATS_PREFIX + json.dumps(stats.__dict__), flush=True)
    return 0


if __name__ == "__main__":
    # at once: the harness waits for this process to exit, and torch's teardown would take seconds more
    exit_now(main())
