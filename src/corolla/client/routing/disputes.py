"""Disputes this client could not settle by a ban (decision 0190): two servers agreeing with each other outvoted a
third, but neither of them had the standing a witness needs (`BanList.agreed_in_a_row` >= the config's
`witness_standing_steps`). Peer ids cost nothing, so such a pair may be one attacker's two identities framing an honest
server: the accused is only avoided for a while (`client.verification.witnesses.outvote`), and the witnesses are
watched here until the dispute ends: each of their steps is verified whatever `verify_fraction` says, by referees
other than their co-witnesses first (two identities of one attacker would vouch for each other: their agreement earns
no standing, and confirms no watched server's output against an outside referee)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Dispute:
    accused: str
    witnesses: frozenset[str]
    until_s: float  # on the disputes' clock (time.monotonic())


class Disputes:
    """Thread-safe list of open disputes, dropped as they end."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._open: list[Dispute] = []
        self._lock = threading.Lock()

    def open(self, accused: str, witnesses: Iterable[str], duration_s: float) -> Dispute:
        dispute = Dispute(accused, frozenset(witnesses), self._clock() + duration_s)
        with self._lock:
            self._open.append(dispute)
        return dispute

    def close(self, dispute: Dispute) -> None:
        """Ends `dispute` before its time (its witnesses judged since: decision 0253)."""
        with self._lock:
            self._open = [kept for kept in self._open if kept is not dispute]

    def _live(self) -> list[Dispute]:
        now = self._clock()
        self._open = [dispute for dispute in self._open if dispute.until_s > now]
        return self._open

    def watched(self) -> set[str]:
        """The witnesses of every open dispute."""
        with self._lock:
            return {peer for dispute in self._live() for peer in dispute.witnesses}

    def co_witnesses(self, peer_id: str) -> set[str]:
        """The servers that witnessed with `peer_id` in an open dispute (its referees only where no other is left)."""
        with self._lock:
            return {peer for d in self._live() if peer_id in d.witnesses for peer in d.witnesses} - {peer_id}
