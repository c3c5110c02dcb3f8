"""Admission of inference sessions: per-peer and global caps on open sessions and on reserved KV cache, and
eviction of idle sessions (no token processed for `session_idle_evict_s`; zero-token steps are not use) when a new
session does not fit the cache. Runs in the server's asyncio loop; the KV bytes themselves belong to the executor (`SpanExecutor.open_session`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from corolla.server.core.executor import SessionCache, SessionSpec, SpanExecutor
from corolla.server.core.limits import PeerLimitExceeded, PeerLimits, ServerLimitExceeded, SessionEvicted
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class CacheBudget(Protocol):
    """The KV cache bytes admission weighs sessions against (a `SpanExecutor`)."""

    @property
    def max_size_bytes(self) -> int: ...

    @property
    def bytes_left(self) -> int: ...

    @property
    def bytes_waiting(self) -> int: ...


@dataclass(eq=False)
class SessionTicket:
    """One admitted session: who holds it, how much cache it reserved and when it last did real work."""

    peer: str
    reserved_bytes: int
    opened_at: float = field(default_factory=time.monotonic)
    last_used_at: float = field(default_factory=time.monotonic)
    evicted: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)
    eviction: SessionEvicted | None = None

    def touch(self, num_tokens: int) -> None:
        """Records a step; only one that processed at least one token counts as use."""
        if num_tokens > 0:
            self.last_used_at = time.monotonic()

    @property
    def idle_s(self) -> float:
        return time.monotonic() - self.last_used_at

    def evict(self, reason: str) -> None:
        self.eviction = SessionEvicted(reason)
        self.evicted.set()


class SessionAdmission:
    """Decides whether a new session may open, evicting idle ones under memory pressure."""

    def __init__(self, limits: PeerLimits, budget: CacheBudget):
        self.limits = limits
        self.budget = budget
        self._tickets: set[SessionTicket] = set()
        self._per_peer: dict[str, set[SessionTicket]] = defaultdict(set)
        self.num_evicted = 0

    @property
    def num_open(self) -> int:
        return len(self._tickets)

    def peer_reserved_bytes(self, peer: str) -> int:
        return sum(t.reserved_bytes for t in self._per_peer.get(peer, ()))

    def peer_sessions(self, peer: str) -> int:
        return len(self._per_peer.get(peer, ()))

    @contextlib.asynccontextmanager
    async def admit(self, peer: str, reserve_bytes: int) -> AsyncIterator[SessionTicket]:
        """Admits a session of `peer` that will reserve `reserve_bytes` of KV cache (may first evict idle sessions
        of others and wait up to `evict_wait_s` for them to free it). Raises PeerLimitExceeded or
        ServerLimitExceeded; the ticket is released on every exit path."""
        self._check(peer, reserve_bytes)
        ticket = SessionTicket(peer=peer, reserved_bytes=reserve_bytes)
        self._tickets.add(ticket)
        self._per_peer[peer].add(ticket)
        try:
            if reserve_bytes > 0:
                await self._make_room(reserve_bytes, ticket)
            yield ticket
        finally:
            self._tickets.discard(ticket)
            peer_tickets = self._per_peer.get(peer)
            if peer_tickets is not None:
                peer_tickets.discard(ticket)
                if not peer_tickets:
                    del self._per_peer[peer]
            ticket.released.set()

    @contextlib.asynccontextmanager
    async def reserve(
        self, peer: str, executor: SpanExecutor, spec: SessionSpec, alloc_timeout_s: float | None
    ) -> AsyncIterator[tuple[SessionTicket, SessionCache | None]]:
        """Admits a session and opens its KV cache (none for a `max_length=0` probe); yields its ticket and cache.
        Everything is given back on exit."""
        if spec.max_length_tokens == 0:  # a probe: only zero-token steps fit, nothing to reserve
            async with self.admit(peer, 0) as ticket:
                yield ticket, None
            return
        async with self.admit(peer, executor.session_bytes(spec)) as ticket:
            async with executor.open_session(spec, alloc_timeout_s) as cache:
                yield ticket, cache

    def _check(self, peer: str, reserve_bytes: int) -> None:
        limits = self.limits
        if limits.max_sessions_per_peer and self.peer_sessions(peer) >= limits.max_sessions_per_peer:
            raise PeerLimitExceeded(
                f"Could not open a session: this peer already has {self.peer_sessions(peer)} open sessions, the "
                f"limit per peer is max_sessions_per_peer={limits.max_sessions_per_peer}",
                reason="peer_sessions",
            )
        if limits.max_sessions_total and len(self._tickets) >= limits.max_sessions_total:
            if not self._evict_for_slot():
                raise ServerLimitExceeded(
                    f"Could not open a session: the server has {len(self._tickets)} open sessions, the limit is "
                    f"max_sessions_total={limits.max_sessions_total}, and none is idle",
                    reason="sessions_full",
                )
        cap = self._peer_cap_bytes()
        held = self.peer_reserved_bytes(peer)
        if cap is not None and held + reserve_bytes > cap:
            raise PeerLimitExceeded(
                f"Could not allocate {reserve_bytes} bytes of attention cache: this peer already holds {held} bytes "
                f"and one peer may hold at most max_kv_fraction_per_peer={limits.max_kv_fraction_per_peer} of the "
                f"cache ({cap} bytes); close sessions or ask for a shorter max_length",
                reason="peer_kv",
            )

    def _peer_cap_bytes(self) -> int | None:
        total = int(self.budget.max_size_bytes)
        if total >= 2**62 or self.limits.max_kv_fraction_per_peer >= 1:
            return None
        return int(total * self.limits.max_kv_fraction_per_peer)

    def _idle_candidates(self, exclude: SessionTicket | None = None) -> list[SessionTicket]:
        if not self.limits.session_idle_evict_s:
            return []
        idle = [
            t
            for t in self._tickets
            if t is not exclude and not t.evicted.is_set() and t.idle_s >= self.limits.session_idle_evict_s
        ]
        return sorted(idle, key=lambda t: t.last_used_at)

    def _evict(self, ticket: SessionTicket, why: str) -> None:
        ticket.evict(
            f"Session ended by the server: no token processed for {ticket.idle_s:.0f} s "
            f"(session_idle_evict={self.limits.session_idle_evict_s} s) and its {why} was needed by another user; "
            f"open a new session (replay the history) to continue"
        )
        self.num_evicted += 1
        logger.info(
            f"admission.evicted(peer={ticket.peer:.12}, bytes={ticket.reserved_bytes}, idle_s={ticket.idle_s:.1f}, "
            f"why={why})"
        )

    def _evict_for_slot(self) -> bool:
        candidates = self._idle_candidates()
        if not candidates:
            return False
        self._evict(candidates[0], "session slot")
        return True  # its slot is counted free now: the evicted session ends within a loop iteration

    async def _make_room(self, size: int, ticket: SessionTicket) -> None:
        """Evicts the longest-idle sessions when `size` does not fit what is free, if that makes it fit."""
        free = int(self.budget.bytes_left) - self._bytes_waited_for()
        pending = [t for t in self._tickets if t.evicted.is_set() and not t.released.is_set()]
        free += sum(t.reserved_bytes for t in pending)
        if free >= size:
            if pending:
                await self._wait_released(pending)
            return
        chosen: list[SessionTicket] = []
        for candidate in self._idle_candidates(exclude=ticket):
            if free >= size:
                break
            if candidate.reserved_bytes > 0:
                chosen.append(candidate)
                free += candidate.reserved_bytes
        if free < size:
            return  # evicting would not make it fit: leave them be; the allocation waits or fails as before
        for candidate in chosen:
            self._evict(candidate, "KV cache")
        await self._wait_released(pending + chosen)

    def _bytes_waited_for(self) -> int:
        return int(self.budget.bytes_waiting)  # queued allocations are served first

    async def _wait_released(self, tickets: list[SessionTicket]) -> None:
        waits = [asyncio.ensure_future(t.released.wait()) for t in tickets]
        try:
            await asyncio.wait(waits, timeout=self.limits.evict_wait_s)
        finally:
            for w in waits:
                w.cancel()


class ForwardSlots:
    """At most `per_peer` concurrent forward/backward requests of one peer; the others wait their turn here (in the
    event loop, holding no runtime queue slot) so that one peer's flood can't fill the device queue."""

    def __init__(self, per_peer: int):
        self.per_peer = per_peer
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._users: dict[str, int] = defaultdict(int)

    @contextlib.asynccontextmanager
    async def hold(self, peer: str) -> AsyncIterator[None]:
        if not self.per_peer:
            yield
            return
        semaphore = self._slots.get(peer)
        if semaphore is None:
            semaphore = self._slots[peer] = asyncio.Semaphore(self.per_peer)
        self._users[peer] += 1
        try:
            async with semaphore:
                yield
        finally:
            self._users[peer] -= 1
            if not self._users[peer]:  # forget idle peers: the table stays as small as the active set
                del self._users[peer]
                self._slots.pop(peer, None)
