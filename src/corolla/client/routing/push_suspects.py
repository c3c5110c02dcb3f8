"""`PushSuspects`: the client's memory of pushes whose answers failed its checks (decision 0169). Such a failure blames
nobody (`retries.PushedReplyRejected`, 0154): the upstream may have pushed other outputs than it answered, or the
server may have flagged its own lie, and the client cannot tell which. After a failure of a push from `upstream`
into `target`, the pair is not pushed through for `PUSH_SUSPECT_S * 2**(n - 1)` seconds (capped at
`PUSH_SUSPECT_MAX_S`), and neither server is pushed into or out of for `PUSH_SUSPECT_S`: a liar costs the client at
most one replay a period, then its lies are its own and banned; an honest partner loses only pushes (latency).
Bounded to `MAX_PAIRS` pairs per client process."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

PUSH_SUSPECT_S = 60.0  # a failure's suspension of both servers, and of the pair after its first failure
PUSH_SUSPECT_MAX_S = 24 * 3600.0  # the longest a pair's suspension grows to
MAX_PAIRS = 4096  # pairs remembered (the least recently failed forgotten first)


class PushSuspects:
    """Thread-safe: which pushes (upstream peer -> target peer) the client leaves out of its `next_servers`."""

    def __init__(
        self,
        base_s: float = PUSH_SUSPECT_S,
        max_s: float = PUSH_SUSPECT_MAX_S,
        max_pairs: int = MAX_PAIRS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.base_s, self.max_s, self.max_pairs, self._clock = base_s, max_s, max_pairs, clock
        self._pairs: OrderedDict[tuple[str, str], tuple[int, float]] = OrderedDict()  # -> (failures, until)
        self._servers: dict[str, float] = {}  # peer -> until (time.monotonic())
        self._lock = threading.Lock()

    def rejected(self, upstream: str, target: str) -> float:
        """Records that `target`'s answer to a push from `upstream` failed the checks; returns the pair's suspension
        in seconds."""
        with self._lock:
            now = self._clock()
            pair = (upstream, target)
            failures = self._pairs.get(pair, (0, 0.0))[0] + 1
            duration_s = min(self.max_s, self.base_s * 2.0 ** (failures - 1))
            # set in place, then made the most recent: never emptied, not even for a moment (`may_push` reads its
            # emptiness without the lock)
            self._pairs[pair] = (failures, now + duration_s)
            self._pairs.move_to_end(pair)
            while len(self._pairs) > self.max_pairs:
                self._pairs.popitem(last=False)
            for peer in [peer for peer, until in self._servers.items() if until <= now]:
                del self._servers[peer]
            for peer in (upstream, target):
                self._servers[peer] = max(self._servers.get(peer, 0.0), now + self.base_s)
            return duration_s

    def may_push(self, upstream: str, target: str) -> bool:
        """Whether the client may name `target` to receive a push from `upstream` now."""
        if not self._pairs:  # no failure yet (once one, never empty again): no lock on a step's usual path
            return True
        with self._lock:
            now = self._clock()
            pair = self._pairs.get((upstream, target))
            return (
                (pair is None or pair[1] <= now)
                and self._servers.get(upstream, 0.0) <= now
                and self._servers.get(target, 0.0) <= now
            )

    def failures(self, upstream: str, target: str) -> int:
        """How many answers to pushes from `upstream` into `target` failed the checks (while remembered)."""
        with self._lock:
            return self._pairs.get((upstream, target), (0, 0.0))[0]
