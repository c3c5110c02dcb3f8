"""A handler process's same-host socket says how many connections it serves in a load file beside it (clients pick
the less loaded of two sockets: `local_transport.SocketTurns`): 0 when it starts listening, counted up and
down as connections come and go, removed when it stops and by `remove_sockets`; a one-process server's socket has
none."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from corolla.protocol import local_stream as ls
from corolla.server.front.local_endpoint import LocalEndpoint


class _Handler:
    max_stream_bytes = 1 << 20

    async def serve_steps(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: object, port) -> None:
        async for _ in requests:
            port.reply(runtime_pb2.ExpertResponse())


PEER = PeerID(b"\x12\x20" + bytes(range(32)))


async def _until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    assert predicate()


async def _connect(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(str(path))
    hello = ls.LocalHello(rpc="rpc_inference", peer_id=PEER.to_base58())
    writer.writelines(ls.frame(ls.HELLO, hello.to_bytes()))
    assert (await ls.read_frame(reader, 1 << 16))[0] == ls.ACCEPT
    return reader, writer


async def _scenario(directory: Path) -> None:
    endpoint = LocalEndpoint(_Handler(), PEER, directory=directory, index=1)
    assert await endpoint.start() and endpoint.path is not None
    sock = endpoint.path
    assert ls.read_load(sock) == 0
    first = await _connect(sock)
    second = await _connect(sock)
    await _until(lambda: ls.read_load(sock) == 2)
    first[1].close()
    await _until(lambda: ls.read_load(sock) == 1)
    await endpoint.stop()
    assert not ls.load_path(sock).exists()
    second[1].close()
    lone = LocalEndpoint(_Handler(), PEER, directory=directory)  # a one-process server: one socket, no load file
    assert await lone.start() and lone.path is not None
    assert not ls.load_path(lone.path).exists()
    await lone.stop()
    again = LocalEndpoint(_Handler(), PEER, directory=directory, index=0)
    assert await again.start() and again.path is not None
    again.connections.server.close()  # type: ignore[union-attr]  # as a process that died: socket and file left
    assert ls.remove_sockets(PEER.to_base58(), directory) == 1
    assert not again.path.exists() and not ls.load_path(again.path).exists()
    await again.stop()  # nothing left to remove: quiet


def test_a_handler_socket_keeps_its_load_file_current_and_removes_it() -> None:
    with tempfile.TemporaryDirectory(prefix="cl-", dir="/tmp") as short:  # a unix socket path is short
        asyncio.run(_scenario(Path(short) / "sockets"))
