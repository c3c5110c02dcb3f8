"""Bytes of one kind held for peers, per peer and in all, each under a cap: the unfinished streamed requests a front
holds (`front.stream_endpoint.StreamBudget`) and the KV hand-off imports in flight on the server (`import_budget`).
A peer past its share is refused as a peer (`PeerLimitExceeded`), any peer past the server's total as a full server
(`ServerLimitExceeded`: retry later); either way nothing is taken. A total cap may keep its top `reserve_bytes` for
peers within their fair share of it (the stream caps do, decision 0187), so that the others' next message finds room
without waiting for anything."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from corolla.server.core.limits import PeerLimitExceeded, PeerLimits, ServerLimitExceeded


@dataclass(frozen=True)
class ByteCap:
    """One cap: the `PeerLimits` field it comes from (named in the refusal), its bytes (0 or None: none), and the
    refusal's reason (a metrics label)."""

    name: str
    limit_bytes: int | None
    reason: str
    # the top of the cap that a peer holding more than its fair share (`PeerBytes.within_share`) may not take: the
    # others' room, kept free of one peer's pressure (0: none)
    reserve_bytes: int = 0


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
        limit_bytes = self.total_limit_bytes(peer, nbytes)
        if limit_bytes and self.total_bytes + nbytes > limit_bytes:
            kept = cap.limit_bytes - limit_bytes if cap.limit_bytes else 0
            raise ServerLimitExceeded(
                f"{self.what} of {nbytes} bytes refused: the server holds {self.total_bytes} bytes {self.held_as}, "
                f"the limit is {cap.name}={cap.limit_bytes}"
                + (f" less {kept} bytes kept for peers within their share (this one holds {held})" if kept else "")
                + "; retry later",
                reason=cap.reason,
            )
        self.per_peer[peer] = held + nbytes
        self.total_bytes += nbytes

    def total_limit_bytes(self, peer: str, nbytes: int) -> int | None:
        """The total that `nbytes` more of `peer`'s may not pass: the total cap, less its reserve where they would
        take the total into it and `peer` past its fair share (`within_share`: a lone peer keeps the reserve for the
        next)."""
        cap = self.total_cap
        limit_bytes = cap.limit_bytes
        if not limit_bytes or not cap.reserve_bytes or self.total_bytes + nbytes <= limit_bytes - cap.reserve_bytes:
            return limit_bytes
        return limit_bytes if self.within_share(peer, nbytes) else limit_bytes - cap.reserve_bytes

    def within_share(self, peer: str, nbytes: int) -> bool:
        """Whether `peer` with `nbytes` more holds at most its fair share of the total cap: the cap over the peers
        holding any, itself counted, at least 2, and never less than the reserve (a message, so that cheap identities
        cannot shrink a user's share below one message: decision 0228)."""
        cap = self.total_cap
        peers = len(self.per_peer) + (peer not in self.per_peer)
        share = max((cap.limit_bytes or 0) // max(2, peers), cap.reserve_bytes)
        return self.per_peer.get(peer, 0) + nbytes <= share

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


def import_budget(limits: PeerLimits) -> PeerBytes:
    """The KV hand-off imports in flight on the server, every front's (`SpanCore.hold_import`): an import's parts are
    held in host memory until its cache is written, past the stream budget, so these caps bound them; past either an
    import is refused at its header, before any part is read (the client tries another replacement or replays)."""
    return PeerBytes(
        "KV import",
        "of imports in flight",
        ByteCap("max_import_bytes_per_peer", limits.max_import_bytes_per_peer, "peer_import_bytes"),
        ByteCap("max_import_bytes_total", limits.max_import_bytes_total, "import_bytes_full"),
    )
