"""The bytes of KV hand-off imports a front reads at once (`inference_stream.SessionHandoff.import_kv`): an import's
parts are held in host memory until the last is in and the cache is written, past the stream budget (which gives a
message's bytes back once the next is read), so nothing else bounded them but the peer's share of the KV cache, which
cheap identities multiply, on a card whose cache may be larger than the host's memory. Per peer
(`PeerLimits.max_import_bytes_per_peer`) and in all (`max_import_bytes_total`); past either an import is refused at its
header, before any part is read (`PeerLimitExceeded` reason `peer_import_bytes`, `ServerLimitExceeded` reason
`import_bytes_full`): the client tries another replacement or replays."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from corolla.server.core.limits import PeerLimitExceeded, PeerLimits, ServerLimitExceeded


class ImportBudget:
    """Bytes of the imports in flight: per peer and in all (event loop only)."""

    def __init__(self, limits: PeerLimits):
        self.limits = limits
        self.total_bytes = 0
        self.per_peer: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, peer: str, nbytes: int) -> Iterator[None]:
        """Counts an import of `nbytes` by `peer` while inside; refused (nothing counted) past a cap (0: none)."""
        limits = self.limits
        held = self.per_peer.get(peer, 0)
        if limits.max_import_bytes_per_peer and held + nbytes > limits.max_import_bytes_per_peer:
            raise PeerLimitExceeded(
                f"KV import of {nbytes} bytes refused: this peer already imports {held} bytes, the limit is "
                f"max_import_bytes_per_peer={limits.max_import_bytes_per_peer}",
                reason="peer_import_bytes",
            )
        if limits.max_import_bytes_total and self.total_bytes + nbytes > limits.max_import_bytes_total:
            raise ServerLimitExceeded(
                f"KV import of {nbytes} bytes refused: the server imports {self.total_bytes} bytes, the limit is "
                f"max_import_bytes_total={limits.max_import_bytes_total}; retry later",
                reason="import_bytes_full",
            )
        self.per_peer[peer] = held + nbytes
        self.total_bytes += nbytes
        try:
            yield
        finally:
            self.total_bytes -= nbytes
            left = self.per_peer[peer] - nbytes
            if left:
                self.per_peer[peer] = left
            else:
                del self.per_peer[peer]
