"""`ClientConfig`: every knob of the client (routing, retries, bans, timeouts) with units in names."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal


def _env_max_retries() -> int | None:
    value = os.environ.get("COROLLA_MAX_RETRIES", os.environ.get("PETALS_MAX_RETRIES"))
    return int(value) if value else None


@dataclass
class ClientConfig:
    """Client settings; defaults follow Petals 2.x so that a corolla client behaves like a stock one in public swarms."""

    initial_peers: Sequence[str] = ()  # multiaddrs of swarm members; empty = corolla.swarm.dht.PUBLIC_INITIAL_PEERS
    dht_prefix: str | None = None  # None = corolla.models.config.default_dht_prefix(model)
    daemon_startup_timeout_s: float = 60.0  # start-up of the client's p2pd / DHT
    show_route: Literal["inference", "always", "never"] = "inference"  # log the chosen chain at INFO

    allowed_servers: Sequence[str] | None = None  # base58 peer ids; None = any server
    blocked_servers: Sequence[str] | None = None  # base58 peer ids never used

    connect_timeout_s: float = 5.0  # opening a stream to a server
    request_timeout_s: float = 180.0  # waiting for one response (unary call or inference step)
    liveness_check_period_s: float = 5.0  # while an inference step waits, ping its server this often; 0 = never
    dht_timeout_s: float = 30.0  # one DHT read of block records
    update_period_s: float = 60.0  # background refresh of block records
    max_retries: int | None = field(default_factory=_env_max_retries)  # None = no limit on the count
    # a call (inference step, forward, backward) that keeps failing ends in NoHonestServerError after this many
    # seconds from its first failure (bans, fail-overs and back-off included; a request in flight may add up to
    # request_timeout_s); None = retry forever (Petals' behaviour)
    max_wait_s: float | None = 60.0
    min_backoff_s: float = 1.0  # sleep before the 2nd retry; doubles each retry after that
    max_backoff_s: float = 60.0  # cap on the sleep between retries
    ban_timeout_s: float = 15.0  # first ban of a failing server; doubles on each repeated failure
    ban_backoff_rate: float = 2.0

    active_adapter: str | None = None  # LoRA adapter name; only servers announcing it are used
    max_pinged: int = 3  # servers pinged per sampled block at each refresh
    ping_timeout_s: float = 2.0

    local_transport: bool = True  # inference with servers on this machine over their unix socket, not p2pd
    # inference over a server's direct TCP port where it offers one (ticket over p2p, then sealed frames; no p2pd
    # on either side of the stream); a server without one, or one we cannot reach there, is served over p2p
    direct_transport: bool = True
    direct_connect_timeout_s: float = 2.0
    # while an inference step is in flight (and it is this process's only one), poll for the response up to this
    # long instead of sleeping: ~0.2-0.4 ms less per token on VMs, one core busy meanwhile; 0 = never (default)
    busy_poll_ms: float = 0.0

    # name the following spans as `next_servers` so each server pushes its outputs straight to the next one (n+1
    # one-way delays per step instead of 2n); the client still sends every span its own copy
    # (client.session.forwarding). Not in a client that verifies (`verifies`): a push is the upstream's word (0153)
    server_forwarding: bool = True
    # key each session's positions by their tokens (`corolla.prefix`) so that corolla servers keep them, and start
    # a generation after the prefix its chain already holds (`client.prefix.prefix_chain`); outputs are the same either way
    prefix_reuse: bool = True

    alloc_timeout_s: float = 0.0  # how long servers may wait for KV cache memory (sent as `alloc_timeout`)
    points: float = 0.0  # priority budget sent as `points`
    # move a span off a draining server by its KV cache (no replay of the history); cap on the bytes relayed. Not in
    # a client that verifies (verify_fraction, verify_shadow_fraction): the cache is the drainer's unchecked word
    kv_handoff: bool = True
    kv_handoff_max_bytes: int = 2**30
    swarm_key_file: str | None = None  # private swarm with membership (`corolla-dht --new_swarm_key`); None = open

    # re-run this fraction of inference steps (sampled) on a second server of the same span and ban a server whose
    # outputs disagree beyond the dtype-derived tolerance (`client.calls.output_checks.verify_rtol`); 0 = off
    verify_fraction: float = 0.0
    verify_rtol: float | None = None  # None = derived from the dtypes of the two outputs
    verify_max_referees: int = 2  # servers asked per verified span (a second, then a third to break a tie)
    # mirror this fraction of span sessions (whole) to a replica as a shadow session on its spare rows, compare in the
    # background, and ban a server outvoted 2:1 for good (`client.session.shadows`); 0 = off
    verify_shadow_fraction: float = 0.0
    # verified outputs in a row, agreeing with another server, that one of two agreeing servers needs before their
    # word against a third bans it for good (`client.verification.witnesses`, decision 0190: peer ids cost nothing, and
    # two fresh identities of one attacker agree at will); short of it the third is avoided and the two are watched.
    # 0: any two servers that agree ban a third (only where identities are not free: known members, a test swarm)
    witness_standing_steps: int = 8
    # where the findings of servers this client caught lying are kept for its user to share, and the peer ids it
    # caught, banned again by a client given the same directory (`client.routing.finding_store`); None = memory
    findings_dir: str | None = None
    findings_max_count: int = 16  # findings kept (one per liar); past it the oldest goes
    findings_max_bytes: int = 256 << 20  # bytes of the findings kept (one larger than this is not kept)

    @property
    def verifies(self) -> bool:
        """Whether this client checks servers' outputs (`verify_fraction` or `verify_shadow_fraction` > 0). Such a
        client takes nothing into a server's session that another server could forge, since its checks blame the
        server that answered: no KV hand-off (the draining server's cache) and no pushes (`server_forwarding`: the
        upstream server's outputs, which it may push other than it answers)."""
        return self.verify_fraction > 0 or self.verify_shadow_fraction > 0

    def __post_init__(self) -> None:
        for name in (
            "daemon_startup_timeout_s", "connect_timeout_s", "request_timeout_s", "liveness_check_period_s",
            "dht_timeout_s", "update_period_s", "min_backoff_s", "max_backoff_s", "ban_timeout_s", "ping_timeout_s",
            "alloc_timeout_s", "busy_poll_ms", "max_pinged", "findings_max_count", "findings_max_bytes",
            "witness_standing_steps",
        ):  # fmt: skip
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("max_wait_s", "max_retries"):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 or None, got {getattr(self, name)!r}")
        for name in ("verify_fraction", "verify_shadow_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.verify_rtol is not None and not self.verify_rtol > 0:
            raise ValueError(f"verify_rtol must be > 0 or None, got {self.verify_rtol!r}")
        if self.verify_max_referees < 1:
            raise ValueError(f"verify_max_referees must be >= 1, got {self.verify_max_referees}")
        if self.ban_backoff_rate < 1:
            raise ValueError(f"ban_backoff_rate must be >= 1, got {self.ban_backoff_rate}")
        if self.show_route not in ("inference", "always", "never"):
            raise ValueError(f"show_route must be 'inference', 'always' or 'never', got {self.show_route!r}")
        if isinstance(self.initial_peers, str):
            self.initial_peers = (self.initial_peers,)
        self.initial_peers = tuple(self.initial_peers)

    def retry_delay_s(self, attempt: int) -> float:
        """Sleep before retry number `attempt` (0-based): 0, then min(min_backoff * 2^(attempt-1), max_backoff)."""
        if attempt <= 0:
            return 0.0
        return min(self.min_backoff_s * 2 ** (attempt - 1), self.max_backoff_s)

    def retries_exhausted(self, attempt: int) -> bool:
        """True when `attempt` failed attempts already used up the retry budget."""
        return self.max_retries is not None and attempt > self.max_retries
