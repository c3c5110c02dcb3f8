"""Is a server's libp2p listener reachable again, asked without the client's p2p daemon: every failed dial through p2pd
adds to libp2p's dial back-off for that address (5 s + n^2 s after the n-th; p2pd has no flag for it), which kept a
client from its only server for seconds after the link was back. While the link is down the client knocks on the
address of its connection with a bare TCP connection and waits for multistream-select's header (a libp2p TCP listener
sends it before any handshake); it dials through the daemon only once the listener answers.

Only direct TCP addresses are knocked on (`tcp_address`): a relayed connection's address leads to the relay, which
answers whether or not the server behind it is reachable, so relayed (and QUIC) servers are retried every
`retries.SOLE_SERVER_RETRY_S` and may still meet the back-off."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Literal

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


KnockResult = Literal["answers", "silent", "refused"]
LinkState = Literal["up", "back", "refused", "gave_up"]


async def knock(address: tuple[str, int], timeout_s: float = KNOCK_TIMEOUT_S) -> KnockResult:
    """Connects to `address` and reads the listener's first bytes (no more than the header), then closes; sends
    nothing. "answers": a libp2p listener spoke; "silent": nothing within `timeout_s` (the link is down: no answer to
    the connection, or a path that holds it); "refused": the host answered that nothing listens there (refused,
    closed, other bytes: the server is gone or moved, not a link outage)."""
    opened: list[asyncio.StreamWriter] = []

    async def read_header() -> bool:
        reader, writer = await asyncio.open_connection(*address)
        opened.append(writer)
        return await reader.readexactly(len(MULTISTREAM_HEADER)) == MULTISTREAM_HEADER

    try:
        return "answers" if await asyncio.wait_for(read_header(), timeout_s) else "refused"
    except asyncio.TimeoutError:
        return "silent"
    except (OSError, asyncio.IncompleteReadError):
        return "refused"
    finally:
        for writer in opened:
            writer.close()


async def wait_until_answering(
    address: tuple[str, int], limit_s: float, give_up: Callable[[], bool] | None = None
) -> LinkState:
    """Knocks on `address` while it is silent, until `limit_s` passes or `give_up()` (asked before every knock: e.g.
    another server now covers the span). "up": it answered the first knock; "back": it answered after silence (the
    link returned: dial now); "refused": nothing listens there (dial as usual: the daemon may know another address);
    "gave_up": still silent at the limit, or told to give up."""
    started = time.monotonic()
    knocks = 0
    while (left_s := limit_s - (time.monotonic() - started)) > 0 and not (give_up is not None and give_up()):
        knocked_at = time.monotonic()
        knocks += 1
        result = await knock(address, min(KNOCK_TIMEOUT_S, left_s))
        if result == "refused":
            return "refused"
        if result == "answers":
            if knocks == 1:
                return "up"
            logger.info(f"link_probe.answering(address={address[0]}:{address[1]}, "
                        f"after_s={time.monotonic() - started:.2f}, knocks={knocks})")  # fmt: skip
            return "back"
        await asyncio.sleep(max(0.0, knocked_at + KNOCK_TIMEOUT_S - time.monotonic()))  # (a knock that failed fast)
    return "gave_up"
