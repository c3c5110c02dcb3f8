"""The executor contract (what the core asks of `EngineExecutor`), run on CPU against the engine's executor over its paged pool with both span models
(fused kernels, and the blocks run eagerly over the pool) and through a handler process's seam to the core
(`RemoteCore`, the same work through the device process's `SpanCore`): inference steps
equal `SpanBackend.inference_step` on fresh caches (whole span, sub-span, deep prompts, beam reordering, rollback),
forward and backward equal the backend's, cache accounting returns to where it was, allocations fail in time,
concurrent sessions stay independent, a cache of another executor is refused, and KV hand-off either round-trips or
is refused as a whole. Plus the executor's own promise (steps of many sessions merged into one batch) and the rule
that picks fused kernels."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import pytest
import torch
from tests.helpers import reference_backend as oracle

from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.serving import SpanTraits, unsupported_reason
from corolla.models.registry import get_family
from corolla.protocol.prefix import PrefixKeys, chain_hashes, prefix_root
from corolla.server.backend import SpanBackend
from corolla.server.core.engine_executor import EngineExecutor, build_engine_executor
from corolla.server.core.executor import (
    BackwardInputs,
    ForwardInputs,
    SessionOpen,
    SessionSpec,
    StepInputs,
)
from corolla.server.core.limits import PeerLimits
from corolla.server.core.runtime import Runtime
from corolla.server.core.span_core import SpanCore
from corolla.server.handlers.device_channel import DeviceChannel
from corolla.server.handlers.remote_core import DeviceLink, RemoteCore
from corolla.server.metrics import ServerMetrics
from corolla.utils.errors import AllocationFailed
from corolla.utils.tensor_bytes import as_tensor
from helpers.channel_frames import NO_CAPS
from helpers.tiny_models import tiny_config

H, FIRST, N_BLOCKS = 64, 3, 4  # the server holds blocks 3..6
SPAN = tuple(range(FIRST, FIRST + N_BLOCKS))
POOL_BYTES = 1 << 20


@pytest.fixture(scope="module")
def backend() -> SpanBackend:
    torch.manual_seed(0)
    config = tiny_config("llama", FIRST + N_BLOCKS)
    blocks = {}
    for i in SPAN:
        block = get_family(config).build_block(config, i)
        for p in block.parameters():
            torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.15)
        blocks[i] = block
    return SpanBackend(blocks, config=config, dtype=torch.float32, device="cpu")


def make_executor(backend: SpanBackend, runtime: Runtime, *, fused: bool) -> EngineExecutor:
    config = EngineConfig(kv_pool_bytes=POOL_BYTES, page_size_tokens=16, max_seq_len_tokens=64, max_batch_rows=8)
    engine = SpanEngine.from_blocks([backend.blocks[i] for i in SPAN], config, fused=fused)
    assert engine.fused == fused
    return EngineExecutor(backend, engine, runtime, ServerMetrics())


def fused_executor(backend: SpanBackend, runtime: Runtime) -> EngineExecutor:
    return make_executor(backend, runtime, fused=True)


def eager_executor(backend: SpanBackend, runtime: Runtime) -> EngineExecutor:
    return make_executor(backend, runtime, fused=False)


EXECUTORS: dict[str, Callable[[SpanBackend, Runtime], EngineExecutor]] = {
    "eager": eager_executor,
    "fused": fused_executor,
}


# a handler process's seam to the core (`--num_handlers` > 1) over a socketpair to a device channel serving the
# device process's core over the real executor
KINDS = sorted(EXECUTORS) + ["proxy_eager", "proxy_fused"]


@contextlib.asynccontextmanager
async def proxied_executor(real: EngineExecutor, core: SpanCore | None = None) -> AsyncIterator[DeviceLink]:
    device_end, handler_end = socket.socketpair()
    handler_reader, handler_writer = await asyncio.open_unix_connection(sock=handler_end)
    channel = DeviceChannel(
        0, device_end, core=core if core is not None else SpanCore(real, NO_CAPS), span=SPAN,
        max_frame_bytes=1 << 24,
    )  # fmt: skip
    serving = asyncio.create_task(channel.serve())
    link = await DeviceLink.connect(handler_reader, handler_writer)
    try:
        yield link
    finally:
        await link.close()
        await asyncio.wait_for(serving, 10)


class _ThroughCore:
    """The executor contract's calls through a front's seam to the core (`RemoteCore`): sessions of one peer, the
    rest as the executor's (the core adds admission, slots and routing; the work is the executor's)."""

    def __init__(self, core: RemoteCore, real: EngineExecutor):
        self.core, self.real = core, real
        self.path, self.cache_bytes_per_token, self.step = core.path, core.cache_bytes_per_token, core.step
        self.attach_prefix, self.add_prefix_keys = core.attach_prefix, core.add_prefix_keys
        self.handoff_layout, self.read_kv, self.write_kv = core.handoff_layout, core.read_kv, core.write_kv
        self.session_bytes = real.session_bytes  # (the core sizes sessions: a front never asks)

    @property
    def bytes_left(self) -> int:
        return self.core.bytes_left

    @property
    def max_size_bytes(self) -> int:
        return self.core.max_size_bytes

    @contextlib.asynccontextmanager
    async def open_session(self, spec: SessionSpec, alloc_timeout_s: float | None) -> AsyncIterator[object]:
        async with self.core.open_session(SessionOpen("peer-a", spec, alloc_timeout_s)) as (_, cache):
            yield cache

    async def forward(self, blocks: tuple[int, ...], inputs: ForwardInputs, *, chunk_tokens: int) -> torch.Tensor:
        return await self.core.forward("peer-a", blocks, inputs, chunk_tokens=chunk_tokens, timeout_s=30)

    async def backward(self, blocks: tuple[int, ...], inputs: BackwardInputs) -> list[torch.Tensor]:
        return await self.core.backward("peer-a", blocks, inputs, timeout_s=30)


@contextlib.asynccontextmanager
async def _executor(backend: SpanBackend, kind: str) -> AsyncIterator[EngineExecutor]:
    with Runtime(max_batch_size_tokens=1024) as runtime:
        if kind.startswith("proxy_"):
            real = EXECUTORS[kind.removeprefix("proxy_")](backend, runtime)
            async with proxied_executor(real) as link:
                yield _ThroughCore(RemoteCore(link), real)  # type: ignore[misc]
        else:
            yield EXECUTORS[kind](backend, runtime)


def _reference(backend: SpanBackend, blocks: tuple[int, ...], steps: list[StepInputs], batch: int, max_length: int):
    """The steps straight through `SpanBackend.inference_step` on fresh zero caches."""
    caches = []
    for per_block in backend.cache_descriptors(blocks, batch, max_length):
        caches.append([torch.zeros(tuple(d.shape), dtype=d.dtype) for d in per_block])
    return [
        oracle.inference_step(backend, blocks, s.hidden_states, caches, prefix_length=s.prefix_length, max_length=max_length,
            hypo_ids=s.hypo_ids, prompts=s.prompts,
        )
        for s in steps
    ]  # fmt: skip


def _step(hidden, position, hypo_ids=None, prompts=None, lone=False) -> StepInputs:
    return StepInputs(hidden, position, prompts, hypo_ids, "", lone_session=lone)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("blocks", [SPAN, SPAN[1:3]])
async def test_steps_equal_the_backend(backend, kind, blocks) -> None:
    torch.manual_seed(1)
    prompts = torch.randn(len(blocks), 1, 5, H) * 0.1
    steps = [
        _step(torch.randn(2, 7, H), 0, prompts=prompts),  # deep prompts touch positions 0..4
        _step(torch.randn(2, 1, H), 7, hypo_ids=torch.tensor([1, 1]), prompts=prompts),  # beams, past the prompts
        _step(torch.randn(2, 3, H), 8, lone=True),
        _step(torch.randn(2, 1, H), 5),  # rollback
    ]
    expected = _reference(backend, blocks, steps, batch=2, max_length=40)
    async with _executor(backend, kind) as executor:
        left = executor.bytes_left
        spec = SessionSpec(blocks, 2, 40)
        async with executor.open_session(spec, alloc_timeout_s=0) as cache:
            assert executor.bytes_left == left - executor.session_bytes(spec) < left
            got = [as_tensor(await executor.step(cache, s)) for s in steps]
        assert executor.bytes_left == left
    for out, ref in zip(got, expected, strict=True):
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
async def test_forward_and_backward_equal_the_backend(backend, kind) -> None:
    torch.manual_seed(2)
    hidden, grads, prompts = torch.randn(2, 9, H), torch.randn(2, 9, H), torch.randn(N_BLOCKS, 1, 3, H) * 0.1
    async with _executor(backend, kind) as executor:
        out = await executor.forward(SPAN, ForwardInputs(hidden, None, ""), chunk_tokens=4)  # chunked
        whole = await executor.forward(SPAN, ForwardInputs(hidden, prompts, ""), chunk_tokens=0)
        got = await executor.backward(SPAN, BackwardInputs(hidden, grads, prompts, ""))
    torch.testing.assert_close(out, backend.forward(SPAN, hidden), atol=1e-5, rtol=0)
    assert torch.equal(whole, backend.forward(SPAN, hidden, prompts))
    grad_inputs, grad_prompts = oracle.backward(backend, SPAN, hidden, grads, prompts)
    assert len(got) == 2 and torch.equal(got[0], grad_inputs) and torch.equal(got[1], grad_prompts)


@pytest.mark.parametrize("kind", KINDS)
async def test_allocation_fails_in_time_and_frees_everything(backend, kind) -> None:
    async with _executor(backend, kind) as executor:
        total = executor.bytes_left
        spec = SessionSpec(SPAN, 4, 64)
        async with contextlib.AsyncExitStack() as stack:
            with pytest.raises(AllocationFailed):  # fill the cache until a session no longer fits
                for _ in range(1000):
                    await stack.enter_async_context(executor.open_session(spec, alloc_timeout_s=0))
            assert executor.bytes_left < executor.session_bytes(spec)
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(AllocationFailed):
                async with executor.open_session(spec, alloc_timeout_s=0.2):
                    pass
            assert 0.15 < loop.time() - started < 5
        assert executor.bytes_left == total == executor.max_size_bytes


@pytest.mark.parametrize("kind", KINDS)
async def test_concurrent_sessions_stay_independent_and_caches_are_not_interchangeable(backend, kind) -> None:
    torch.manual_seed(3)
    prefixes = [torch.randn(1, 3 + i, H) for i in range(4)]
    tokens = [torch.randn(1, 1, H) for _ in range(4)]
    expected = [
        _reference(backend, SPAN, [_step(p, 0), _step(t, p.shape[1])], batch=1, max_length=16)[1]
        for p, t in zip(prefixes, tokens, strict=True)
    ]
    async with _executor(backend, kind) as executor, contextlib.AsyncExitStack() as stack:
        caches = [await stack.enter_async_context(executor.open_session(SessionSpec(SPAN, 1, 16), 0)) for _ in prefixes]
        for cache, p in zip(caches, prefixes, strict=True):
            await executor.step(cache, _step(p, 0))
        steps = [executor.step(c, _step(t, p.shape[1])) for c, t, p in zip(caches, tokens, prefixes, strict=True)]
        got = [as_tensor(out) for out in await asyncio.wait_for(asyncio.gather(*steps), 30)]
        with Runtime(max_batch_size_tokens=1024) as other_runtime:
            other = EXECUTORS["fused" if kind == "eager" else "eager"](backend, other_runtime)
            async with other.open_session(SessionSpec(SPAN, 1, 16), 0) as foreign:
                with pytest.raises(TypeError):
                    await executor.step(foreign, _step(tokens[0], 0))
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
async def test_kv_handoff_round_trips(backend, kind) -> None:
    """Every executor hands a session's cache off, a handler process's proxy too (it refused until the session seam
    reached the device process's core)."""
    torch.manual_seed(4)
    hidden, nxt = torch.randn(1, 6, H), torch.randn(1, 1, H)
    spec = SessionSpec(SPAN, 1, 16)
    async with _executor(backend, kind) as executor:
        async with executor.open_session(spec, 0) as source, executor.open_session(spec, 0) as target:
            await executor.step(source, _step(hidden, 0))
            layout = executor.handoff_layout(spec)
            tensors = await executor.read_kv(source, 6)
            assert [t.shape[2] for t in tensors] == [6] * 2 * len(layout)
            await executor.write_kv(target, tensors, 6)
            expected = as_tensor(await executor.step(source, _step(nxt, 6)))
            got = as_tensor(await executor.step(target, _step(nxt, 6)))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kind", KINDS)
async def test_prefix_keys_publish_pages_that_later_sessions_of_the_namespace_attach(backend, kind) -> None:
    """Every executor keeps a closed session's keyed pages for its namespace (through a proxy too: attach is a
    request, recorded keys a one-way frame) and a session starting on them computes what a fresh one does."""
    torch.manual_seed(5)
    hidden = torch.randn(1, 40, H)
    keys = PrefixKeys(0, tuple(chain_hashes(prefix_root(model="m"), list(range(40)))))
    spec = SessionSpec(SPAN, 1, 64)
    expected = _reference(backend, SPAN, [_step(hidden, 0)], 1, 64)[0]
    async with _executor(backend, kind) as executor:
        async with executor.open_session(spec, 0) as cache:
            assert await executor.attach_prefix(cache, "alice/", PrefixKeys(0, keys.hashes[:1])) == 0
            await executor.step(cache, _step(hidden, 0))
            executor.add_prefix_keys(cache, "alice/", keys)  # the rest of the keys, after the states
        async with executor.open_session(spec, 0) as cache:
            assert await executor.attach_prefix(cache, "alice/", keys) == 32  # two whole 16-token pages
            torch.testing.assert_close(
                as_tensor(await executor.step(cache, _step(hidden[:, 32:], 32))), expected[:, 32:]
            )
        async with executor.open_session(spec, 0) as cache:
            assert await executor.attach_prefix(cache, "mallory/", keys) == 0


@pytest.mark.parametrize("kind", sorted(EXECUTORS))
async def test_engine_executor_merges_steps_of_many_sessions(backend, kind) -> None:
    """Single-token steps queued while the device is busy run as one batch."""
    async with _executor(backend, kind) as executor, contextlib.AsyncExitStack() as stack:
        assert isinstance(executor, EngineExecutor)
        runtime = executor.runtime
        caches = [await stack.enter_async_context(executor.open_session(SessionSpec(SPAN, 1, 16), 0)) for _ in "abcd"]
        for cache in caches:
            await executor.step(cache, _step(torch.randn(1, 2, H), 0))
        batch_sizes: list[int] = []
        execute = executor._execute_tasks
        runtime.register_batch_executor(
            "engine_inference", lambda tasks: (batch_sizes.append(len(tasks)), execute(tasks))[1]
        )
        gate = asyncio.Event()
        loop = asyncio.get_running_loop()
        blocker = runtime.submit(
            lambda: asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(10), priority=0, size_tokens=1
        )
        steps = [asyncio.ensure_future(executor.step(c, _step(torch.randn(1, 1, H), 2))) for c in caches]
        await asyncio.sleep(0.05)
        gate.set()
        await blocker
        await asyncio.wait_for(asyncio.gather(*steps), 30)
    assert batch_sizes == [4]


def _traits(**changes) -> SpanTraits:
    values = dict(
        device_type="cuda", dtype=torch.bfloat16, quant_type="none", family="llama", num_adapters=0,
        tensor_parallel_devices=0,
    )  # fmt: skip
    values.update(changes)
    return SpanTraits(**values)  # type: ignore[arg-type]


def test_fused_rule_names_the_reason() -> None:
    assert unsupported_reason(_traits()) is None
    assert unsupported_reason(_traits(device_type="cpu", dtype=torch.float32)) is None  # the fused spans' CPU ops
    assert unsupported_reason(_traits(quant_type="nf4")) is None  # NF4/INT8 kernels in the engine
    for changes, words in [
        (dict(device_type="mps"), "device mps"),
        (dict(family="gemma2"), "family gemma2"),  # no fused span (Falcon/BLOOM have fast_dense)
        (dict(num_adapters=2, family="deepseek_v3"), "adapters"),  # llama-family spans serve adapters (fast_lora)
        (dict(tensor_parallel_devices=2), "tensor parallel"),
        (dict(dtype=torch.float32), "dtype float32"),
    ]:
        reason = unsupported_reason(_traits(**changes))
        assert reason is not None and words in reason, (changes, reason)


async def test_build_reports_how_the_engine_runs_the_span(backend) -> None:
    metrics = ServerMetrics()
    with Runtime(max_batch_size_tokens=64) as runtime:
        cpu = _traits(device_type="cpu", dtype=torch.float32)
        built = build_engine_executor(backend, runtime, cpu, kv_pool_bytes=POOL_BYTES, max_seq_len_tokens=64,
                                      metrics=metrics, warmup=False)  # fmt: skip
        assert built.path == "fused"
        assert b'corolla_serving_path{path="fused"} 1.0' in metrics.render()
        eager = build_engine_executor(backend, runtime, _traits(device_type="cpu", dtype=torch.float32, family="x"),
                                      kv_pool_bytes=POOL_BYTES, max_seq_len_tokens=64, metrics=metrics, warmup=False)  # fmt: skip
        assert eager.path == "eager"
        text = metrics.render()
        assert b'corolla_serving_path{path="eager"} 1.0' in text and b'corolla_serving_path{path="fused"} 0.0' in text


# ---- a handler process's seam (`RemoteCore`): figures without asking, one global admission, routed pushes


@pytest.mark.parametrize("kind", sorted(EXECUTORS))
async def test_remote_core_sizes_caches_as_the_device_does(backend, kind) -> None:
    async with _executor(backend, "proxy_" + kind) as proxy, _executor(backend, kind) as real:
        for spec in [SessionSpec(SPAN, 1, 1), SessionSpec(SPAN, 3, 17), SessionSpec(SPAN[1:3], 2, 64)]:
            assert proxy.cache_bytes_per_token(spec.block_indices) == real.cache_bytes_per_token(spec.block_indices)
            shapes = [[(tuple(d.shape), d.dtype) for d in block] for block in proxy.handoff_layout(spec)]
            assert shapes == [[(tuple(d.shape), d.dtype) for d in block] for block in real.handoff_layout(spec)]
        assert proxy.max_size_bytes == real.max_size_bytes and proxy.path == real.path


async def test_admission_is_the_device_processes_and_evictions_reach_the_stream(backend) -> None:
    from corolla.server.core.limits import PeerLimitExceeded

    limits = PeerLimits(max_sessions_per_peer=1, max_kv_fraction_per_peer=1.0, session_idle_evict_s=0.01)
    with Runtime(max_batch_size_tokens=1024) as runtime:
        real = eager_executor(backend, runtime)
        core = SpanCore(real, limits)
        device_admission = core.admission
        async with proxied_executor(real, core) as first, proxied_executor(real, core) as second:
            spec = SessionSpec(SPAN, 1, 16)
            async with RemoteCore(first).open_session(SessionOpen("peer-a", spec, 0)) as (ticket, cache):
                assert cache is not None and device_admission.num_open == 1
                with pytest.raises(PeerLimitExceeded) as refused:  # the same peer through another process
                    async with RemoteCore(second).open_session(SessionOpen("peer-a", spec, 0)):
                        pass
                assert refused.value.reason == "peer_sessions"
                await asyncio.sleep(0.05)  # idle past session_idle_evict_s
                device_admission._evict(next(iter(device_admission._tickets)), "test")
                await asyncio.wait_for(ticket.evicted.wait(), 5)  # the stream's process learns it
            assert device_admission.num_open == 0 and real.bytes_left == real.max_size_bytes


async def test_the_device_admission_learns_what_an_opening_request_brings(backend) -> None:
    """The zero-token rule is the device's alone: a handler process's OPEN carries the opening request's tokens, so
    a session opened with none yields at once there (not after the first-token grace), and only there is it decided
    that such an open does not wait in the page line."""

    with Runtime(max_batch_size_tokens=1024) as runtime:
        real = eager_executor(backend, runtime)
        core = SpanCore(real, PeerLimits(max_kv_fraction_per_peer=1.0))
        device_admission = core.admission
        async with proxied_executor(real, core) as proxy:
            for opening in (0, 7, None):
                async with RemoteCore(proxy).open_session(
                    SessionOpen("peer-a", SessionSpec(SPAN, 1, 16), 0, None, opening)
                ):
                    (ticket,) = device_admission._tickets
                    assert ticket.opening_tokens == opening


async def test_forward_slots_are_the_device_processes(backend) -> None:
    """A peer's forwards through any handler process wait for its slots of the device process's core (one
    `max_forwards_per_peer` for the server, not one per process)."""

    hidden = torch.randn(1, 3, H)
    with Runtime(max_batch_size_tokens=1024) as runtime:
        real = eager_executor(backend, runtime)
        core = SpanCore(real, PeerLimits(max_forwards_per_peer=1))
        async with proxied_executor(real, core) as proxy:
            remote = RemoteCore(proxy)
            inputs = ForwardInputs(hidden, None, "")
            async with core.forward_slots.hold("peer-a"):  # the peer's one slot, taken through another front
                waiting = asyncio.ensure_future(remote.forward("peer-a", SPAN, inputs, chunk_tokens=0, timeout_s=30))
                other = await remote.forward("peer-b", SPAN, inputs, chunk_tokens=0, timeout_s=30)  # not held up
                await asyncio.sleep(0.2)
                assert not waiting.done()
            torch.testing.assert_close(await asyncio.wait_for(waiting, 10), other)


async def test_kv_imports_in_flight_are_the_device_processes(backend) -> None:
    """A peer's KV imports in flight through any handler process count against the device process's one budget
    (`max_import_bytes_per_peer` / `max_import_bytes_total` hold per server; each front counted its own before, N
    times the caps with N processes); the bytes come back when the import ends, when its caller is cancelled while
    the core is asked, and when a process's channel ends mid-import."""
    from corolla.server.core.limits import PeerLimitExceeded, ServerLimitExceeded

    async def settled(remote: RemoteCore) -> bool:
        """Whether the core holds no import bytes once every note `remote` sent before has reached it (the call of
        one more import goes behind them) and that import's own has too."""
        async with remote.hold_import("peer-z", 1):
            pass
        for _ in range(100):
            if imports.total_bytes == 0 and imports.per_peer == {}:
                return True
            await asyncio.sleep(0.05)
        return False

    with Runtime(max_batch_size_tokens=1024) as runtime:
        real = eager_executor(backend, runtime)
        core = SpanCore(real, PeerLimits(max_import_bytes_per_peer=100, max_import_bytes_total=150))
        imports = core.imports
        async with proxied_executor(real, core) as first_link, proxied_executor(real, core) as second_link:
            first, second = RemoteCore(first_link), RemoteCore(second_link)
            async with first.hold_import("peer-a", 100):
                assert imports.per_peer == {"peer-a": 100}
                with pytest.raises(PeerLimitExceeded) as per_peer:  # the same peer through the other process
                    async with second.hold_import("peer-a", 1):
                        pass
                with pytest.raises(ServerLimitExceeded) as total:
                    async with second.hold_import("peer-b", 51):
                        pass
                assert (per_peer.value.reason, total.value.reason) == ("peer_import_bytes", "import_bytes_full")
                async with second.hold_import("peer-b", 50):
                    assert imports.total_bytes == 150
            assert await settled(first) and await settled(second)

            async def importing() -> None:
                async with second.hold_import("peer-a", 100):
                    await asyncio.sleep(3600)

            task = asyncio.ensure_future(importing())
            await asyncio.sleep(0)  # its call to the core is out
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert await settled(second)  # taken after its caller left, and given back

            async with proxied_executor(real, core) as third_link:
                async with RemoteCore(third_link).hold_import("peer-a", 100):
                    assert imports.total_bytes == 100
                    await third_link.close()  # the process is gone mid-import
            assert await settled(first)
            async with first.hold_import("peer-a", 100):  # room again
                pass


async def test_push_is_routed_to_the_process_holding_the_session(backend) -> None:
    from hivemind.proto import runtime_pb2

    from corolla.server.core.push_guard import SessionPushGuard
    from corolla.server.front.inference_stream import PushInbox

    with Runtime(max_batch_size_tokens=1024) as runtime:
        real = eager_executor(backend, runtime)
        core = SpanCore(real)
        async with proxied_executor(real, core) as holder, proxied_executor(real, core) as other:
            holding, receiving = RemoteCore(holder), RemoteCore(other)
            inbox = PushInbox("session-1", SessionPushGuard(upstream="upstream"))
            queue = inbox.queue
            async with holding.open_session(SessionOpen("peer-a", SessionSpec(SPAN, 1, 16), 0, "session-1"), inbox):
                request = runtime_pb2.ExpertRequest(uid="x", metadata=b"step")
                assert receiving.push("session-1", request, sender="upstream")  # routed by the core to the holder
                got = await asyncio.wait_for(queue.get(), 5)
                assert got.uid == "x" and got.metadata == b"step"
                receiving.push("session-1", request, sender="someone-else")  # routed, then refused by the guard
                await asyncio.sleep(0.05)
                assert queue.empty()
            assert "session-1" not in core.pushes.sinks
