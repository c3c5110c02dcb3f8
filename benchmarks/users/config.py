"""One many-users measurement's settings (`UsersConfig`): sessions, client processes, transport and client kind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Transport = Literal["p2p", "socket", "direct"]
ClientKind = Literal["petals", "corolla"]
CLIENT_KINDS: tuple[ClientKind, ...] = ("petals", "corolla")


@dataclass(frozen=True)
class UsersConfig:
    """One measurement: `sessions` concurrent sessions spread over `client_processes` processes."""

    sessions: int
    client_processes: int
    transport: Transport
    client: ClientKind = "petals"  # how each session is driven (users.clients)
    prefix_tokens: int = 32
    decode_steps: int = 32
    warmup_steps: int = 3  # each session's first steps are left out of the latency figures (ramp-up)
    step_timeout_s: float = 120.0
    start_timeout_s: float = 300.0  # spawning, opening and prefilling every session

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.client_processes < 1:
            raise ValueError(
                f"sessions and client_processes must be >= 1, got {self.sessions}, {self.client_processes}"
            )
        if self.decode_steps <= self.warmup_steps:
            raise ValueError(f"decode_steps ({self.decode_steps}) must exceed warmup_steps ({self.warmup_steps})")
        if self.transport not in ("p2p", "socket", "direct"):
            raise ValueError(f"transport must be 'p2p', 'socket' or 'direct', got {self.transport!r}")
        if self.transport == "direct" and self.client != "corolla":
            raise ValueError(
                "transport 'direct' is corolla's own: it needs client 'corolla' (Petals has no direct port)"
            )
        if self.client not in CLIENT_KINDS:
            raise ValueError(f"client must be one of {', '.join(CLIENT_KINDS)}, got {self.client!r}")

    def split(self) -> list[int]:
        """Sessions per client process (no process without sessions)."""
        processes = min(self.client_processes, self.sessions)
        base, extra = divmod(self.sessions, processes)
        return [base + (i < extra) for i in range(processes)]
