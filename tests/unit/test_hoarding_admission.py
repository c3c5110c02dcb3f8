"""What yields to a new session under memory pressure, against the engine executor's real pool (sessions are
promised their length at open and take pages as tokens arrive): sessions held by zero-token steps go first and whole
(after a step, or a grace for the first one), then the unused promises of idle sessions (they keep their pages, and
ask the promise back at their next token), then whole sessions idle for `session_idle_evict_s`, then promises beyond
a fair share per peer; a session doing real work keeps its pages; a session that just ran its prefill is not judged
by its pace before it has one (its promise goes last); an open that brings no token does not wait in line; an allocation in line gets room as holds become yieldable; a working shadow session
(verification) yields whole to a real newcomer, never to another shadow."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

import pytest
import torch

from corolla.engine import EngineConfig, SpanEngine
from corolla.models.registry import get_family
from corolla.server.backend import SpanBackend
from corolla.server.core.admission import SessionAdmission, SessionTicket
from corolla.server.core.engine_executor import EngineExecutor, EngineSessionCache
from corolla.server.core.executor import SessionOpen, SessionSpec
from corolla.server.core.limits import PeerLimits, SessionEvicted
from corolla.server.core.runtime import Runtime
from corolla.utils.errors import AllocationFailed
from helpers.tiny_models import tiny_config

H, NUM_BLOCKS, PAGE = 64, 2, 16
PAGES = 8  # the whole pool: two sessions of FULL
FULL = 4 * PAGE  # the per-peer maximum (half of the cache)
SPAN = tuple(range(NUM_BLOCKS))


@pytest.fixture(scope="module")
def backend() -> SpanBackend:
    torch.manual_seed(0)
    config = tiny_config("llama", NUM_BLOCKS)
    blocks = {i: get_family(config).build_block(config, i) for i in SPAN}
    return SpanBackend(blocks, config=config, dtype=torch.float32, device="cpu")


@contextlib.contextmanager
def executor_of(backend: SpanBackend):
    """An engine executor whose pool holds exactly `PAGES` pages of `PAGE` tokens."""
    probe = EngineConfig(kv_pool_bytes=1 << 20, page_size_tokens=PAGE, max_seq_len_tokens=FULL, max_batch_rows=8)
    page_bytes = SpanEngine.from_blocks([backend.blocks[i] for i in SPAN], probe).pool.page_bytes
    config = EngineConfig(kv_pool_bytes=PAGES * page_bytes, page_size_tokens=PAGE, max_seq_len_tokens=FULL,
                          max_batch_rows=8)  # fmt: skip
    engine = SpanEngine.from_blocks([backend.blocks[i] for i in SPAN], config)
    with Runtime(max_batch_size_tokens=64) as runtime:
        executor = EngineExecutor(backend, engine, runtime)
        assert executor.max_size_bytes == PAGES * page_bytes
        yield executor


class Held:
    """A session as the handler runs it: admitted, its cache open, steps recorded on its ticket (`work` grows its
    pages as a step would), until `end()` or its eviction."""

    def __init__(self, admission: SessionAdmission, executor: EngineExecutor, peer: str, max_length: int, *,
                 first_tokens: int = 0, alloc_timeout_s: float = 0.0, step: bool = True,
                 probe: bool = False, shadow: bool = False):  # fmt: skip
        self.admission, self.executor, self.peer = admission, executor, peer
        self.probe = probe  # its opening request is a prefix probe: tokens not known, none processed
        self.shadow = shadow  # a shadow session (`protocol.shadow`)
        self.max_length, self.first_tokens, self.alloc_timeout_s, self.step = (
            max_length,
            first_tokens,
            alloc_timeout_s,
            step,
        )
        self.opened, self.ending = asyncio.Event(), asyncio.Event()
        self.ticket: SessionTicket | None = None
        self.cache: EngineSessionCache | None = None
        self.position = 0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        spec = SessionSpec(SPAN, 1, self.max_length, shadow=self.shadow)
        opening = SessionOpen(self.peer, spec, self.alloc_timeout_s, None, None if self.probe else self.first_tokens)
        reservation = self.admission.reserve(self.executor, opening)
        async with reservation as (ticket, cache):
            assert isinstance(cache, EngineSessionCache)
            self.ticket, self.cache = ticket, cache
            if self.step:
                self.work(self.first_tokens)
            self.opened.set()
            ending = asyncio.ensure_future(self.ending.wait())
            evicted = asyncio.ensure_future(ticket.evicted.wait())
            await asyncio.wait({ending, evicted}, return_when=asyncio.FIRST_COMPLETED)
            ending.cancel()
            evicted.cancel()
            if ticket.eviction is not None and not self.ending.is_set():
                raise ticket.eviction

    def work(self, tokens: int) -> None:
        """A step of `tokens` tokens: its positions take pages (`SpanEngine.validate`), then the ticket records it."""
        assert self.cache is not None and self.ticket is not None
        if tokens:
            self.executor.engine.pool.grow(self.cache.session.slots, self.position + tokens)
        self.position += tokens
        self.ticket.touch(tokens)

    @property
    def pages(self) -> int:
        assert self.cache is not None
        return len(self.cache.session.slots[0].pages)

    async def wait_open(self) -> Held:
        done, _ = await asyncio.wait({self.task, asyncio.ensure_future(self.opened.wait())}, timeout=5,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        if self.task in done:
            self.task.result()  # its refusal
        assert self.opened.is_set()
        return self

    async def end(self) -> None:
        self.ending.set()
        await asyncio.gather(self.task, return_exceptions=True)


@contextlib.asynccontextmanager
async def sessions() -> AsyncIterator[list[Held]]:
    held: list[Held] = []
    try:
        yield held
    finally:
        for session in held:
            await session.end()


async def opened(held: list[Held], *args, **kwargs) -> Held:
    session = Held(*args, **kwargs)
    held.append(session)
    return await session.wait_open()


async def test_sessions_held_by_zero_token_steps_yield_whole_at_once(backend) -> None:
    with executor_of(backend) as executor:
        admission = SessionAdmission(PeerLimits(), executor)
        async with sessions() as held:
            hoarders = [await opened(held, admission, executor, f"sybil-{i}", FULL) for i in range(2)]
            assert executor.bytes_left == 0 and all(h.pages == 0 for h in hoarders)  # promised, nothing taken
            started = time.monotonic()
            user = await opened(held, admission, executor, "user", FULL, first_tokens=5)
            assert time.monotonic() - started < 1.0 and user.pages == 1
            await asyncio.sleep(0)
            ended = [h for h in hoarders if h.task.done()]
            assert len(ended) == 1 and isinstance(ended[0].task.exception(), SessionEvicted)
            assert "zero-token steps are not use" in str(ended[0].task.exception())
            assert admission.num_evicted == 1 and admission.num_withdrawn == 0


async def test_a_session_opened_without_a_step_yields_after_the_grace(backend) -> None:
    with executor_of(backend) as executor:
        admission = SessionAdmission(PeerLimits(first_token_grace_s=0.3), executor)
        async with sessions() as held:
            for i in range(2):  # opened, no step answered yet (the stream's first request still in flight)
                await opened(held, admission, executor, f"slow-{i}", FULL, first_tokens=1, step=False)
            with pytest.raises(AllocationFailed):
                await opened(held, admission, executor, "user", FULL, first_tokens=5)
            await asyncio.sleep(0.35)
            await opened(held, admission, executor, "user", FULL, first_tokens=5)
            assert admission.num_evicted == 1


async def test_a_prefix_probe_is_no_hold_before_its_next_step(backend) -> None:
    with executor_of(backend) as executor:
        admission = SessionAdmission(PeerLimits(first_token_grace_s=0.3), executor)
        async with sessions() as held:
            for i in range(2):  # each answered its probe (a zero-token step); its tokens come with the next one
                await opened(held, admission, executor, f"chat-{i}", FULL, probe=True)
            with pytest.raises(AllocationFailed):
                await opened(held, admission, executor, "hoarder", FULL, first_tokens=0)
            await asyncio.sleep(0.35)  # no next step within the grace: a hold after all
            await opened(held, admission, executor, "user", FULL, first_tokens=5)
            assert admission.num_evicted == 1


async def test_an_idle_sessions_promise_goes_first_and_comes_back(backend) -> None:
    with executor_of(backend) as executor:
        admission = SessionAdmission(PeerLimits(kv_promise_idle_s=0.1, max_kv_fraction_per_peer=1.0), executor)
        async with sessions() as held:
            idle = await opened(held, admission, executor, "thinking", FULL, first_tokens=20)  # 2 pages, 2 promised
            busy = await opened(held, admission, executor, "busy", FULL, first_tokens=20)
            await asyncio.sleep(0.15)
            busy.work(1)  # "busy" generates; "thinking" has been idle for kv_promise_idle_s
            newcomer = await opened(held, admission, executor, "newcomer", 2 * PAGE, first_tokens=3)
            assert not idle.task.done() and idle.pages == 2 and idle.ticket.withdrawn
            assert admission.num_evicted == 0 and admission.num_withdrawn == 1 and executor.bytes_left == 0
            with pytest.raises(AllocationFailed, match="promise went to another session"):
                idle.work(FULL - idle.position)  # no free page left for what was withdrawn
            busy.work(FULL - busy.position)  # "busy" still reaches its whole length
            await newcomer.end()
            idle.work(1)  # its next token asks the promise back: now it can be kept
            assert not idle.ticket.withdrawn
            idle.work(FULL - idle.position)
            assert idle.pages == 4


async def test_working_sessions_keep_their_pages_and_a_fair_share_of_promises(backend) -> None:
    with executor_of(backend) as executor:
        admission = SessionAdmission(PeerLimits(), executor)
        async with sessions() as held:
            workers = [await opened(held, admission, executor, f"w{i}", FULL, first_tokens=1) for i in range(2)]
            for worker in workers:
                worker.work(PAGE)  # 2 pages each, 2 more promised, generating
            # 3 peers: 8/3 pages each; each worker holds 4: a page of each promise goes to the newcomer
            newcomer = await opened(held, admission, executor, "newcomer", 2 * PAGE, first_tokens=3)
            assert [w.cache.session.slots[0].promised_pages for w in workers] == [1, 1]
            # 4 peers: 2 pages each; the newcomer just opened (its pace is not known yet): a page over the share of each
            await opened(held, admission, executor, "another", 2 * PAGE, first_tokens=3)
            assert newcomer.cache.session.slots[0].promised_pages == 1 and not newcomer.ticket.withdrawn
            assert sum(w.cache.session.slots[0].promised_pages for w in workers) == 0
            assert all(not w.task.done() and w.pages == 2 for w in workers) and admission.num_evicted == 0
            withdrawn = admission.num_withdrawn
            with pytest.raises(AllocationFailed):  # 5 peers: 1.6 pages each; nobody holds a whole page over it
                await opened(held, admission, executor, "greedy", FULL, first_tokens=3)
            assert admission.num_withdrawn == withdrawn and all(not w.task.done() and w.pages == 2 for w in workers)


async def test_a_trickles_promise_goes_before_a_writers(backend) -> None:
    """Two sessions of the whole length, both stepping (never idle): a trickle (a token now and then, as 32 cheap
    identities each stepping a token every 2 s hold a cache) and a writer generating at full pace. A newcomer's room
    comes from the trickle's promise beyond its pace; the writer keeps its promise and reaches its whole length;
    nobody is ended. (The fair share alone took a page from each.) The pace's horizon is 6 s here, not 60 s, so that
    the test's half second is a long life."""
    limits = PeerLimits(max_kv_fraction_per_peer=1.0, session_idle_evict_s=6.0, first_token_grace_s=0.2)
    with executor_of(backend) as executor:
        admission = SessionAdmission(limits, executor)
        async with sessions() as held:
            trickle = await opened(held, admission, executor, "trickle", FULL, first_tokens=1)
            writer = await opened(held, admission, executor, "writer", FULL, first_tokens=4)
            for _ in range(12):
                writer.work(1)
            await asyncio.sleep(0.5)
            trickle.work(1)  # a token in half a second: 12 within the horizon, its one page holds them
            writer.work(1)  # 13 in half a second: a 160-token pace, more than its whole length
            assert executor.bytes_left == 0 and trickle.pages == 1 and writer.pages == 2
            await opened(held, admission, executor, "newcomer", 2 * PAGE, first_tokens=3)
            assert trickle.ticket.withdrawn and trickle.cache.session.slots[0].promised_pages == 0
            assert writer.cache.session.slots[0].promised_pages == 2 and not writer.ticket.withdrawn
            writer.work(FULL - writer.position)
            trickle.work(PAGE - trickle.position)  # runs on in the page it holds
            assert admission.num_evicted == 0 and not trickle.task.done() and not writer.task.done()


async def test_an_open_without_tokens_does_not_wait_in_line(backend) -> None:
    with executor_of(backend) as executor:
        admission = SessionAdmission(PeerLimits(kv_promise_idle_s=0), executor)
        async with sessions() as held:
            for i in range(2):
                await opened(held, admission, executor, f"w{i}", FULL, first_tokens=1)
            started = time.monotonic()
            with pytest.raises(AllocationFailed, match="alloc_timeout is 0"):
                await opened(held, admission, executor, "placeholder", FULL, first_tokens=0, alloc_timeout_s=5.0)
            assert time.monotonic() - started < 0.5


async def test_an_allocation_in_line_gets_room_as_holds_become_yieldable(backend) -> None:
    with executor_of(backend) as executor:
        admission = SessionAdmission(PeerLimits(first_token_grace_s=0.3), executor)
        async with sessions() as held:
            for i in range(2):
                await opened(held, admission, executor, f"slow-{i}", FULL, first_tokens=1, step=False)
            started = time.monotonic()  # nothing yields yet: the user waits in line, nudging it
            await opened(held, admission, executor, "user", FULL, first_tokens=5, alloc_timeout_s=3.0)
            assert 0.2 < time.monotonic() - started < 1.5 and admission.num_evicted == 1


FRESH = PeerLimits(max_kv_fraction_per_peer=1.0, session_idle_evict_s=6.0, first_token_grace_s=0.3)


async def test_a_fresh_sessions_promise_is_not_taken_for_its_pace_before_it_has_one(backend) -> None:
    """A session that just ran its prefill has processed no token at any pace yet (its first decode token follows
    a round trip through the rest of its chain): a newcomer's room comes from a trickle's promise, not from its.
    (Judged at once, its pace read 0, the slowest of all, and its promise went first.)"""
    with executor_of(backend) as executor:
        admission = SessionAdmission(FRESH, executor)
        async with sessions() as held:
            trickle = await opened(held, admission, executor, "trickle", FULL, first_tokens=1)
            await asyncio.sleep(0.5)
            trickle.work(1)  # a token in half a second
            fresh = await opened(held, admission, executor, "fresh", FULL, first_tokens=4)  # its prefill, just now
            assert executor.bytes_left == 0
            await opened(held, admission, executor, "newcomer", 2 * PAGE, first_tokens=3)
            assert not fresh.ticket.withdrawn and fresh.cache.session.slots[0].promised_pages == 3
            assert trickle.ticket.withdrawn and trickle.cache.session.slots[0].promised_pages == 0
            for _ in range(FULL - fresh.position):
                fresh.work(1)  # it reaches its whole length
            assert admission.num_evicted == 0 and not trickle.task.done()


async def test_sessions_that_never_decode_after_their_prefill_do_not_keep_a_newcomer_out(backend) -> None:
    """Two identities reopen a session of half the cache with a one-token prefill every 0.2 s, faster than their
    pace can be read (0.3 s): a newcomer asking for half is admitted at once (sessions not judged yet still yield,
    last)."""
    with executor_of(backend) as executor:
        admission = SessionAdmission(dataclasses.replace(FRESH, max_kv_fraction_per_peer=0.5), executor)
        stop = asyncio.Event()

        async def reopen(peer: str) -> None:
            while not stop.is_set():
                session = Held(admission, executor, peer, FULL, first_tokens=1)
                with contextlib.suppress(AllocationFailed, SessionEvicted, asyncio.TimeoutError):
                    await session.wait_open()
                    await asyncio.wait_for(stop.wait(), 0.2)
                await session.end()

        async with sessions() as held:
            hoarders = [asyncio.create_task(reopen(f"sybil-{i}")) for i in range(2)]
            await asyncio.sleep(0.5)
            started = time.monotonic()
            await opened(held, admission, executor, "user", FULL, first_tokens=5)
            assert time.monotonic() - started < 1.0
            stop.set()
            await asyncio.gather(*hoarders)


async def test_a_reopening_peers_queued_prefill_keeps_no_promise_beyond_its_tokens(backend) -> None:
    """Two identities close their sessions after a one-token prefill and open them again; under load the new
    sessions' prefills wait in the runtime's queue (opened, no step processed yet), where neither their pace nor
    their tokens could be read. A newcomer asking for half of the cache is admitted at once: those peers closed a
    session without work, so their queued sessions keep room for their opening token only (they open and run on).
    (Before, a queued prefill kept its whole promise for `first_token_grace_s`: refused, as a peer without such a
    close still is: `test_a_session_opened_without_a_step_yields_after_the_grace`.)"""
    with executor_of(backend) as executor:
        admission = SessionAdmission(PeerLimits(), executor)
        async with sessions() as held:
            for i in range(2):  # a session with a prefill and nothing after it, closed
                closed = await opened(held, admission, executor, f"sybil-{i}", FULL, first_tokens=1)
                await closed.end()
            queued = [await opened(held, admission, executor, f"sybil-{i}", FULL, first_tokens=1, step=False)
                      for i in range(2)]  # fmt: skip
            assert executor.bytes_left == 0
            started = time.monotonic()
            await opened(held, admission, executor, "user", FULL, first_tokens=5)
            assert time.monotonic() - started < 1.0
            assert all(q.cache.session.slots[0].promised_pages >= 1 and not q.task.done() for q in queued)
            for session in queued:
                session.work(1)  # their prefills run: room for them was kept
            assert admission.num_evicted == 0


async def test_a_working_shadow_session_yields_whole_to_a_real_one_and_not_to_another_shadow(backend) -> None:
    with executor_of(backend) as executor:
        admission = SessionAdmission(PeerLimits(), executor)
        async with sessions() as held:
            shadows = [await opened(held, admission, executor, f"verifier-{i}", FULL, first_tokens=1, shadow=True)
                       for i in range(2)]  # fmt: skip
            for shadow in shadows:
                shadow.work(PAGE)  # mirroring: 2 pages each, 2 more promised
            with pytest.raises(AllocationFailed):  # a shadow takes nothing from shadows but their fair share's excess
                await opened(held, admission, executor, "another-verifier", FULL, first_tokens=3, shadow=True)
            assert admission.num_evicted == 0 and not any(s.task.done() for s in shadows)
            user = await opened(held, admission, executor, "user", FULL, first_tokens=3)  # the whole length
            assert user.ticket is not None and not user.ticket.withdrawn
            await asyncio.sleep(0)
            ended = [s for s in shadows if s.task.done()]
            assert len(ended) == 1 and isinstance(ended[0].task.exception(), SessionEvicted)
            assert "shadow session (verification)" in str(ended[0].task.exception())
