"""How long a server that lost a dispute is avoided: longer each time it loses again (decision 0225). Many verdicts
end in an avoidance, not a ban (0190, 0208), and a liar avoided a fixed `DISPUTE_AVOID_S` came back and lied again,
forever. Each server's disputes lost are counted: its next avoidance doubles with each, capped at
`DISPUTE_AVOID_MAX_S`, forgotten after `REPEATS_FORGIVEN_STEPS` verified outputs in a row.

Peer ids cost nothing, so escalation must cost an accuser as much as the accused: an accused escalates only as far
as each of its witnesses has accused before (`level`), and an avoidance past the first is rechecked by outside
servers first (`witnesses.needs_recheck`); witnesses they refute lose the dispute (`refuted`). Both tables are kept
within `peer_tables.PEERS_KEPT_MAX` peers (0211), the lowest counts going first."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from corolla.utils.peer_tables import remember, worth_itself

DISPUTE_AVOID_S = 300.0  # the first avoidance of a server that lost a dispute (decision 0190)
DISPUTE_AVOID_MAX_S = 24 * 3600.0  # the longest: a day
# verified outputs in a row agreeing with another server that clear a server's disputes lost (8 give a witness
# standing, decision 0190; a record eight times as long forgives)
REPEATS_FORGIVEN_STEPS = 64


def avoid_s(level: int) -> float:
    """The avoidance of a dispute lost at `level` (0: the first): `DISPUTE_AVOID_S` doubled `level` times, capped."""
    return min(DISPUTE_AVOID_S * 2.0 ** min(level, 64), DISPUTE_AVOID_MAX_S)


class DisputeRepeats:
    """Thread-safe counts of disputes each server lost (as the accused, or as a refuted witness) and of accusations it
    made (as a witness) that were not refuted since."""

    def __init__(self) -> None:
        self._lost: dict[str, int] = {}
        self._accusations: dict[str, int] = {}
        self._lock = threading.Lock()

    def lost(self, peer_id: str) -> int:
        with self._lock:
            return self._lost.get(peer_id, 0)

    def accusations(self, peer_id: str) -> int:
        with self._lock:
            return self._accusations.get(peer_id, 0)

    def level(self, accused: str, witnesses: Sequence[str]) -> int:
        """How many times `accused`'s next avoidance doubles where `witnesses` outvote it: its disputes lost, but no
        more than any witness's accusations (so escalation needs identities that accused before)."""
        with self._lock:
            return min([self._lost.get(accused, 0), *(self._accusations.get(peer, 0) for peer in witnesses)])

    def outvoted(self, accused: str, witnesses: Sequence[str], *, escalate: bool) -> float:
        """`witnesses` outvoted `accused` and it is avoided (not banned): counts the dispute on both sides and
        returns the avoidance, at `level` where `escalate` (servers outside confirmed the witnesses, or none
        answered), else the first's (the outside servers split: either side may be an attacker's)."""
        duration_s = avoid_s(self.level(accused, witnesses)) if escalate else DISPUTE_AVOID_S
        with self._lock:
            remember(self._lost, accused, self._lost.get(accused, 0) + 1, worth=worth_itself)
            for peer in witnesses:
                remember(self._accusations, peer, self._accusations.get(peer, 0) + 1, worth=worth_itself)
        return duration_s

    def refuted(self, witness: str) -> float:
        """Servers outside a dispute sided against `witness`: it lost that dispute. Returns its avoidance (its own
        count's), counts the loss and forgets its accusations (its word is worth no escalation until it accuses
        again). Not for a watched server's output confirmed only by its co-witness against one referee: one word
        each, no dispute lost (decision 0228)."""
        with self._lock:
            lost = self._lost.get(witness, 0)
            remember(self._lost, witness, lost + 1, worth=worth_itself)
            self._accusations.pop(witness, None)
        return avoid_s(lost)

    def forgive(self, peer_id: str) -> None:
        """`peer_id` has a long honest record (`REPEATS_FORGIVEN_STEPS`): its disputes lost are forgotten."""
        with self._lock:
            self._lost.pop(peer_id, None)
