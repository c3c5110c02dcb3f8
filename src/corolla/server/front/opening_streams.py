"""How many p2p inference streams each peer holds open before their sessions open (`stream_guard.steps_handler`):
such a stream waits up to the session's step timeout for its first request, and nothing else counts it (the
admission's `max_sessions_per_peer` counts sessions once opened, the stream budget counts bytes), so one peer could
hold any number of idle streams (a p2pd stream and a socket each). Past `PeerLimits.max_opening_streams_per_peer` a new
one is refused (`PeerLimitExceeded`, reason `peer_opening_streams`)."""

from __future__ import annotations

from corolla.server.core.limits import PeerLimitExceeded, PeerLimits


class OpeningStreams:
    """Per-peer counts of streams accepted and not yet attached to an open session."""

    def __init__(self, limits: PeerLimits):
        self.limits = limits
        self.per_peer: dict[str, int] = {}

    def enter(self, peer: str) -> None:
        """Counts a new stream of `peer`; PeerLimitExceeded (nothing counted) where it holds the limit already."""
        cap = self.limits.max_opening_streams_per_peer
        held = self.per_peer.get(peer, 0)
        if cap and held >= cap:
            raise PeerLimitExceeded(
                f"this peer already has {held} inference streams whose session is not open, the limit is "
                f"max_opening_streams_per_peer={cap}",
                reason="peer_opening_streams",
            )
        self.per_peer[peer] = held + 1

    def leave(self, peer: str) -> None:
        """A stream of `peer` counted by `enter` opened its session or ended (called once per `enter`)."""
        left = self.per_peer.get(peer, 0) - 1
        if left > 0:
            self.per_peer[peer] = left
        else:
            self.per_peer.pop(peer, None)
