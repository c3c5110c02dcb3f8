"""The bytes of KV hand-off imports in flight on the server (`front.inference_stream.SessionHandoff.import_kv`, every
front's): an import's parts are held in host memory until the last is in and the cache is written, past the stream
budget (which gives a message's bytes back once the next is read), so nothing else bounded them but the peer's share
of the KV cache, which cheap identities multiply, on a card whose cache may be larger than the host's memory. Per peer
(`PeerLimits.max_import_bytes_per_peer`) and in all (`max_import_bytes_total`), counted by the core
(`SpanCore.hold_import`; a handler process's fronts ask it over their channel, once an import) so that the caps hold
per server whatever `--num_handlers` is; past either an import is refused at its header, before any part is read
(`PeerLimitExceeded` reason `peer_import_bytes`, `ServerLimitExceeded` reason `import_bytes_full`): the client tries
another replacement or replays."""

from __future__ import annotations

from corolla.server.core.limits import PeerLimits
from corolla.server.core.peer_bytes import ByteCap, PeerBytes


def import_budget(limits: PeerLimits) -> PeerBytes:
    """The imports in flight under `limits`' caps (`hold(peer, nbytes)` around reading and writing one)."""
    return PeerBytes(
        "KV import",
        "of imports in flight",
        ByteCap("max_import_bytes_per_peer", limits.max_import_bytes_per_peer, "peer_import_bytes"),
        ByteCap("max_import_bytes_total", limits.max_import_bytes_total, "import_bytes_full"),
    )
