"""`python -m benchmarks.training.stream_cuts`: how often a streamed reply is lost in the transport, with no model.

One server peer answers `rpc_backward_stream` through the server's guarded stream handler (`stream_guard`, as a
corolla server registers it) with one tensor of `--reply_mb` at once; `--clients` peers (one process, each its own
p2pd) call it `--calls` times each with two tensors of `--request_mb`, reading replies as hivemind's stubs do. Counts
calls whose stream ended with no message and no error (what `remote_forward_backward` turns into a
`ConnectionError`), next to the streams the server's handler saw and answered: a lost reply the handler answered was
cut below the server's Python."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from corolla.protocol.codecs import serialize_tensor, stream_messages
from corolla.protocol.rpc import TransformerConnectionHandler
from corolla.server.core.limits import MiB, PeerLimits
from corolla.server.core.peer_bytes import StreamBudget
from corolla.server.front.stream_guard import register_handlers

_P2P_FLAGS = dict(nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
_LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
_NONE = runtime_pb2.CompressionType.NONE


@dataclass
class Counts:
    answered: int = 0  # calls with at least one reply message
    empty: int = 0  # calls whose stream ended with no message and no error
    failed: int = 0  # calls that raised
    server_streams: int = 0  # streams the server's handler saw
    server_answered: int = 0  # replies the server's handler yielded
    seconds: float = 0.0


class _Answering(TransformerConnectionHandler):
    """Reads the whole request, then answers one prepared tensor."""

    def __init__(self, reply: runtime_pb2.Tensor, counts: Counts):
        self.reply, self.counts = reply, counts

    async def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        self.counts.server_streams += 1
        async for _ in requests:
            pass
        self.counts.server_answered += 1
        for message in stream_messages(runtime_pb2.ExpertResponse, [self.reply]):
            yield message


async def measure(clients: int, calls: int, request_mb: float, reply_mb: float) -> Counts:
    counts = Counts()
    server = await P2P.create(host_maddrs=_LOOPBACK, **_P2P_FLAGS)
    reply = serialize_tensor(torch.zeros(int(reply_mb * MiB) // 2, dtype=torch.bfloat16), _NONE)  # [n] bf16
    budget = StreamBudget(PeerLimits().with_stream_defaults(int(4 * max(request_mb, reply_mb) * MiB)))
    await register_handlers(_Answering(reply, counts), server, budget, lambda name, error: None)
    maddrs = await server.get_visible_maddrs()
    part = serialize_tensor(torch.zeros(int(request_mb * MiB) // 2, dtype=torch.bfloat16), _NONE)  # [n] bf16

    async def client() -> None:
        p2p = await P2P.create(initial_peers=maddrs, host_maddrs=_LOOPBACK, **_P2P_FLAGS)
        stub = _Answering.get_stub(p2p, server.peer_id)
        try:
            for _ in range(calls):

                async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
                    for message in stream_messages(runtime_pb2.ExpertRequest, [part, part], uid="x.0"):
                        yield message

                try:
                    replies = [response async for response in await stub.rpc_backward_stream(requests())]
                except Exception:
                    counts.failed += 1
                    continue
                if replies:
                    counts.answered += 1
                else:
                    counts.empty += 1
        finally:
            await p2p.shutdown()

    started = time.monotonic()
    try:
        await asyncio.gather(*(client() for _ in range(clients)))
    finally:
        await server.shutdown()
    counts.seconds = time.monotonic() - started
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--calls", type=int, default=300, help="calls per client")
    parser.add_argument("--request_mb", type=float, default=0.0625, help="each of a request's two tensors, MiB")
    parser.add_argument("--reply_mb", type=float, default=4.0)
    args = parser.parse_args(argv)
    counts = asyncio.run(measure(args.clients, args.calls, args.request_mb, args.reply_mb))
    print(json.dumps(asdict(counts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
