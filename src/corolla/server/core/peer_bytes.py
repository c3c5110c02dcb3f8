"""Bytes of one kind held for peers, per peer and in all, each under a cap: the unfinished streamed requests a front
holds (`front.stream_endpoint.StreamBudget`) and the KV hand-off imports in flight on the server (the core's
`import_budget`, every front's). A peer past its
share is refused as a peer (`PeerLimitExceeded`), any peer past the server's total as a full server
(`ServerLimitExceeded`: retry later); either way nothing is taken."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from corolla.server.core.limits import PeerLimitExceeded, ServerLimitExceeded


@dataclass(frozen=True)
class ByteCap:
    """One cap: the `PeerLimits` field it comes from (named in the refusal), its bytes (0 or None: none), and the
    refusal's reason (a metrics label)."""

    name: str
    limit_bytes: int | None
    reason: str


class PeerBytes:
    """`take(peer, nbytes)` counts bytes or refuses them, `give_back` returns them, `hold` does both around a block
    (event loop only). `what` and `held_as` word the refusals: "{what} of N bytes refused: this peer already holds M
    bytes {held_as}, ..."."""

    def __init__(self, what: str, held_as: str, per_peer: ByteCap, total: ByteCap):
        self.what, self.held_as = what, held_as
        self.per_peer_cap, self.total_cap = per_peer, total
        self.total_bytes = 0
        self.per_peer: dict[str, int] = {}

    def take(self, peer: str, nbytes: int) -> None:
        held = self.per_peer.get(peer, 0)
        cap = self.per_peer_cap
        if cap.limit_bytes and held + nbytes > cap.limit_bytes:
            raise PeerLimitExceeded(
                f"{self.what} of {nbytes} bytes refused: this peer already holds {held} bytes {self.held_as}, the "
                f"limit is {cap.name}={cap.limit_bytes}",
                reason=cap.reason,
            )
        cap = self.total_cap
        if cap.limit_bytes and self.total_bytes + nbytes > cap.limit_bytes:
            raise ServerLimitExceeded(
                f"{self.what} of {nbytes} bytes refused: the server holds {self.total_bytes} bytes {self.held_as}, "
                f"the limit is {cap.name}={cap.limit_bytes}; retry later",
                reason=cap.reason,
            )
        self.per_peer[peer] = held + nbytes
        self.total_bytes += nbytes

    def give_back(self, peer: str, nbytes: int) -> None:
        left = self.per_peer.get(peer, 0) - nbytes
        assert left >= 0 and self.total_bytes >= nbytes, f"{self.what}: gave back more than was taken"
        if left:
            self.per_peer[peer] = left
        else:
            self.per_peer.pop(peer, None)
        self.total_bytes -= nbytes

    @contextlib.contextmanager
    def hold(self, peer: str, nbytes: int) -> Iterator[None]:
        """`take` on entry (refused: nothing held), `give_back` on exit however the block ends."""
        self.take(peer, nbytes)
        try:
            yield
        finally:
            self.give_back(peer, nbytes)
