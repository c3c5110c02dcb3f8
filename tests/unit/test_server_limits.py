"""Fair-use limits without a network: session admission (per-peer sessions and KV share, idle eviction under
pressure, zero-token keep-alives not counting as use), stream byte budgets, reject reasons by type, chunked forwards
equal to one-task forwards, and answers to re-sent steps (never a second reply to a pushed-and-direct step)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from corolla.engine.kv.kv_pool import KVLayout, KVPool
from corolla.engine.kv.page_queue import PageQueue
from corolla.server.core.admission import ForwardSlots, SessionAdmission
from corolla.server.core.executor import SessionSpec
from corolla.server.core.forward_chunks import plan_token_chunks, run_forward_chunked
from corolla.server.core.limits import (
    DuplicateStep,
    PeerLimitExceeded,
    PeerLimits,
    ServerLimitExceeded,
    SessionEvicted,
    SessionTimeouts,
    StreamStalled,
    peer_key,
)
from corolla.server.core.peer_bytes import StreamBudget
from corolla.server.core.refusals import rejection_reason
from corolla.server.front.inference_stream import SessionState, StepOrder
from corolla.utils.errors import AllocationFailed

KIB = 1024


PAGE_TOKENS = 16  # one layer of one K and one V head of 8 fp32 values: 64 bytes a token, 1 KiB a page


class PoolBudget:
    """The KV store as admission sees it (what `EngineExecutor` reports): a pool of 1 KiB pages, allocated in line
    (`PageQueue`)."""

    def __init__(self, max_size_bytes: int | None):
        pages = (max_size_bytes if max_size_bytes is not None else 10_000 * KIB) // KIB
        pool = KVPool(num_layers=1, layout=KVLayout.heads(1, 8), num_pages=pages + 1, page_size_tokens=PAGE_TOKENS,
                      max_pages_per_seq=pages, dtype=torch.float32, device="cpu")  # fmt: skip
        assert pool.page_bytes == KIB
        self.queue = PageQueue(pool)

    @property
    def max_size_bytes(self) -> int:
        return (self.queue.pool.num_pages - 1) * KIB

    @property
    def bytes_left(self) -> int:
        return self.queue.pool.layer_pages_free * KIB

    @property
    def bytes_waiting(self) -> int:
        return self.queue.layer_pages_waiting * KIB

    @contextlib.asynccontextmanager
    async def allocate_cache(self, nbytes: int, timeout_s: float | None = 0.0) -> AsyncIterator[None]:
        slots = await self.queue.allocate(1, nbytes // KIB * PAGE_TOKENS, timeout_s)
        try:
            yield
        finally:
            self.queue.release(slots)


async def test_one_peer_holds_at_most_its_share_of_the_cache() -> None:
    cache = PoolBudget(max_size_bytes=100 * KIB)
    admission = SessionAdmission(PeerLimits(max_kv_fraction_per_peer=0.5), cache)
    async with admission.admit("attacker", 40 * KIB), cache.allocate_cache(40 * KIB):
        with pytest.raises(PeerLimitExceeded, match="max_kv_fraction_per_peer") as refused:
            async with admission.admit("attacker", 40 * KIB):
                pass
        assert refused.value.reason == "peer_kv" and isinstance(refused.value, AllocationFailed)
        # another peer still gets half of the cache
        async with admission.admit("victim", 50 * KIB), cache.allocate_cache(50 * KIB, timeout_s=0):
            assert cache.bytes_left == 10 * KIB
    assert admission.num_open == 0 and admission.peer_reserved_bytes("attacker") == 0


async def test_sessions_per_peer_and_in_total() -> None:
    cache = PoolBudget(max_size_bytes=None)
    admission = SessionAdmission(PeerLimits(max_sessions_per_peer=2, max_sessions_total=3), cache)
    async with admission.admit("a", 0), admission.admit("a", 0):
        with pytest.raises(PeerLimitExceeded, match="max_sessions_per_peer=2") as refused:
            async with admission.admit("a", 0):
                pass
        assert refused.value.reason == "peer_sessions"
        async with admission.admit("b", 0):
            with pytest.raises(ServerLimitExceeded, match="max_sessions_total=3") as full:
                async with admission.admit("c", 0):
                    pass
            assert full.value.reason == "sessions_full"
    async with admission.admit("a", 0):  # every ticket went back
        assert admission.num_open == 1


async def _hold(admission: SessionAdmission, cache: PoolBudget, peer: str, nbytes: int, opened: asyncio.Event):
    """A session as the handler runs it: admitted, cache allocated, then idle until evicted."""
    async with admission.admit(peer, nbytes) as ticket, cache.allocate_cache(nbytes, timeout_s=0):
        ticket.touch(1)
        opened.set()
        await ticket.evicted.wait()
        raise ticket.eviction


async def test_idle_sessions_are_evicted_for_a_new_user_and_keepalives_do_not_count() -> None:
    cache = PoolBudget(max_size_bytes=100 * KIB)
    limits = PeerLimits(max_kv_fraction_per_peer=0.5, session_idle_evict_s=0.3, evict_wait_s=2.0)
    admission = SessionAdmission(limits, cache)
    opened = [asyncio.Event(), asyncio.Event()]
    hoarders = [asyncio.create_task(_hold(admission, cache, f"sybil-{i}", 50 * KIB, opened[i])) for i in range(2)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in opened)), 5)
    assert cache.bytes_left == 0
    # not idle long enough yet: nothing is evicted, the newcomer waits for memory as before
    with pytest.raises(AllocationFailed):
        async with admission.admit("newcomer", 30 * KIB), cache.allocate_cache(30 * KIB, timeout_s=0):
            pass
    assert admission.num_evicted == 0
    # zero-token keep-alives are not use: the sessions still become idle
    for _ in range(4):
        for ticket in list(admission._tickets):
            ticket.touch(0)
        await asyncio.sleep(0.1)
    started = time.monotonic()
    async with admission.admit("newcomer", 30 * KIB), cache.allocate_cache(30 * KIB, timeout_s=0):
        assert time.monotonic() - started < 1.0
    assert admission.num_evicted == 1  # one idle session was enough
    await asyncio.sleep(0)
    done = [t for t in hoarders if t.done()]
    assert len(done) == 1 and isinstance(done[0].exception(), SessionEvicted)
    assert "Session ended by the server" in str(done[0].exception())
    for task in hoarders:
        task.cancel()
    await asyncio.gather(*hoarders, return_exceptions=True)
    assert cache.bytes_left == 100 * KIB


async def test_no_eviction_when_it_would_not_make_room() -> None:
    cache = PoolBudget(max_size_bytes=100 * KIB)
    admission = SessionAdmission(PeerLimits(session_idle_evict_s=0.01, max_kv_fraction_per_peer=1.0), cache)
    opened = asyncio.Event()
    hoarder = asyncio.create_task(_hold(admission, cache, "a", 20 * KIB, opened))
    await asyncio.wait_for(opened.wait(), 5)
    async with admission.admit("b", 70 * KIB) as busy, cache.allocate_cache(70 * KIB, timeout_s=0):
        await asyncio.sleep(0.05)
        busy.touch(1)  # "b" is working: only "a" is idle
        with pytest.raises(AllocationFailed):  # even evicting "a" leaves too little: "a" keeps its session
            async with admission.admit("c", 40 * KIB), cache.allocate_cache(40 * KIB, timeout_s=0):
                pass
    assert admission.num_evicted == 0 and not hoarder.done()
    hoarder.cancel()
    await asyncio.gather(hoarder, return_exceptions=True)


def test_stream_budget_per_message_per_peer_and_total() -> None:
    budget = StreamBudget(
        PeerLimits(max_stream_message_bytes=10, max_stream_bytes_per_peer=25, max_stream_bytes_total=40)
    )
    with pytest.raises(PeerLimitExceeded, match="max_stream_message_bytes=10") as big:
        budget.charge("a", 11)
    assert big.value.reason == "stream_message_too_big"
    budget.charge("a", 10)
    budget.charge("a", 10)
    with pytest.raises(PeerLimitExceeded, match="max_stream_bytes_per_peer=25") as peer:
        budget.charge("a", 10)
    assert peer.value.reason == "peer_stream_bytes"
    budget.charge("b", 10)
    budget.charge("c", 10)
    with pytest.raises(ServerLimitExceeded, match="max_stream_bytes_total=40") as total:
        budget.charge("c", 1)  # 20 + 10 + 10 already held
    assert total.value.reason == "stream_bytes_full"
    budget.release("a", 20)
    budget.release("b", 10)
    budget.release("c", 10)
    assert budget.total_bytes == 0 and not budget.per_peer


def test_reasons_come_from_types() -> None:
    assert rejection_reason(PeerLimitExceeded("x", reason="peer_kv")) == "peer_kv"
    assert rejection_reason(SessionEvicted("x")) == "evicted"
    assert rejection_reason(StreamStalled("x")) == "stream_stalled"
    assert rejection_reason(DuplicateStep("x")) == "duplicate_step"
    assert rejection_reason(AllocationFailed("peer_kv in the text")) == "cache_full"
    assert rejection_reason(ValueError("bad")) == "bad_request"
    assert rejection_reason(TimeoutError()) == "timeout"
    assert peer_key(None) == "local"


async def test_forward_slots_limit_concurrency_per_peer() -> None:
    slots = ForwardSlots(per_peer=2)
    running = {"a": 0, "b": 0}
    peak = {"a": 0, "b": 0}

    async def work(peer: str) -> None:
        async with slots.hold(peer):
            running[peer] += 1
            peak[peer] = max(peak[peer], running[peer])
            await asyncio.sleep(0.01)
            running[peer] -= 1

    await asyncio.gather(*(work("a") for _ in range(6)), *(work("b") for _ in range(2)))
    assert peak == {"a": 2, "b": 2} and not slots._slots


# ---- chunked forwards -----------------------------------------------------------------------------------------------


class _InlineRuntime:
    """Runs each submitted task at once; counts them."""

    def __init__(self) -> None:
        self.num_tasks = 0

    def submit(self, fn, **_kwargs):
        self.num_tasks += 1
        future = asyncio.get_running_loop().create_future()
        future.set_result(fn())
        return future


@pytest.fixture(scope="module")
def llama_backend():
    from transformers import LlamaConfig

    from corolla.models.registry import get_family
    from corolla.server.backend import SpanBackend

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        max_position_embeddings=512,
    )
    blocks = {i: get_family(config).build_block(config, i) for i in range(3)}
    with torch.no_grad():
        for block in blocks.values():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape) * 0.2)
    return SpanBackend(blocks, config=config, dtype=torch.float32, device="cpu")


def test_plan_token_chunks() -> None:
    assert plan_token_chunks(10, 1, 4) == [(0, 4), (4, 8), (8, 10)]
    assert plan_token_chunks(10, 2, 4) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert plan_token_chunks(3, 8, 4) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("batch_size", [1, 2])
async def test_chunked_forward_equals_one_task(llama_backend, batch_size: int) -> None:
    backend = llama_backend
    hidden = torch.randn(batch_size, 37, 64)
    expected = backend.forward([0, 1, 2], hidden)
    runtime = _InlineRuntime()
    got = await run_forward_chunked(
        backend,
        runtime,
        [0, 1, 2],
        hidden,
        None,
        active_adapter="",
        chunk_tokens=8,
    )
    chunks = len(plan_token_chunks(37, batch_size, 8))
    assert runtime.num_tasks == 3 * chunks > 3
    # token chunks attend through a cache: the same math in other shapes, equal up to float32 rounding
    torch.testing.assert_close(got, expected, atol=5e-6, rtol=0)
    # deep prompts go block by block (whole length): bit-identical
    prompts = torch.randn(3, 1, 5, 64)
    expected = backend.forward([0, 1, 2], hidden, prompts)
    runtime = _InlineRuntime()
    got = await run_forward_chunked(
        backend,
        runtime,
        [0, 1, 2],
        hidden,
        prompts,
        active_adapter="",
        chunk_tokens=8,
    )
    assert runtime.num_tasks == 3 and torch.equal(got, expected)


# ---- re-sent steps ---------------------------------------------------------------------------------------------------


def _step(step_id: str, *, pushed: bool = False) -> runtime_pb2.ExpertRequest:
    meta = {"step_id": step_id, **({"pushed": True} if pushed else {})}
    tensor = runtime_pb2.Tensor(buffer=b"x", size=[1], dtype="float32")
    return runtime_pb2.ExpertRequest(uid="p.0", tensors=[tensor], metadata=MSGPackSerializer.dumps(meta))


async def _drive(requests: list[runtime_pb2.ExpertRequest], session: SessionState) -> list[str]:
    """Hands requests to a `StepOrder` as a transport does; returns what a runner answered per step it was given."""
    answers: list[str] = []
    ended: asyncio.Future = asyncio.get_running_loop().create_future()
    later = iter(requests[1:])

    def run(_request: runtime_pb2.ExpertRequest, metadata) -> bool:
        if session.resend_pending:
            try:
                answers.append(f"resent:{session.resend_output(metadata.step_id).buffer.decode()}")
            except DuplicateStep:
                answers.append("duplicate_error")
            return True
        answers.append(f"ran:{metadata.step_id}")
        session.record_output(metadata, runtime_pb2.Tensor(buffer=metadata.step_id.encode()))
        return True

    def end(error: BaseException | None) -> None:
        if not ended.done():
            ended.set_result(error)

    timeouts = SessionTimeouts(step_timeout_s=0.5, session_timeout_s=5, request_timeout_s=5)
    order = StepOrder(session, timeouts, time.monotonic() + 5, None, run=run, ready=lambda: None, end=end)
    order.client(requests[0])
    for request in later:
        order.client(request)
    order.client(None)
    assert await ended is None
    return answers


def _session() -> SessionState:
    return SessionState(
        session_id="s", spec=SessionSpec((0,), 1, 8), cache=None, active_adapter="",
        args_structure=None,
    )  # fmt: skip


async def test_resent_steps_are_answered_once_and_pushed_duplicates_stay_silent() -> None:
    # the client re-sends its last step: it gets the cached output, the step does not run twice
    assert await _drive([_step("a"), _step("b"), _step("b")], _session()) == ["ran:a", "ran:b", "resent:b"]
    # a re-sent older step can't be answered from the cache: a clear error, never silence
    assert await _drive([_step("a"), _step("b"), _step("a")], _session()) == ["ran:a", "ran:b", "duplicate_error"]
    # pushed and direct copies of one step: exactly one reply, whichever came first
    assert await _drive([_step("a", pushed=True), _step("a")], _session()) == ["ran:a"]
    assert await _drive([_step("a"), _step("a", pushed=True)], _session()) == ["ran:a"]
    # ... and a true re-send after both copies is answered again
    assert await _drive([_step("a", pushed=True), _step("a"), _step("a")], _session()) == ["ran:a", "resent:a"]


def test_stream_budgets_derive_from_the_largest_step() -> None:
    MiB = 1 << 20
    demo = PeerLimits().with_stream_defaults(8192 * 256 * 4)  # demo model: 8 MiB steps
    assert (demo.max_stream_message_bytes, demo.max_stream_bytes_per_peer, demo.max_stream_bytes_total) == (
        9 * MiB,
        96 * MiB,
        128 * MiB,
    )
    big = PeerLimits().with_stream_defaults(8192 * 8192 * 4)  # a 70B span accepts its own 8192-token prefill
    assert big.max_stream_message_bytes == 257 * MiB and big.max_stream_bytes_total == 3 * 257 * MiB
    fixed = PeerLimits(max_stream_bytes_total=0).with_stream_defaults(MiB)  # explicit values win (0 = unlimited)
    assert fixed.max_stream_bytes_total == 0


def test_limit_flags_reach_the_server_config() -> None:
    from corolla.cli.run_server import parse_config

    config = parse_config(["model", "--new_swarm", "--max_kv_fraction_per_peer", "0.3", "--forward_chunk_tokens", "0"])
    assert config.peer_limits == PeerLimits(max_kv_fraction_per_peer=0.3, forward_chunk_tokens=0)
    assert parse_config(["model", "--new_swarm"]).peer_limits == PeerLimits()
    with pytest.raises(ValueError, match="max_kv_fraction_per_peer"):
        PeerLimits(max_kv_fraction_per_peer=0)


def test_stream_budget_keeps_a_message_of_its_total_for_peers_within_their_share() -> None:
    """Decision 0187, the one front's count (`--num_handlers` 1): a peer holding most of the total is refused a
    message's bytes below it, so another peer's message is taken (main refused it as a full server)."""
    budget = StreamBudget(
        PeerLimits(max_stream_message_bytes=10, max_stream_bytes_per_peer=40, max_stream_bytes_total=40)
    )
    budget.charge("a", 10)
    budget.charge("a", 10)
    budget.charge("a", 10)
    with pytest.raises(ServerLimitExceeded, match="less 10 bytes kept for peers within their share") as full:
        budget.charge("a", 10)
    assert full.value.reason == "stream_bytes_full"
    budget.charge("b", 10)
    assert budget.total_bytes == 40 and budget.per_peer == {"a": 30, "b": 10}
