"""Is a server's libp2p listener reachable again, asked without the client's p2p daemon. While the only server of a
span is unreachable, every dial the daemon makes to it and that fails adds to libp2p's dial back-off for that address
(5 s + n^2 s after the n-th failure; p2pd has no flag for it), so a dial made near the end of an outage kept the
client from the server for up to 6 s after the link was back (`python -m benchmarks.field`: a 30 s drop cost
+35.8 s). A span session remembers the address of its connection (p2pd names it when it opens the stream); while the
link is down the client knocks on that address with a bare TCP connection and waits for the listener's first bytes
(multistream-select's header, which a libp2p TCP listener sends at once, before any handshake), and dials through the
daemon only once it answers: the daemon's last failed dial is then as old as the outage."""

from __future__ import annotations

import asyncio
import time

from hivemind.utils.multiaddr import Multiaddr, protocols

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MULTISTREAM_HEADER = b"\x13/multistream/1.0.0\n"  # what a libp2p listener says first: varint length, protocol id
KNOCK_TIMEOUT_S = 0.5  # a knock unanswered this long: the link is still down (a new one follows at once)
LINK_KNOCK_LIMIT_S = 60.0  # a call with no `max_wait_s` knocks this long at most, then dials (and knocks) again


def tcp_address(maddr: Multiaddr | None) -> tuple[str, int] | None:
    """(host, port) of a direct TCP multiaddr (ip4 or ip6); None for anything else (a relayed connection, QUIC)."""
    if maddr is None:
        return None
    codes = [p.code for p in maddr.protocols()]
    if protocols.P_TCP not in codes or protocols.P_P2P_CIRCUIT in codes:
        return None
    for code in (protocols.P_IP4, protocols.P_IP6):
        if code in codes:
            return maddr.value_for_protocol(code), int(maddr.value_for_protocol(protocols.P_TCP))
    return None


async def listener_answers(address: tuple[str, int], timeout_s: float = KNOCK_TIMEOUT_S) -> bool:
    """Whether a libp2p listener answers at `address` within `timeout_s`: connects, reads its first bytes (no more
    than the header), closes. Sends nothing."""
    opened: list[asyncio.StreamWriter] = []

    async def knock() -> bool:
        reader, writer = await asyncio.open_connection(*address)
        opened.append(writer)
        return await reader.readexactly(len(MULTISTREAM_HEADER)) == MULTISTREAM_HEADER

    try:
        return await asyncio.wait_for(knock(), timeout_s)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        return False
    finally:
        for writer in opened:
            writer.close()


async def wait_until_answering(address: tuple[str, int], limit_s: float) -> float | None:
    """Knocks on `address` until its listener answers or `limit_s` passes; returns the seconds it took (0.0: it
    answered the first knock), None if it never answered."""
    started = time.monotonic()
    knocks = 0
    while (left_s := limit_s - (time.monotonic() - started)) > 0:
        knocked_at = time.monotonic()
        knocks += 1
        if await listener_answers(address, min(KNOCK_TIMEOUT_S, left_s)):
            if knocks == 1:
                return 0.0
            waited_s = time.monotonic() - started
            logger.info(f"link_probe.answering(address={address[0]}:{address[1]}, after_s={waited_s:.2f}, "
                        f"knocks={knocks})")  # fmt: skip
            return waited_s
        # a refused connection fails at once: knock again no sooner than a knock's timeout
        await asyncio.sleep(max(0.0, knocked_at + KNOCK_TIMEOUT_S - time.monotonic()))
    return None
