"""What one client routed lately: inference sessions it sent to each server, decayed with a half-life, so that its
next routes count the load its own sessions add before the servers' next records show it."""

from __future__ import annotations

import threading
from collections.abc import Iterable

ROUTED_LOAD_HALF_LIFE_S = 30.0  # about half a record period: by then the servers announce these sessions
FORGET_BELOW = 0.01


class RoutedLoad:
    """Decayed session counts by peer id; thread-safe. Times are the caller's clock in seconds."""

    def __init__(self, half_life_s: float = ROUTED_LOAD_HALF_LIFE_S):
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = half_life_s
        self._routed: dict[str, tuple[float, float]] = {}  # peer -> (sessions routed there, the time then)
        self._lock = threading.Lock()

    def load(self, now_s: float) -> dict[str, float]:
        """Sessions routed to each server lately, each decayed by its age."""
        with self._lock:
            return {peer: count * 0.5 ** ((now_s - since) / self.half_life_s) for peer, (count, since) in
                    self._routed.items()}  # fmt: skip

    def note(self, peer_ids: Iterable[str], now_s: float) -> None:
        """One more session on each of `peer_ids` (a route's servers) at `now_s`; forgets faded peers."""
        load = self.load(now_s)
        with self._lock:
            for peer in peer_ids:
                self._routed[peer] = (load.get(peer, 0.0) + 1.0, now_s)
            for peer in [peer for peer, count in load.items() if count < FORGET_BELOW]:
                self._routed.pop(peer, None)
