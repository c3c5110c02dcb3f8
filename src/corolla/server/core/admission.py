"""Admission of inference sessions: per-peer and global caps on open sessions and on the KV cache they hold, and
what yields when a new session does not fit. A session is promised its whole `max_length` at open and takes pages as
its tokens arrive; under memory pressure the least valuable holds yield first: sessions that never processed a token
(zero-token steps are not use), then shadow sessions (`protocol.shadow`: a client's check of another server, youngest
first; to a real newcomer only), then the unused promises of sessions idle for `kv_promise_idle_s`, then sessions idle
for `session_idle_evict_s`, then the promises of slow sessions beyond what they would use within `session_idle_evict_s`
at their recent token rate (least recent work first; a session's pace is read only `first_token_grace_s` after its
prefill), then unused promises beyond a fair share per peer of those holding promises, then the promises of sessions
whose pace is not known yet (first those of peers that recently closed a session with no token after its prefill,
their queued prefills included). A session doing real work never loses the pages it holds. Runs in the server's asyncio
loop; the KV bytes themselves belong to the executor (`EngineExecutor.open_session`). Why this shape:
`docs/decisions/0016-hoarding.md` (and its addenda on trickling, fresh and reopened sessions)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict, defaultdict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from corolla.server.core.engine_executor import EngineExecutor, EngineSessionCache
from corolla.server.core.executor import SessionCache, SessionOpen
from corolla.server.core.limits import PeerLimitExceeded, PeerLimits, ServerLimitExceeded, SessionEvicted
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_REOPEN_RECORDS = 4096  # peers remembered for closing a session without work (oldest forgotten first)


@dataclass(eq=False)
class SessionTicket:
    """One admitted session: who holds it, how much cache it holds (its `lease`, else what it reserved at open), and
    what real work it did (tokens processed and when)."""

    peer: str
    reserved_bytes: int
    opened_at: float = field(default_factory=time.monotonic)
    last_used_at: float = field(default_factory=time.monotonic)
    evicted: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)
    eviction: SessionEvicted | None = None
    lease: EngineSessionCache | None = None
    num_steps: int = 0
    num_tokens: int = 0
    token_steps: int = 0  # steps that processed a token (its prefill is the first)
    cache_opened: bool = False  # its cache was granted (a refused open never was: it closes nothing)
    withdrawn: bool = False  # part of its promise went to another session: restored at its next real token
    opening_tokens: int | None = None  # what its opening request brought (None: unknown)
    granting: bool = False  # admitted, its cache not open yet: it claims `reserved_bytes` of what is free
    waiting: bool = False  # its allocation waits in line (counted there): nothing to yield yet
    awaits_release: bool = False  # its room comes from sessions evicted for it, ending now
    bytes_per_token: float = 0.0  # cache one token position of it takes (0: unknown, its promise is not weighed)
    work_horizon_s: float = 0.0  # time constant of `recent_tokens` (0: not weighed)
    prefilled_at: float | None = None  # when its first tokens were processed (None: none yet)
    shadow: bool = False  # a client's mirror of another server's session (`protocol.shadow`): yields to real ones
    _recent_tokens: float = field(default=0.0, init=False)  # as of `last_used_at`

    def touch(self, num_tokens: int) -> None:
        """Records a step; only one that processed at least one token counts as use."""
        self.num_steps += 1
        if num_tokens > 0:
            self.token_steps += 1
            now = time.monotonic()
            if self.num_tokens:  # (the first tokens are its prefill: positions it holds, not its pace)
                if self.work_horizon_s:
                    self._recent_tokens *= math.exp((self.last_used_at - now) / self.work_horizon_s)
                self._recent_tokens += num_tokens
            else:
                self.prefilled_at = now
            self.num_tokens += num_tokens
            self.last_used_at = now
            if self.withdrawn and self.lease is not None and self.lease.restore():
                self.withdrawn = False

    @property
    def recent_tokens(self) -> float:
        """Tokens processed after its prefill, each step's weighed by exp(-age / work_horizon_s)."""
        if not self.work_horizon_s:
            return self._recent_tokens
        return self._recent_tokens * math.exp(-max(0.0, time.monotonic() - self.last_used_at) / self.work_horizon_s)

    @property
    def idle_s(self) -> float:
        return time.monotonic() - self.last_used_at

    @property
    def held_bytes(self) -> int:
        """Cache this session keeps from others: pages taken plus pages promised."""
        lease = self.lease
        return self.reserved_bytes if lease is None else lease.taken_bytes + lease.promised_bytes

    @property
    def promised_bytes(self) -> int:
        return 0 if self.lease is None else self.lease.promised_bytes

    def never_worked(self, grace_s: float) -> bool:
        """No token processed, and its opening request brought none, a step after it was answered, or `grace_s`
        passed since it opened: a hold bought with zero-token steps (a session's opening request carries its prefill,
        or its next one does after a prefix probe, within the grace)."""
        if self.num_tokens:
            return False
        if self.opening_tokens == 0:  # (in line too: for the pages of sessions it made yield, a claim like theirs)
            return True
        # the opening request's own step does not count: a prefix probe brings its tokens in the next one
        return not self.waiting and (self.num_steps > 1 or time.monotonic() - self.opened_at >= grace_s)

    def evict(self, reason: str) -> None:
        self.eviction = SessionEvicted(reason)
        self.evicted.set()


class SessionAdmission:
    """Decides whether a new session may open and what yields to it under memory pressure (see the module
    docstring)."""

    def __init__(self, limits: PeerLimits, budget: EngineExecutor):
        # the KV cache bytes sessions are weighed against: `bytes_left` neither held nor promised, `bytes_waiting`
        # asked for by allocations in line
        self.limits = limits
        self.budget = budget
        self._tickets: set[SessionTicket] = set()
        self._per_peer: dict[str, set[SessionTicket]] = defaultdict(set)
        self.num_evicted = 0
        self.num_withdrawn = 0  # promises withdrawn (in part) from sessions that keep running
        # peer -> when a session of it last closed with no token after its prefill (oldest first): a reopening peer
        self._unworked_closes: OrderedDict[str, float] = OrderedDict()
        if isinstance(budget, EngineExecutor):  # its page line asks for room
            budget.on_shortage(self._on_short)

    @property
    def num_open(self) -> int:
        return len(self._tickets)

    def peer_reserved_bytes(self, peer: str) -> int:
        """Cache the peer's sessions hold (taken and promised)."""
        return sum(t.held_bytes for t in self._per_peer.get(peer, ()))

    def peer_sessions(self, peer: str) -> int:
        return len(self._per_peer.get(peer, ()))

    @contextlib.asynccontextmanager
    async def admit(
        self, peer: str, reserve_bytes: int, *, opening_tokens: int | None = None, granting: bool = False,
        shadow: bool = False,
    ) -> AsyncIterator[SessionTicket]:  # fmt: skip
        """Admits a session of `peer` that will be promised `reserve_bytes` of KV cache (may first make others
        yield and wait up to `evict_wait_s` for evicted ones to free it). Raises PeerLimitExceeded or
        ServerLimitExceeded, or SessionEvicted where a worthier newcomer took its place meanwhile; the ticket is
        released on every exit path. `granting`: its cache opens next (`reserve`), a claim on what is free;
        `shadow`: a shadow session (it yields whole to a real newcomer, after holds without work)."""
        self._check(peer, reserve_bytes, shadow)
        ticket = SessionTicket(peer=peer, reserved_bytes=reserve_bytes, opening_tokens=opening_tokens,
                               granting=granting, work_horizon_s=self.limits.session_idle_evict_s,
                               shadow=shadow)  # fmt: skip
        self._tickets.add(ticket)
        self._per_peer[peer].add(ticket)
        try:
            if reserve_bytes > 0:
                await self._make_room(reserve_bytes, ticket)
            if ticket.eviction is not None:
                raise ticket.eviction
            yield ticket
        finally:
            if ticket.cache_opened and ticket.token_steps < 2:
                self._record_unworked_close(peer)
            self._tickets.discard(ticket)
            peer_tickets = self._per_peer.get(peer)
            if peer_tickets is not None:
                peer_tickets.discard(ticket)
                if not peer_tickets:
                    del self._per_peer[peer]
            ticket.released.set()

    @contextlib.asynccontextmanager
    async def reserve(
        self, executor: EngineExecutor, opening: SessionOpen
    ) -> AsyncIterator[tuple[SessionTicket, SessionCache | None]]:
        """Admits a session and opens its KV cache (none for a `max_length=0` probe); yields its ticket and cache.
        Everything is given back on exit. An open that brings no token (`opening_tokens` 0) does not wait in line for
        memory (a place in line would be a hold bought with no work)."""
        peer, spec, opening_tokens = opening.peer, opening.spec, opening.opening_tokens
        if spec.max_length_tokens == 0:  # a probe: only zero-token steps fit, nothing to reserve
            async with self.admit(peer, 0) as ticket:
                yield ticket, None
            return
        alloc_timeout_s = 0.0 if opening_tokens == 0 else opening.alloc_timeout_s
        async with self.admit(
            peer, executor.session_bytes(spec), opening_tokens=opening_tokens, granting=True, shadow=spec.shadow
        ) as ticket:
            if ticket.awaits_release:  # in line first for the pages of the sessions ending for it
                alloc_timeout_s = None if alloc_timeout_s is None else max(alloc_timeout_s, self.limits.evict_wait_s)
            ticket.bytes_per_token = ticket.reserved_bytes / (spec.batch_size * spec.max_length_tokens)
            ticket.waiting = True  # (a refused allocation ends the ticket with it)
            async with executor.open_session(spec, alloc_timeout_s) as cache:
                ticket.waiting = ticket.granting = False
                ticket.cache_opened = True
                ticket.opened_at = time.monotonic()  # the grace for its first step counts from here
                ticket.lease = cache if isinstance(cache, EngineSessionCache) else None
                yield ticket, cache

    def _check(self, peer: str, reserve_bytes: int, shadow: bool) -> None:
        limits = self.limits
        if limits.max_sessions_per_peer and self.peer_sessions(peer) >= limits.max_sessions_per_peer:
            raise PeerLimitExceeded(
                f"Could not open a session: this peer already has {self.peer_sessions(peer)} open sessions, the "
                f"limit per peer is max_sessions_per_peer={limits.max_sessions_per_peer}",
                reason="peer_sessions",
            )
        if limits.max_sessions_total and len(self._tickets) >= limits.max_sessions_total:
            if not self._evict_for_slot(shadow):
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

    # ---- who yields, least valuable first

    def _live(self, exclude: SessionTicket | None) -> list[SessionTicket]:
        """The sessions not evicted yet, but `exclude`."""
        return [t for t in self._tickets if t is not exclude and not t.evicted.is_set()]

    def _never_worked(self, exclude: SessionTicket | None = None) -> list[SessionTicket]:
        """Sessions held by zero-token steps alone, oldest first: they yield whole, at once."""
        grace_s = self.limits.first_token_grace_s
        return sorted((t for t in self._live(exclude) if t.never_worked(grace_s)), key=lambda t: t.opened_at)

    def _shadows(self, newcomer: SessionTicket | None) -> list[SessionTicket]:
        """Shadow sessions, youngest first, where `newcomer` is a real session (or the head of the line, None): they
        yield whole (a shadow is a client's check of another server; ending it costs that client one session's
        verification, no user a token), never to another shadow."""
        if newcomer is not None and newcomer.shadow:
            return []
        return sorted((t for t in self._live(newcomer) if t.shadow), key=lambda t: -t.opened_at)

    def _idle_candidates(self, exclude: SessionTicket | None = None) -> list[SessionTicket]:
        """Sessions that did real work but none for `session_idle_evict_s`, longest idle first: they yield whole."""
        if not self.limits.session_idle_evict_s:
            return []
        idle = (t for t in self._live(exclude) if t.num_tokens and t.idle_s >= self.limits.session_idle_evict_s)
        return sorted(idle, key=lambda t: t.last_used_at)

    def _idle_promises(self, exclude: SessionTicket | None) -> Iterator[tuple[SessionTicket, int]]:
        """The unused promises of sessions idle for `kv_promise_idle_s`, longest idle first: the sessions keep their
        pages and run on."""
        if not self.limits.kv_promise_idle_s:
            return
        idle = (t for t in self._live(exclude) if t.promised_bytes > 0 and t.idle_s >= self.limits.kv_promise_idle_s)
        for ticket in sorted(idle, key=lambda t: t.last_used_at):
            yield ticket, ticket.promised_bytes

    def _pace_tokens(self, ticket: SessionTicket) -> float:
        """Tokens the session would process within `session_idle_evict_s` at its recent rate: its decayed token count
        over the exponential window it has lived since its prefill (at least `first_token_grace_s`, so that one quick
        step of a young session reads as a pace, not as a minute's). A steady r tokens/s reads r *
        session_idle_evict_s."""
        horizon_s = self.limits.session_idle_evict_s
        recent = ticket.recent_tokens
        if not recent or ticket.prefilled_at is None:
            return 0.0
        lived_s = time.monotonic() - ticket.prefilled_at
        window_s = max(horizon_s * -math.expm1(-lived_s / horizon_s), self.limits.first_token_grace_s, 1e-3)
        return recent * horizon_s / window_s

    def _record_unworked_close(self, peer: str) -> None:
        """A session of `peer` closed (or was ended) with no token after its prefill: the peer reopens for the next
        `session_idle_evict_s` (bounded: the oldest records go first)."""
        now = time.monotonic()
        self._unworked_closes[peer] = now
        self._unworked_closes.move_to_end(peer)
        horizon_s = self.limits.session_idle_evict_s
        while self._unworked_closes:
            oldest_peer, closed_at = next(iter(self._unworked_closes.items()))
            if len(self._unworked_closes) <= MAX_REOPEN_RECORDS and now - closed_at < horizon_s:
                break
            del self._unworked_closes[oldest_peer]

    def _reopening(self, peer: str) -> bool:
        """A session of `peer` closed with no token after its prefill within `session_idle_evict_s`: its sessions
        are opened and closed, not used (an honest client's close after a prefill alone is rare: a chain that broke
        at once), so its prefills in the server's queue keep no promise beyond their tokens."""
        closed_at = self._unworked_closes.get(peer)
        return closed_at is not None and time.monotonic() - closed_at < self.limits.session_idle_evict_s

    def _queued_reopen(self, ticket: SessionTicket) -> bool:
        """Its opening request brought tokens not processed yet (its prefill waits in the runtime's queue), and its
        peer reopens: under load a hoarder closing and reopening sessions keeps most of them in this state."""
        return ticket.prefilled_at is None and bool(ticket.opening_tokens) and self._reopening(ticket.peer)

    def _pace_unknown(self, ticket: SessionTicket) -> bool:
        """Less than `first_token_grace_s` since its prefill, or a reopening peer's prefill still queued (a
        zero-token hold has none: it yields by `never_worked`). A fresh session's first decode token follows its
        prefill by a round trip through the rest of its chain, so right after its prefill it has processed no token
        at any pace: it is neither slow nor fast yet. Another peer's queued prefill keeps its whole promise: it is
        the guarantee the promise is for (decision 0016's addenda)."""
        if ticket.prefilled_at is None:
            return self._queued_reopen(ticket)
        return time.monotonic() - ticket.prefilled_at < self.limits.first_token_grace_s

    def _unearned_promise(self, ticket: SessionTicket) -> int:
        """Promised cache beyond room for the tokens it holds and its pace (`num_tokens` counts positions times rows,
        as `bytes_per_token` does), a reopening peer's queued prefill beyond room for its opening tokens; 0 for
        another session with no token (a zero-token hold yields whole: `never_worked`)."""
        lease = ticket.lease
        tokens = ticket.num_tokens or (ticket.opening_tokens or 0 if self._queued_reopen(ticket) else 0)
        if lease is None or not self.limits.session_idle_evict_s or not ticket.bytes_per_token or not tokens:
            return 0
        needed = math.ceil((tokens + self._pace_tokens(ticket)) * ticket.bytes_per_token)
        return max(0, min(lease.promised_bytes, lease.taken_bytes + lease.promised_bytes - needed))

    def _pace_promises(self, exclude: SessionTicket | None, *, fresh: bool) -> Iterator[tuple[SessionTicket, int]]:
        """Promises beyond the pace of their sessions (`_unearned_promise`). Of sessions whose pace is known, slowest
        first: a trickle of tokens (a cheap identity's step every few seconds) keeps a promise of a few tokens, not its
        whole `max_length`. Of those whose pace is not known yet (`fresh`: their promise beyond their tokens and what
        they did since their prefill), reopening peers' first, then the longest since its prefill: they yield after
        every slow promise and every share's excess (a session that just opened is not the slowest of all), and still
        yield (a hoarder opening session after session, a token each, keeps no newcomer out, its prefills queued or
        not). The sessions keep their pages and run on; their next token asks the whole promise back."""
        offers = {t: self._unearned_promise(t) for t in self._live(exclude) if self._pace_unknown(t) == fresh}

        def order(t: SessionTicket) -> tuple[float, ...]:  # (a queued prefill is the freshest of its kind)
            if not fresh:
                return (self._pace_tokens(t), t.last_used_at)
            return (not self._reopening(t.peer), math.inf if t.prefilled_at is None else t.prefilled_at, t.last_used_at)

        for ticket in sorted((t for t in offers if offers[t]), key=order):
            yield ticket, offers[ticket]

    def _promises_over_share(self, ticket: SessionTicket | None) -> Iterator[tuple[SessionTicket, int]]:
        """Unused promises beyond a fair share: the cache split evenly among the peers holding promises and the
        newcomer's, largest excess first. A crowd of identities only splits the share finer: each of n holders of
        a full cache holds more than 1/(n+1) of it, so a newcomer always reaches its share."""
        holders: dict[str, list[SessionTicket]] = defaultdict(list)
        for t in self._live(ticket):
            if t.promised_bytes > 0:
                holders[t.peer].append(t)
        newcomer = None if ticket is None else ticket.peer
        share = int(self.budget.max_size_bytes) // (len(holders) + (newcomer not in holders))
        others = [peer for peer in holders if peer != newcomer]  # a peer's own sessions never pay for its next one
        excess = {p: sum(t.held_bytes for t in self._per_peer[p] if t is not ticket) - share for p in others}
        for peer in sorted(others, key=lambda p: -excess[p]):
            left = excess[peer]
            for t in sorted(holders[peer], key=lambda t: -t.promised_bytes):
                if left <= 0:
                    break
                nbytes = min(left, t.promised_bytes)
                yield t, nbytes
                left -= nbytes

    def _evict(self, ticket: SessionTicket, why: str) -> None:
        if ticket.shadow and not ticket.never_worked(self.limits.first_token_grace_s):
            ticket.evict(f"Session ended by the server: a shadow session (verification) yields its {why} to a real one")
        else:
            if ticket.num_tokens:
                cause = f"no token processed for {ticket.idle_s:.0f} s (session_idle_evict={self.limits.session_idle_evict_s} s)"
            else:
                cause = "no token processed since it opened (zero-token steps are not use)"
            ticket.evict(
                f"Session ended by the server: {cause} and its {why} was needed by another user; open a new session "
                f"(replay the history) to continue"
            )
        self.num_evicted += 1
        logger.info(
            f"admission.evicted(peer={ticket.peer:.12}, bytes={ticket.held_bytes}, tokens={ticket.num_tokens}, "
            f"idle_s={ticket.idle_s:.1f}, why={why})"
        )

    def _evict_for_slot(self, shadow: bool) -> bool:
        """Ends the least valuable session for a newcomer's slot (a `shadow` newcomer takes none from a shadow)."""
        candidates = self._never_worked() + ([] if shadow else self._shadows(None)) + self._idle_candidates()
        if not candidates:
            return False
        self._evict(candidates[0], "session slot")
        return True  # its slot is counted free now: the evicted session ends within a loop iteration

    async def _make_room(self, size: int, ticket: SessionTicket) -> None:
        """Makes the least valuable holds yield when `size` does not fit what is free beside the allocations in line,
        if that makes it fit (nothing yields otherwise: the allocation then waits or fails as before). A ticket whose
        cache opens next (`granting`) does not wait here for evicted sessions to end: it waits in the page line,
        first in line for what they free (`awaits_release`)."""
        pending = [t for t in self._tickets if t.evicted.is_set() and not t.released.is_set()]
        free = self._free_bytes(ticket) - int(self.budget.bytes_waiting)  # queued allocations are served first
        evicted = self._yield_for(size, free, ticket) if free < size else []
        if evicted is None:
            return
        if ticket.granting:
            ticket.awaits_release = bool(pending or evicted)
        else:
            await self._wait_released(pending + evicted)

    def _on_short(self, size: int) -> None:
        """The head of the allocation line lacks room for `size` bytes: the same yield rule, for it (evicted sessions
        free their pages when they end, which grants it)."""
        waiting = [t for t in self._tickets if t.waiting]  # the head: the first admitted of those in line
        head = min(waiting, key=lambda t: t.opened_at) if waiting else None
        free = self._free_bytes(head)
        if free < size:
            self._yield_for(size, free, head)

    def _free_bytes(self, ticket: SessionTicket | None) -> int:
        """What the store has neither given nor promised, plus what evicted sessions are about to free, less what
        other newcomers admitted just before (their caches not open yet) will take of it."""
        free = int(self.budget.bytes_left)
        for t in self._tickets:
            if t.evicted.is_set() and not t.released.is_set():
                # an evicted session frees what it holds; an evicted newcomer still in line gives its place back
                # (granted first, it ends at once)
                free += t.reserved_bytes if t.granting and t.waiting else 0 if t.granting else t.held_bytes
            elif t.granting and not t.waiting and t is not ticket:
                free -= t.reserved_bytes
        return free

    def _yield_for(self, size: int, free: int, ticket: SessionTicket | None) -> list[SessionTicket] | None:
        """Ends and withdraws the least valuable holds (never `ticket`'s) until `size` fits `free` plus what they
        give; does nothing and returns None where all of them would not be enough, else the evicted tickets."""
        evicted: list[SessionTicket] = []
        withdrawn: dict[SessionTicket, int] = {}
        whole = self._never_worked(exclude=ticket) + self._shadows(ticket) + self._idle_candidates(exclude=ticket)
        for candidate in whole:
            if free >= size:
                break
            if candidate not in evicted and candidate.held_bytes > 0:
                evicted.append(candidate)
                free += candidate.held_bytes
        # an open that brings no token takes nothing from sessions by their pace: it is the least of holds itself
        paced = ticket is None or ticket.opening_tokens != 0
        slow = self._pace_promises(ticket, fresh=False) if paced else iter(())
        fresh = self._pace_promises(ticket, fresh=True) if paced else iter(())
        # the pace tiers offer a session's whole unearned promise, not a part on top of what another tier took: a
        # queued prefill keeps room for its tokens whatever took its share's excess before
        tiers = ((self._idle_promises(ticket), False), (slow, True), (self._promises_over_share(ticket), False),
                 (fresh, True))  # fmt: skip
        for tier, offers_total in tiers:
            for candidate, nbytes in tier:
                if free >= size:
                    break
                if candidate in evicted:
                    continue
                assert candidate.lease is not None  # (only sessions with a promise are offered)
                taken = withdrawn.get(candidate, 0)
                nbytes = candidate.lease.withdrawable(max(taken, nbytes) if offers_total else taken + nbytes) - taken
                if nbytes > 0:
                    withdrawn[candidate] = withdrawn.get(candidate, 0) + nbytes
                    free += nbytes
        if free < size:
            return None
        for candidate in evicted:
            self._evict(candidate, "KV cache")
        for candidate, nbytes in withdrawn.items():
            self._withdraw(candidate, nbytes)
        return evicted

    def _withdraw(self, ticket: SessionTicket, nbytes: int) -> None:
        assert ticket.lease is not None
        dropped = ticket.lease.withdraw(nbytes)
        ticket.withdrawn = True
        self.num_withdrawn += 1
        logger.info(
            f"admission.withdrawn(peer={ticket.peer:.12}, bytes={dropped}, tokens={ticket.num_tokens}, "
            f"idle_s={ticket.idle_s:.1f})"
        )

    async def _wait_released(self, tickets: list[SessionTicket]) -> None:
        if not tickets:
            return
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
