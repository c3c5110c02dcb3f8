"""The knock on a server's libp2p listener (`client.transport.link_probe`), on loopback sockets: a listener that speaks first
(as libp2p's multistream-select does) answers; one behind a dropped `benchmarks.wan_emulator` link answers only once the drop
ends, and `wait_until_answering` returns soon after (or gives up when told to); a silent listener does not answer
and a closed port refuses (the server gone, not the link: no more knocking); only direct TCP addresses are knocked
on. Every wait is bounded."""

from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.utils.multiaddr import Multiaddr

from benchmarks.wan_emulator import WanProxy
from corolla.client.transport import link_probe
from corolla.client.transport.link_probe import (
    KNOCK_TIMEOUT_S,
    MULTISTREAM_HEADER,
    knock,
    tcp_address,
    wait_until_answering,
)
from helpers.ports import listening_port

# the longest pause of a loaded CI worker's loop seen (a GC of its heap, CPU starvation): a knock of a live link
# that must be answered the first time is given this much more than `KNOCK_TIMEOUT_S`
PAUSE_S = 1.5


async def _listener(greeting: bytes) -> asyncio.Server:
    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(greeting)
        await writer.drain()
        await reader.read()  # until the knock hangs up
        writer.close()

    return await asyncio.start_server(greet, "127.0.0.1", 0)


def test_only_direct_tcp_addresses_are_knocked_on() -> None:
    assert tcp_address(Multiaddr("/ip4/10.0.0.1/tcp/4001")) == ("10.0.0.1", 4001)
    assert tcp_address(Multiaddr("/ip6/::1/tcp/4001")) == ("::1", 4001)
    assert tcp_address(Multiaddr("/ip4/10.0.0.1/udp/4001/quic")) is None
    relayed = "/ip4/10.0.0.1/tcp/4001/p2p/QmbMmU5aowDG4pM6RRi3d217Z1wpms1TomXHpw4Ko92PPV/p2p-circuit"
    assert tcp_address(Multiaddr(relayed)) is None
    assert tcp_address(None) is None


def test_a_listener_answers_a_silent_one_does_not_and_a_closed_port_refuses() -> None:
    async def go() -> None:
        async with await _listener(MULTISTREAM_HEADER) as speaking, await _listener(b"") as silent:
            address = ("127.0.0.1", listening_port(speaking))
            assert await knock(address) == "answers"
            started = time.monotonic()
            assert await knock(("127.0.0.1", listening_port(silent))) == "silent"
            assert time.monotonic() - started < KNOCK_TIMEOUT_S + 0.5
        assert await knock(address) == "refused"  # closed now: nothing listens there
        assert await wait_until_answering(address, 5.0) == "refused"  # at once: the server is gone, not the link

    asyncio.run(asyncio.wait_for(go(), 30))


def test_a_dropped_link_answers_once_the_drop_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        async with (
            await _listener(MULTISTREAM_HEADER) as listener,
            WanProxy(target_port=listening_port(listener)) as proxy,
        ):
            address = ("127.0.0.1", proxy.port)
            # (a pause of the loop past the knock's 0.5 s timed out its first knock before the listener's header,
            # there by then, was read: "back", not "up")
            with monkeypatch.context() as patch:
                patch.setattr(link_probe, "KNOCK_TIMEOUT_S", KNOCK_TIMEOUT_S + PAUSE_S)
                assert await wait_until_answering(address, 5.0) == "up"
            proxy.drop(1.5)
            started = time.monotonic()
            assert await wait_until_answering(address, 10.0) == "back"
            assert 1.3 <= time.monotonic() - started < 1.5 + KNOCK_TIMEOUT_S + 0.5
            proxy.drop(5.0)
            assert await wait_until_answering(address, 1.0) == "gave_up"  # not within the limit
            started = time.monotonic()

            def replica_appeared() -> bool:  # another server covers the span now: stop knocking
                return time.monotonic() - started > 0.6

            assert await wait_until_answering(address, 5.0, replica_appeared) == "gave_up"
            assert time.monotonic() - started < 0.6 + KNOCK_TIMEOUT_S + 0.3

    asyncio.run(asyncio.wait_for(go(), 30))
