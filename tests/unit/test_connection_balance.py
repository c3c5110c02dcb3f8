"""Direct-port connections placed by load over handler processes (`server.connection_balance`): the shared table
counts a placement where it goes (so a burst of accepts spreads instead of all landing on the process that looked
least loaded), a connection accepted by a busier process arrives, unread, at the least loaded one and works there,
a hand-off that cannot be sent stays, and what arrives on a hand-off socket that is not a TCP connection is closed."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from pathlib import Path

import pytest

from corolla.server.front.connection_balance import (
    TABLE_NAME,
    BalanceDirectory,
    ConnectionHandoff,
    LoadTable,
    inbox_path,
    send_descriptors,
)


def test_table_places_on_the_least_loaded_and_counts_there(tmp_path: Path) -> None:
    with LoadTable.create(tmp_path / "t", 4) as table:
        assert table.counts() == [0, 0, 0, 0]
        assert [table.place(own=2) for _ in range(3)] == [2, 0, 1]  # ties stay; then the first least loaded
        assert table.counts() == [1, 1, 1, 0]
        assert table.place(own=0) == 3
        assert table.place(own=1) == 1  # all equal again: stays
        table.release(1)
        table.move(0, 2)
        assert table.counts() == [0, 1, 2, 1]
        table.reset(2)
        assert table.counts() == [0, 1, 0, 1]
        table.release(0)  # never below zero
        assert table.counts() == [0, 1, 0, 1]
        with pytest.raises(ValueError, match="outside"):
            table.place(own=4)


def test_a_burst_of_accepts_at_one_process_spreads_evenly(tmp_path: Path) -> None:
    """64 connections all accepted by process 0 of 4 (the kernel's worst draw): each placement sees the ones before."""
    with LoadTable.create(tmp_path / "t", 4) as table, LoadTable(tmp_path / "t") as other_process:
        for _ in range(64):
            table.place(own=0)
        assert other_process.counts() == [16, 16, 16, 16]


def test_tables_of_bad_sizes_are_refused(tmp_path: Path) -> None:
    for size in (0, 3, 4 * 1025):
        (tmp_path / f"t{size}").write_bytes(b"\0" * size)
        with pytest.raises(ValueError, match="slots"):
            LoadTable(tmp_path / f"t{size}")
    (tmp_path / "exists").write_bytes(b"\0" * 8)
    with pytest.raises(FileExistsError):
        LoadTable.create(tmp_path / "exists", 2)
    os.symlink(tmp_path / "t0", tmp_path / "link")
    with pytest.raises(OSError):
        LoadTable(tmp_path / "link")


def test_balance_directory_is_private_and_removed() -> None:
    with BalanceDirectory(3) as balance:
        path = balance.path
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        assert stat.S_IMODE((path / TABLE_NAME).stat().st_mode) == 0o600
        with LoadTable(path / TABLE_NAME) as table:
            assert table.num_slots == 3
    assert not path.exists()


async def _accepted_pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    loop = asyncio.get_running_loop()
    client = socket.socket()
    client.setblocking(False)
    await loop.sock_connect(client, listener.getsockname())
    conn, _ = await loop.sock_accept(listener)
    return client, conn


def test_connection_from_a_busier_process_arrives_unread_and_works(tmp_path: Path) -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        with BalanceDirectory(2) as balance:
            arrived: list[socket.socket] = []
            got_one = asyncio.Event()
            busy, idle = ConnectionHandoff(balance.path, 0), ConnectionHandoff(balance.path, 1)
            busy.start(lambda conn: arrived.append(conn))
            idle.start(lambda conn: (arrived.append(conn), got_one.set()))
            listener = socket.create_server(("127.0.0.1", 0))
            listener.setblocking(False)
            try:
                client1, conn1 = await _accepted_pair(listener)
                assert busy.place(conn1)  # 0 vs 0: stays
                client2, conn2 = await _accepted_pair(listener)
                await loop.sock_sendall(client2, b"hello before the hand-off")
                assert not busy.place(conn2)  # 1 vs 0: goes to process 1
                assert conn2.fileno() == -1  # closed here
                await asyncio.wait_for(got_one.wait(), 5)
                (moved,) = arrived
                assert moved.getpeername() == client2.getsockname()
                assert await loop.sock_recv(moved, 100) == b"hello before the hand-off"  # nothing was read
                await loop.sock_sendall(moved, b"served by 1")
                assert await loop.sock_recv(client2, 100) == b"served by 1"
                assert busy.table.counts() == [1, 1] and (busy.sent, idle.received) == (1, 1)
                idle.release()
                busy.release()
                assert busy.table.counts() == [0, 0]
                for s in (client1, conn1, client2, moved):
                    s.close()
            finally:
                listener.close()
                busy.close()
                idle.close()
            assert not inbox_path(balance.path, 0).exists() and not inbox_path(balance.path, 1).exists()

    asyncio.run(go())


def test_a_handoff_that_cannot_be_sent_stays(tmp_path: Path) -> None:
    async def go() -> None:
        with BalanceDirectory(2) as balance:
            own = ConnectionHandoff(balance.path, 0)  # process 1 never started: no socket to send to
            own.start(lambda conn: None)
            listener = socket.create_server(("127.0.0.1", 0))
            listener.setblocking(False)
            try:
                pairs = [await _accepted_pair(listener) for _ in range(2)]
                assert own.place(pairs[0][1]) and own.place(pairs[1][1])
                assert own.table.counts() == [2, 0] and own.sent == 0
                assert pairs[1][1].fileno() != -1
            finally:
                for client, conn in pairs:
                    client.close()
                    conn.close()
                listener.close()
                own.close()

    asyncio.run(go())


def test_what_is_not_a_tcp_connection_is_closed_on_arrival(tmp_path: Path) -> None:
    async def go() -> None:
        with BalanceDirectory(1) as balance:
            adopted: list[socket.socket] = []
            own = ConnectionHandoff(balance.path, 0)
            own.start(adopted.append)
            try:
                baseline = len(os.listdir("/proc/self/fd"))
                read_end, write_end = os.pipe()
                unix_a, unix_b = socket.socketpair()
                with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
                    fds = [read_end, unix_a.fileno(), write_end, unix_b.fileno(), read_end, read_end]  # 6 > 4 kept
                    send_descriptors(sender, inbox_path(balance.path, 0), fds)
                    await asyncio.sleep(0.2)
                unix_a.close()
                unix_b.close()
                os.close(read_end)
                os.close(write_end)
                assert adopted == [] and own.received == 0 and own.table.counts() == [0]
                assert len(os.listdir("/proc/self/fd")) == baseline  # none of what arrived was kept open
            finally:
                own.close()

    asyncio.run(go())


def test_endpoint_counts_a_connection_from_accept_and_stops_cleanly_with_it_open() -> None:
    """A direct endpoint with placement: a connection is counted from its accept (before any hello), the endpoint
    stops with it still silent (its task ends, its count is released before the table closes, nothing is logged as
    a failed task), and the port no longer accepts."""
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    from corolla.protocol.direct_stream import TicketSecret
    from corolla.server.front.direct_endpoint import DirectEndpoint, DirectListen

    async def go() -> None:
        loop = asyncio.get_running_loop()
        failures: list[dict] = []
        loop.set_exception_handler(lambda _loop, context: failures.append(context))
        with BalanceDirectory(1) as balance:
            handoff = ConnectionHandoff(balance.path, 0)
            handler = SimpleNamespace(max_stream_bytes=1 << 20, direct_offer=None)
            peer_id = PeerID.from_base58("QmPeer1111111111111111111111111111111111111111")
            listen = DirectListen("127.0.0.1", 0, ("127.0.0.1",))
            endpoint = DirectEndpoint(handler, peer_id, listen, TicketSecret(), reuse_port=False, handoff=handoff)
            port = await endpoint.start()
            assert handler.direct_offer is not None
            with LoadTable(balance.path / TABLE_NAME) as table:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                for _ in range(100):
                    if endpoint.num_open == 1:
                        break
                    await asyncio.sleep(0.01)
                assert endpoint.num_open == 1 and table.counts() == [1]
                await endpoint.stop()
                assert endpoint.num_open == 0 and handler.direct_offer is None
                assert table.counts() == [0]
                assert await asyncio.wait_for(reader.read(), 5) == b""  # the server closed it
                writer.close()
            with pytest.raises(OSError):
                await asyncio.open_connection("127.0.0.1", port)
        assert not failures, failures

    asyncio.run(go())
