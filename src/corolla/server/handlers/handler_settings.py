"""What every handler process of one span is started with (`handler_pool` pickles it to each; `handler_process`
serves by it)."""

from __future__ import annotations

from dataclasses import dataclass

from corolla.server.core.limits import PeerLimits, SessionTimeouts
from corolla.server.front.block_functions import ServingLimits
from corolla.server.front.direct_endpoint import DirectListen


@dataclass(frozen=True)
class HandlerSettings:
    """What every handler process of one span needs (pickled to it at start)."""

    daemon_listen_maddr: str  # the server's p2pd control socket
    limits: ServingLimits
    timeouts: SessionTimeouts
    peer_limits: PeerLimits
    compression: int
    dht_client_mode: bool
    peer_id: str
    swarm_key_file: str | None  # private swarm: every RPC proves membership here too
    kv_handoff: bool
    local_socket_dir: str | None = None  # serve same-host clients on a unix socket of this process's own there
    direct: DirectListen | None = None  # the direct TCP port every handler process listens on (SO_REUSEPORT)
    direct_secret: bytes | None = None  # the server's ticket secret (any process checks any process's tickets)
    direct_balance_dir: str | None = None  # the processes' direct-port load table and hand-off sockets (0700)
    # the process's loop polls instead of sleeping for this long after each message (0: it sleeps at once); its loop
    # is its only Python thread, so polling starves no other (`utils.busy_poll`)
    poll_linger_s: float = 0.0
