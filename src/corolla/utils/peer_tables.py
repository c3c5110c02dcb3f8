"""`remember`: one entry of a table keyed by a peer id, the table kept to `PEERS_KEPT_MAX` peers (decision 0211).

Peer ids cost nothing: anyone can announce 100,000 made-up servers in the DHT, and every table a client or server
keeps by peer id (RTTs, bans, servers seen on time, verified agreements, stubs, direct offers) would grow with each
one it meets. Each such table is a dict whose order is its entries' age (an entry is re-inserted last when stored
again). Past the bound, the least worth goes first, the oldest first among equals; a table without a measure of worth
drops its oldest entry. A table whose entries protect the client (a ban's end, a witness's standing, a server measured
answering on time) passes `worth`, so that a flood of fresh identities pushes out each other and the stale entries,
never the few that keep a liar or a loris out while they still count."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TypeVar

PEERS_KEPT_MAX = 4096  # peers a table keeps at most (a busy public swarm has a few hundred servers)

_V = TypeVar("_V")


def remember(
    table: dict[str, _V],
    peer_id: str,
    value: _V,
    *,
    max_peers: int = PEERS_KEPT_MAX,
    worth: Callable[[str, _V], float] | None = None,
) -> None:
    """Stores `value` for `peer_id` last in `table`, then keeps `table` within `max_peers` (`forget_least`)."""
    table.pop(peer_id, None)
    table[peer_id] = value
    if len(table) > max_peers:
        forget_least(table, max_peers, worth)


def forget_least(table: dict[str, _V], max_peers: int, worth: Callable[[str, _V], float] | None = None) -> None:
    """Without `worth`: drops the oldest entries past `max_peers`. With it: drops the entries of least
    `worth(peer_id, value)`, the oldest first among equals, down to 7/8 of `max_peers` (one pass over the table per
    `max_peers` / 8 insertions, not one per insertion: a flood costs a sort's log factor an entry)."""
    if len(table) <= max_peers:
        return
    if worth is None:
        while len(table) > max_peers:
            del table[next(iter(table))]
        return
    drop = len(table) - (max_peers - max_peers // 8)
    # (worth, age) of each entry: the dict's order is the age
    least = heapq.nsmallest(drop, ((worth(peer, value), age, peer) for age, (peer, value) in enumerate(table.items())))
    for _, _, peer_id in least:
        del table[peer_id]


def worth_itself(_peer_id: str, value: float) -> float:
    """`worth` for a table whose values rank themselves: a count, a length of record, an end time (the greater kept)."""
    return value
