"""`LinkFaults`: the faults of one proxy's link besides its steady shape, as windows on the loop's monotonic clock:
a stall (every byte of every connection held until it ends: a route flap or a TCP retransmission back-off of
seconds), a drop (the link's connections reset, new ones unanswered until it ends: middlebox state lost), and a
partition from chosen peers (their connections, old and new, get nothing through until `heal`; the server's own
outgoing connections, e.g. to the DHT, never cross its proxy and stay up). Pure state; the proxy polls `held_for`."""

from __future__ import annotations

import math
from collections.abc import Collection

MAX_FAULT_S = 3600.0


class LinkFaults:
    """`held_for(peer_port, now_s)`: seconds the connection from `peer_port` must still wait (0: it may pass; inf:
    partitioned until `heal`). `peer_port` is the connecting socket's port as the proxy saw it."""

    def __init__(self) -> None:
        self.hold_until_s = -math.inf
        self.partitioned_ports: frozenset[int] | None = None  # None: no partition
        self.partition_all = False
        self.faults = 0  # stalls + drops + partitions applied

    @staticmethod
    def _check_duration(duration_s: float) -> None:
        if not 0.0 < duration_s <= MAX_FAULT_S:
            raise ValueError(f"a fault's duration_s must be in (0, {MAX_FAULT_S:g}], got {duration_s}")

    def stall(self, now_s: float, duration_s: float) -> None:
        self._check_duration(duration_s)
        self.hold_until_s = max(self.hold_until_s, now_s + duration_s)
        self.faults += 1

    def partition(self, peer_ports: Collection[int] | None = None) -> None:
        """Nothing from or to `peer_ports` (None: every peer) passes until `heal()`."""
        if peer_ports is None:
            self.partition_all, self.partitioned_ports = True, None
        else:
            if any(not 0 < p < 65536 for p in peer_ports):
                raise ValueError(f"peer ports must be in [1, 65535], got {sorted(peer_ports)}")
            self.partitioned_ports = frozenset(peer_ports) | (self.partitioned_ports or frozenset())
        self.faults += 1

    def heal(self) -> None:
        """Ends the partition and any stall or drop now."""
        self.hold_until_s = -math.inf
        self.partitioned_ports, self.partition_all = None, False

    def held_for(self, peer_port: int, now_s: float) -> float:
        if self.partition_all or (self.partitioned_ports is not None and peer_port in self.partitioned_ports):
            return math.inf
        return max(0.0, self.hold_until_s - now_s)
