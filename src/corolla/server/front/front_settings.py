"""What every front of one span serves by (`front_service`): one record for the front in the core's process and for
each handler process's (pickled to it at start)."""

from __future__ import annotations

from dataclasses import dataclass, field

from corolla.protocol.direct_stream import TicketSecret
from corolla.server.core.limits import PeerLimits, SessionTimeouts
from corolla.server.front.block_functions import ServingLimits
from corolla.server.front.direct_endpoint import DirectListen


@dataclass(frozen=True)
class FrontSettings:
    """What every front of one span serves by (pickled to each handler process)."""

    limits: ServingLimits
    timeouts: SessionTimeouts
    peer_limits: PeerLimits = field(default_factory=PeerLimits)  # this front's stream bytes (the core's: its own)
    compression: int = 0
    dht_client_mode: bool = False
    peer_id: str = ""  # the server's (its p2pd's): every front answers as it
    swarm_key_file: str | None = None  # private swarm: every RPC proves membership
    kv_handoff: bool = True  # a draining session's KV to its client / from a client (`SessionHandoff.enabled`)
    prefix_cache_shared: bool = False  # every client's cached prefixes are everyone's (`PrefixTrust.shared`)
    local_socket_dir: str | None = None  # serve same-host clients on a unix socket there (None: not)
    direct: DirectListen | None = None  # the direct TCP port (handler processes share one, SO_REUSEPORT)
    # the server's ticket secret, made once with the settings: any front checks the tickets any of them issued
    direct_secret: bytes = field(default_factory=lambda: TicketSecret().secret)
    direct_balance_dir: str | None = None  # handler processes' direct-port load table and hand-off sockets (0700)
    # a handler process's loop polls instead of sleeping for this long after each message (0: it sleeps at once); its
    # loop is its only Python thread, so polling starves no other (`utils.busy_poll`)
    poll_linger_s: float = 0.0
