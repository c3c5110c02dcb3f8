"""Stopping a same-host socket endpoint with connections still open ends them quietly: asyncio (3.11) logs "Exception
in callback" with a traceback for a connection task that ends cancelled, which a server's log must not show at every
shutdown (`stream_endpoint.Connections`)."""

from __future__ import annotations

import asyncio
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from corolla.protocol import local_stream as ls
from corolla.server.front.local_endpoint import LocalEndpoint


class _Handler:
    """A session that answers each request (none comes: the client is idle when the endpoint stops)."""

    max_stream_bytes = 1 << 20

    async def serve_steps(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: object, port) -> None:
        async for _ in requests:
            port.reply(runtime_pb2.ExpertResponse())


def test_stop_ends_open_connections_without_a_logged_exception() -> None:
    with tempfile.TemporaryDirectory(prefix="cs-", dir="/tmp") as short:  # a unix socket path is short
        reported = asyncio.run(_serve_then_stop(Path(short)))
    assert reported == [], [c.get("message") for c in reported]


async def _serve_then_stop(tmp_path: Path) -> list[dict]:
    """Serves two open connections (one silent, one accepted and idle), stops; what the loop reported."""
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    directory = tmp_path / "sockets"
    peer = PeerID(b"\x12\x20" + bytes(range(32)))
    endpoint = LocalEndpoint(_Handler(), peer, directory=directory)
    assert await endpoint.start()
    assert endpoint.path is not None
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # connected, says nothing: waits for its hello
    silent.connect(str(endpoint.path))
    hello = ls.LocalHello(version=ls.LOCAL_STREAM_VERSION, rpc="rpc_inference", peer_id=peer.to_base58())
    reader, writer = await asyncio.open_unix_connection(str(endpoint.path))
    writer.writelines(ls.frame(ls.HELLO, hello.to_bytes()))  # accepted, then waits for its first request
    assert (await ls.read_frame(reader, 1 << 16))[0] == ls.ACCEPT
    for _ in range(100):
        if endpoint.num_open == 2:
            break
        await asyncio.sleep(0.01)
    assert endpoint.num_open == 2
    await endpoint.stop()
    await asyncio.sleep(0.05)  # the connection tasks' done callbacks run
    assert endpoint.num_open == 0 and endpoint.path is None
    silent.close()
    writer.close()
    return reported
