"""Bans of failing servers: `ban_timeout * rate^n` seconds after the n-th consecutive failure, cleared on success;
servers caught lying (outvoted 2:1) are banned for the client's lifetime. Also each server's verified steps in a
row that agreed with others (`agreed_in_a_row`): the standing a witness needs. Both tables are kept within
`peer_tables.PEERS_KEPT_MAX` peers (decision 0211; the ban records of fewest bans and the shortest records go
first, 0231); liars are never forgotten (each cost its identity a step caught against a witness with standing)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from corolla.utils.peer_tables import remember, worth_itself


@dataclass
class _BanRecord:
    banned_until_s: float
    num_bans: int


class BanList:
    """Thread-safe set of banned peers. A failure of a peer that is not banned right now bans it for
    `base_timeout_s * backoff_rate ** n`, n = bans since its last success (15, 30, 60 s... by default)."""

    def __init__(self, base_timeout_s: float, backoff_rate: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.base_timeout_s, self.backoff_rate, self._clock = base_timeout_s, backoff_rate, clock
        self._records: dict[str, _BanRecord] = {}
        self._liars: set[str] = set()  # outvoted 2:1 on outputs they sent us: never cleared
        self._agreed: dict[str, int] = {}  # verified steps in a row that agreed with another server (none: not kept)
        # records spent on a verdict that a later word may reverse (`spend`): peer -> spend id -> record held aside
        self._spent: dict[str, dict[int, int]] = {}
        self._spend_ids = itertools.count(1)
        self._lock = threading.Lock()

    def record_verified(self, peer_id: str, *, agreed: bool) -> None:
        """One verified output of `peer_id`: it agreed with another server, or not (then its record starts over)."""
        with self._lock:
            if agreed:
                # (a record is worth its length: the longest are the witnesses' standing)
                remember(self._agreed, peer_id, self._agreed.get(peer_id, 0) + 1, worth=worth_itself)
            else:
                self._agreed.pop(peer_id, None)
                self._spent.pop(peer_id, None)  # a disagreement forfeits a record spent before too

    def spend(self, peer_id: str) -> int:
        """`peer_id`'s record starts over, as after a disagreement, but is held aside: `give_back` returns it (a
        verdict on no one's word but an attacker's may be reversed by a referee heard later: decision 0253), and any
        disagreement of `peer_id` since forfeits it. Returns the spend's id (0: no record to spend): each verdict
        gets back what it spent, not what another verdict on the same peer spent since (decision 0256)."""
        with self._lock:
            record = self._agreed.pop(peer_id, 0)
            if not record:
                return 0
            spend_id = next(self._spend_ids)
            held = {**self._spent.get(peer_id, {}), spend_id: record}
            remember(self._spent, peer_id, held, worth=_held_worth)
            return spend_id

    def give_back(self, peer_id: str, spend_id: int) -> None:
        """Adds what `spend` held aside of `peer_id`'s record under `spend_id` (none where a disagreement forfeited
        it, or given back before) to its record."""
        with self._lock:
            held = self._spent.get(peer_id)
            record = held.pop(spend_id, 0) if held is not None else 0
            if held is not None and not held:
                del self._spent[peer_id]
            if record:
                remember(self._agreed, peer_id, self._agreed.get(peer_id, 0) + record, worth=worth_itself)

    def forfeit(self, peer_id: str, spend_id: int) -> None:
        """What `spend` held aside of `peer_id`'s record under `spend_id` is lost for good (its verdict stands)."""
        with self._lock:
            held = self._spent.get(peer_id)
            if held is not None:
                held.pop(spend_id, None)
                if not held:
                    del self._spent[peer_id]

    def agreed_in_a_row(self, peer_id: str) -> int:
        with self._lock:
            return 0 if peer_id in self._liars else self._agreed.get(peer_id, 0)

    def ban_liar(self, peer_id: str) -> None:
        """Bans a server caught lying to this client, for good (first-hand evidence only, never hearsay)."""
        with self._lock:
            self._liars.add(peer_id)

    def is_liar(self, peer_id: str) -> bool:
        with self._lock:
            return peer_id in self._liars

    def ban(self, peer_id: str) -> float:
        """Registers a failure; returns the ban duration in seconds (0 if the peer was already banned)."""
        with self._lock:
            now = self._clock()
            record = self._records.get(peer_id)
            if record is not None and record.banned_until_s > now:
                return 0.0
            num_bans = record.num_bans if record is not None else 0
            duration_s = self.base_timeout_s * self.backoff_rate**num_bans
            record = _BanRecord(banned_until_s=now + duration_s, num_bans=num_bans + 1)
            remember(self._records, peer_id, record, worth=lambda _peer, kept: _ban_worth(kept, now))
            return duration_s

    def clear(self, peer_id: str) -> None:
        """A success forgets the peer's failures."""
        with self._lock:
            self._records.pop(peer_id, None)

    def is_banned(self, peer_id: str) -> bool:
        with self._lock:
            record = self._records.get(peer_id)
            return peer_id in self._liars or (record is not None and record.banned_until_s > self._clock())

    def banned_peers(self) -> set[str]:
        with self._lock:
            now = self._clock()
            return {peer for peer, record in self._records.items() if record.banned_until_s > now} | self._liars


def _held_worth(_peer_id: str, held: dict[int, int]) -> float:
    """A held-aside table entry is worth the records it holds (the longest kept, as `_agreed`'s)."""
    return sum(held.values())


def _ban_worth(record: _BanRecord, now: float) -> float:
    """A ban record is worth its back-off count (the next ban's length: `base_timeout_s * backoff_rate ** num_bans`),
    one in force more than one over of the same count, so that fresh identities failing once each cannot erase the
    count of a server failing again after each ban (decision 0231)."""
    return record.num_bans + (0.5 if record.banned_until_s > now else 0.0)
