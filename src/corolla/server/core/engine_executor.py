"""The executor of every server (the core's device side): inference steps on the engine's `SpanEngine` over its paged
`KVPool`, the one KV store, with the single-token steps of all sessions merged into one batched forward by the runtime
(`engine.batcher.execute_steps` as its batch executor); forward and backward through `SpanBackend` on the same blocks,
merged across clients (`training_batch`). Sessions wait for pages in arrival order (`engine.kv.page_queue`)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from corolla.engine.batcher import PendingSteps, StepResult, execute_steps, launch_steps
from corolla.engine.config import EngineConfig
from corolla.engine.kv.page_queue import PageQueue
from corolla.engine.serving import SpanTraits, unsupported_reason
from corolla.engine.span_engine import EngineSession, SpanEngine, StepRequest
from corolla.engine.spans.eager_span import read_positions, write_positions
from corolla.models.block_base import TensorDescriptor
from corolla.protocol.prefix import PrefixKeys
from corolla.server.backend import SpanBackend
from corolla.server.core.batch_counts import BatchCounts
from corolla.server.core.executor import (
    KIND_ENGINE_INFERENCE,
    PATH_EAGER,
    PATH_FUSED,
    BackwardInputs,
    ForwardInputs,
    HandoffUnsupported,
    PrefixCacheStats,
    SessionCache,
    SessionSpec,
    StepInputs,
)
from corolla.server.core.forward_chunks import run_forward_chunked
from corolla.server.core.runtime import KIND_GENERIC, PRIORITY_INFERENCE, SHADOW_LEAD_AFTER_S, Runtime, Task
from corolla.server.core.step_rates import COUNT_EVERY_BATCHES, StepRates
from corolla.server.core.training_batch import TrainingBatcher
from corolla.server.metrics import ServerMetrics
from corolla.server.throughput import default_cache_dir
from corolla.utils.logging import get_logger
from corolla.utils.tensor_bytes import TensorBytes

logger = get_logger(__name__)

T = TypeVar("T")

# With a GPU span the device thread needs the GIL for short moments between GPU waits, while the serving loop can
# run Python for a millisecond or more at a time (a burst of requests from many sessions); under the default 5 ms
# switch interval such a burst delays the merged forward that is waiting for the GIL. 0.5 ms bounds that delay.
GIL_SWITCH_INTERVAL_S = 0.0005
# tokens per page: the GPU attention kernels read a page per iteration (64 measured best); the CPU reads pages by
# index, so smaller pages waste less of the budget on short sessions
GPU_PAGE_TOKENS = 64
CPU_PAGE_TOKENS = 16


class EngineSessionCache(SessionCache):
    """One engine session (all blocks of the request share its pages) and its lease on the pool as admission weighs
    it: bytes holding its positions, bytes promised and not yet taken; a promise can be withdrawn in part and asked
    back."""

    def __init__(self, spec: SessionSpec, session: EngineSession, pages: PageQueue):
        super().__init__(spec)
        self.session = session
        self.pages = pages
        pool = session.engine.pool
        self.page_bytes = pool.layer_page_bytes * session.num_layers  # one sequence's page over its layers

    @property
    def taken_bytes(self) -> int:
        return sum(len(slot.pages) for slot in self.session.slots) * self.page_bytes

    @property
    def promised_bytes(self) -> int:
        return sum(slot.promised_pages for slot in self.session.slots) * self.page_bytes

    def withdrawable(self, nbytes: int) -> int:
        """What `withdraw(nbytes)` would drop: `nbytes` rounded down to whole pages, at most the promise."""
        return min(self._pages_per_slot(nbytes) * len(self.session.slots) * self.page_bytes, self.promised_bytes)

    def withdraw(self, nbytes: int) -> int:
        """Drops `withdrawable(nbytes)` bytes of the promise; returns them."""
        dropped = self.session.engine.pool.withdraw(self.session.slots, self._pages_per_slot(nbytes)) * self.page_bytes
        self.pages.wake()  # allocations in line may fit now
        return dropped

    def _pages_per_slot(self, nbytes: int) -> int:
        return nbytes // (self.page_bytes * len(self.session.slots))  # never below what was asked to stay

    def restore(self) -> bool:
        """Promises the session its whole length again if the pool can; False where it can't now."""
        return self.session.engine.pool.restore(self.session.slots)


class EngineExecutor:
    """The device side of one span as the core (`span_core.SpanCore`, its admission) sees it: a `SpanEngine` built
    from the blocks of `backend` (see the module docstring). Coroutines run in the server's event loop; a failing
    step fails its caller only."""

    def __init__(
        self,
        backend: SpanBackend,
        engine: SpanEngine,
        runtime: Runtime,
        metrics: ServerMetrics | None = None,
        *,
        max_alloc_timeout_s: float | None = None,
    ):
        self.backend = backend
        self.engine = engine
        self._runtime = runtime
        self.metrics = metrics
        self.pages = PageQueue(engine.pool, max_alloc_timeout_s)
        self.first_block = min(backend.block_indices)
        self.training = TrainingBatcher(backend, runtime, metrics)  # forwards and backwards, merged across clients
        self._merge_key = ("engine", id(engine))
        self._shadow_merge_key = ("engine_shadow", id(engine))  # shadow steps that cannot ride (`step_task`)
        self.inference_tokens = 0  # tokens of every inference batch run (in the runtime thread; the metrics read it)
        self.rates = StepRates()  # the decode and prefill rates its batches ran at (the announcer reads them)
        # one merged batch is at most what one decode forward serves (a graph bucket's rows): steps past it wait for
        # the next forward instead of adding a second pass over the weights that every step of this batch waits for
        # decode steps on the CUDA-graph path launch in two phases (`engine.batcher.launch_steps`): the runtime
        # launches the next merged forward before it sends this one's replies (no graphs: one phase, no launcher)
        runtime.register_batch_executor(
            KIND_ENGINE_INFERENCE, self._execute_tasks, inline_when_idle=True, max_merged_tokens=engine.max_batch_rows,
            launcher=self._launch_tasks if engine.graphs is not None else None,
        )  # fmt: skip

    @property
    def path(self) -> str:
        """`PATH_FUSED` or `PATH_EAGER`: how the engine runs this span (metrics, `rpc_info`, logs)."""
        return PATH_FUSED if self.engine.fused else PATH_EAGER

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    # ---- cache accounting: pages of the pool, counted in the layers a session holds them (page 0 is the pool's
    # reserved null page)

    @property
    def max_size_bytes(self) -> int:
        return (self.engine.pool.num_pages - 1) * self.engine.pool.page_bytes

    @property
    def bytes_left(self) -> int:
        return self.engine.pool.layer_pages_free * self.engine.pool.layer_page_bytes

    @property
    def whole_span_bytes_left(self) -> int:
        """Cache bytes a new session over every block of the span can still get (`KVPool.pages_free_in_every_layer`;
        `bytes_left` sums the layers' free pages, which sessions over parts of the span leave unevenly): what the
        server announces as its free cache."""
        return self.engine.pool.pages_free_in_every_layer * self.engine.pool.page_bytes

    @property
    def bytes_waiting(self) -> int:
        """Bytes asked for by allocations queued for free cache (served before new ones)."""
        return self.pages.layer_pages_waiting * self.engine.pool.layer_page_bytes

    def on_shortage(self, make_room: Callable[[int], None]) -> None:
        """Registers admission's yield rule for the head of the page line: `make_room(nbytes)`, called while it
        lacks room for `nbytes`."""
        layer_page_bytes = self.engine.pool.layer_page_bytes
        self.pages.on_short = lambda layer_pages: make_room(layer_pages * layer_page_bytes)

    def session_bytes(self, spec: SessionSpec) -> int:
        """Cache bytes a session of `spec` reserves (admission's per-peer accounting)."""
        pool = self.engine.pool
        return (
            pool.pages_for(spec.max_length_tokens)
            * pool.page_size_tokens
            * spec.batch_size
            * (self.cache_bytes_per_token(spec.block_indices))
        )

    def cache_bytes_per_token(self, block_indices: tuple[int, ...]) -> int:
        """What one token of one sequence takes in the pool over `block_indices` (the layout's bytes per layer)."""
        pool = self.engine.pool
        return pool.layout.bytes_per_token(pool.dtype, len(block_indices))

    def _layers(self, block_indices: tuple[int, ...]) -> tuple[int, int]:
        return block_indices[0] - self.first_block, block_indices[-1] + 1 - self.first_block

    @contextlib.asynccontextmanager
    async def open_session(self, spec: SessionSpec, alloc_timeout_s: float | None) -> AsyncIterator[SessionCache]:
        """Opens one engine session, waiting up to `alloc_timeout_s` (capped by `max_alloc_timeout_s`) in line for
        free pages; AllocationFailed if none come in time. Its pages go back on exit, whatever the exit path."""
        layers = self.engine.check_session(spec.max_length_tokens, self._layers(spec.block_indices))
        slots = await self.pages.allocate(spec.batch_size, spec.max_length_tokens, alloc_timeout_s, layers)
        session: EngineSession | None = None
        try:
            session = self.engine.session_of(slots, spec.max_length_tokens, layers=layers)
            yield EngineSessionCache(spec, session, self.pages)
        finally:
            try:
                if session is not None:  # the pages its last steps filled stay cached for its next turn
                    self.engine.publish_prefix(session)
            finally:
                self.pages.release(slots)

    def _own(self, cache: SessionCache) -> EngineSessionCache:
        if not isinstance(cache, EngineSessionCache) or cache.session.engine is not self.engine:
            raise TypeError(f"EngineExecutor got a cache of another executor: {type(cache).__name__}")
        return cache

    # ---- compute

    def step(
        self, cache: SessionCache, inputs: StepInputs, then: Callable[[asyncio.Future], None] | None = None
    ) -> asyncio.Future[torch.Tensor | TensorBytes]:
        """The step queued as a mergeable runtime task: its future (resolved already where it ran inline on an idle
        runtime, `then` not run). A launched forward's step returns its output's bytes (`TensorBytes`: no tensor
        built per step), others a tensor."""
        shadow = cache.spec.shadow
        task = self.step_task(self.prepare_step(cache, inputs), shadow=shadow, then=then)
        self._runtime.queue(task, inline=inputs.lone_session and not shadow)
        assert task.future is not None
        return task.future

    def step_task(
        self,
        work: StepRequest | StepGroup,
        *,
        shadow: bool = False,
        on_done: Callable[[Any, BaseException | None], None] | None = None,
        flush: Callable[[], None] | None = None,
        then: Callable[[asyncio.Future], None] | None = None,
    ) -> Task:
        """The runtime task (`Runtime.task`) of a prepared step, or of a device channel frame's decode steps
        (`StepGroup`, real sessions' only). A `shadow` session's step is held `SHADOW_LEAD_AFTER_S` (`Task.lead_after`:
        it rides spare rows of forwards real steps lead); one that cannot ride (deep prompts at its positions) never
        joins real rows and runs in a batch of its own once it may lead."""
        if isinstance(work, StepGroup):
            requests = work.requests
            size = sum(r.rows * max(r.num_tokens, 1) for r in requests)
            steps, sessions = len(requests), tuple(id(r.session) for r in requests)
        else:
            size, steps, sessions = work.rows * max(work.num_tokens, 1), 1, (id(work.session),)
        merge_key, lead_after_s = self._merge_key, 0.0
        if shadow:
            lead_after_s = SHADOW_LEAD_AFTER_S
            if isinstance(work, StepRequest) and not work.is_decode:
                merge_key = self._shadow_merge_key
        return self._runtime.task(
            work.run, priority=PRIORITY_INFERENCE, size_tokens=size, kind=KIND_ENGINE_INFERENCE, merge_key=merge_key,
            payload=work, on_done=on_done, flush=flush, steps=steps, sessions=sessions, lead_after_s=lead_after_s,
            then=then,
        )  # fmt: skip

    def prepare_step(self, cache: SessionCache, inputs: StepInputs) -> StepRequest:
        """`step` up to its task (`step_task`): the engine's request of the step, checked and bound to its session.
        A shadow session's step of B x T <= `max_batch_rows` rows without deep prompts rides a merged decode forward
        as B x T rows (`StepRequest.is_decode`: a client sends a shadow's decode positions several at a time)."""
        own = self._own(cache)
        session = own.session
        hidden, prefix_length, prompts, hypo_ids, adapter, _, raw, meta, rows = inputs  # (one unpack: every field)
        if session.adapter != adapter:  # (else bound to it at an earlier step: `bind_adapter` would do nothing)
            self.engine.bind_adapter(session, adapter)  # ValueError: unknown, or not the session's adapter
        # `meta`: (dtype, [B, T, H]) of `raw` where no tensor was built
        if (hidden is None and raw is not None and meta is not None and len(meta[1]) == 3 and hypo_ids is None
                and prompts is None):  # fmt: skip
            # the usual step, a front's or a device channel's: its bytes only (the cheaper constructor, the same request)
            request = StepRequest.of_bytes(session, prefix_length, raw, meta[0], meta[1], rows)
        else:
            request = StepRequest(
                session, hidden, prefix_length, hypo_ids, prompts, raw, None if meta is None else meta[0],
                None if meta is None else meta[1], rows,
            )  # fmt: skip
        # ValueError (refused here, before it is queued) for inputs this engine can't run; the device thread then
        # checks only the session's state (`SpanEngine.validate`)
        self.engine.check_inputs(request)
        if (own.spec.shadow and not request.is_decode and not request.needs_prompts
                and 0 < request.rows * request.num_tokens <= self.engine.max_batch_rows):  # fmt: skip
            request.is_decode = True  # its positions ride a decode forward as rows (see the docstring)
        return request

    def batch_counts(self) -> BatchCounts:
        """The runtime's batches so far (the metrics' `WorkSource`)."""
        return self._runtime.batch_counts()

    def _execute_tasks(self, tasks: list[Task]) -> list[StepResult | list[StepResult]]:
        requests, sizes = _requests(tasks)
        self.inference_tokens += sum(r.rows * r.num_tokens for r in requests)
        started = time.perf_counter()
        results = execute_steps(self.engine, requests)  # (its outputs are on the CPU: the device's work is done)
        seconds = time.perf_counter() - started
        # noted for the step rates (counted when read: `StepRates.ran`): each step's tokens and blocks
        note_ran(self.rates, seconds, [r.num_tokens for r in requests], [r.session.num_layers for r in requests])
        return regroup(results, sizes)

    def _launch_tasks(self, tasks: list[Task]) -> PendingUnits | None:
        requests, sizes = _requests(tasks)
        pending = launch_steps(self.engine, requests)
        if pending is None:  # (the executor runs them: counted there)
            return None
        self.inference_tokens += pending.rows
        # a launched forward holds decode steps of one layer range (`SpanEngine.can_launch`)
        return PendingUnits(pending, sizes, self.rates, len(requests), requests[0].session.num_layers)

    async def forward(
        self, block_indices: tuple[int, ...], inputs: ForwardInputs, *, chunk_tokens: int
    ) -> torch.Tensor:
        """Hidden states after the blocks (no cache): a task per block merged with other clients' training work
        (`training_batch`), or, past `chunk_tokens` tokens, token chunks of each block (`forward_chunks`)."""
        batch_size, length, _ = inputs.hidden_states.shape
        if chunk_tokens and batch_size * length > chunk_tokens:
            return await run_forward_chunked(
                self.backend, self._runtime, list(block_indices), inputs.hidden_states, inputs.prompts,
                active_adapter=inputs.adapter, chunk_tokens=chunk_tokens, metrics=self.metrics,
            )  # fmt: skip
        return await self.training.forward(
            block_indices, inputs.hidden_states, inputs.prompts, inputs.adapter, inputs.owner
        )

    async def backward(self, block_indices: tuple[int, ...], inputs: BackwardInputs) -> list[torch.Tensor]:
        """`[grad_inputs]`, or `[grad_inputs, grad_prompts]` with deep prompts (block tasks merged as `forward`'s)."""
        grad_inputs, grad_prompts = await self.training.backward(
            block_indices, inputs.hidden_states, inputs.grad_outputs, inputs.prompts, inputs.adapter, inputs.owner
        )
        return [grad_inputs] if grad_prompts is None else [grad_inputs, grad_prompts]

    # ---- prefix caching: the engine's (`SpanEngine.attach_prefix`); nothing of a session runs on the device meanwhile

    async def attach_prefix(self, cache: SessionCache, namespace: str, keys: PrefixKeys) -> int:
        """Starts a fresh session with the longest run of cached pages that `keys` name in `namespace` and its
        blocks; returns the positions reused (whole pages, 0 where nothing is cached). The front applies the trust
        rule: `namespace` names whose pages are reused."""
        return self.engine.attach_prefix(self._own(cache).session, namespace, keys)

    def add_prefix_keys(self, cache: SessionCache, namespace: str, keys: PrefixKeys) -> None:
        """Records keys of the session's positions: its pages are published once computed."""
        self.engine.add_prefix_keys(self._own(cache).session, namespace, keys)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        pool = self.engine.pool
        return PrefixCacheStats(
            cached_bytes=pool.cached_bytes, evictions=pool.num_evictions, limit_bytes=pool.idle_cache_limit_bytes
        )

    # ---- KV hand-off: the pool's positions in the canonical layout, one K and one V [B, heads, length, dim] per block

    def handoff_layout(self, spec: SessionSpec) -> list[list[TensorDescriptor]]:
        """The canonical K and V descriptors per block of a session of `spec` ([B, kv_heads, max_length, head_dim]
        each); HandoffUnsupported where the pool's layout can't be expressed so."""
        pool = self.engine.pool
        (k_heads, k_dim), (v_heads, v_dim) = pool.layout.k_token_shape, pool.layout.v_token_shape
        if len(pool.layout.k_token_shape) != 2 or len(pool.layout.v_token_shape) != 2:
            raise HandoffUnsupported("KV hand-off needs [heads, dim] per token in the pool")
        b, length, cpu = spec.batch_size, spec.max_length_tokens, torch.device("cpu")
        k = TensorDescriptor((b, k_heads, length, k_dim), pool.dtype, cpu)
        v = TensorDescriptor((b, v_heads, length, v_dim), pool.dtype, cpu)
        return [[k, v] for _ in spec.block_indices]

    async def read_kv(self, cache: SessionCache, position: int) -> list[torch.Tensor]:
        """CPU copies of the first `position` tokens of every block's K and V (canonical layout)."""
        session, pool = self._own(cache).session, self.engine.pool

        def task() -> list[torch.Tensor]:
            tables = torch.stack([slot.table for slot in session.slots]).long()  # [B, maxp]
            result = []
            for layer in range(*session.layers):
                for pages in (pool.k[layer], pool.v[layer]):
                    held = read_positions(pages, tables, 0, position, pool.page_size_tokens)  # [B, P, heads, dim]
                    result.append(held.transpose(1, 2).to("cpu", copy=True).contiguous())  # [B, heads, P, dim]
            return result

        # a copy of the cache is no compute: it counts as one token of the batch budget
        return await self._runtime.submit(task, priority=PRIORITY_INFERENCE, size_tokens=1, kind=KIND_GENERIC)

    async def write_kv(self, cache: SessionCache, tensors: list[torch.Tensor], position: int) -> None:
        """Writes validated canonical K/V tensors into positions [0, position) of the session's cache."""
        session, pool = self._own(cache).session, self.engine.pool

        def task() -> None:
            if len(tensors) != 2 * session.num_layers:
                raise ValueError(f"KV import has {len(tensors)} tensors, the session's cache {2 * session.num_layers}")
            if position > session.max_length_tokens:
                raise ValueError(f"KV import of {position} positions exceeds the session's {session.max_length_tokens}")
            pool.grow(session.slots, position)  # the imported positions take their pages (promised at open)
            tables = torch.stack([slot.table for slot in session.slots]).long()  # [B, maxp]
            for j, layer in enumerate(range(*session.layers)):
                for pages, tensor in ((pool.k[layer], tensors[2 * j]), (pool.v[layer], tensors[2 * j + 1])):
                    values = tensor.to(pool.device).transpose(1, 2)  # [B, position, heads, dim]
                    write_positions(pages, tables, 0, values, pool.page_size_tokens)
            for slot in session.slots:
                slot.length_tokens = position  # the imported positions count as processed

        await self._runtime.submit(task, priority=PRIORITY_INFERENCE, size_tokens=1, kind=KIND_GENERIC)


def _requests(tasks: list[Task]) -> tuple[list[StepRequest], UnitSizes | None]:
    """The requests of a batch's tasks, in order, and each unit's size (`flatten_units`): each task's payload is one
    step (`prepare_step`) or a device channel frame's steps (`StepGroup`, one task). A batch of lone steps (one
    front's) is its payloads as they are: no per-step Python beyond the list and the set of their types."""
    units = [task.payload for task in tasks]
    types = set(map(type, units))
    if not types <= _UNIT_TYPES:
        raise TypeError(f"{KIND_ENGINE_INFERENCE} task without a StepRequest or StepGroup payload")
    return (units, None) if StepGroup not in types else flatten_units(units)


def shorten_gil_switch_interval() -> None:
    """Lowers this process's GIL switch interval to `GIL_SWITCH_INTERVAL_S`, never raising it (no other setting:
    its A/B found no better value, docs/decisions/0007)."""
    if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        logger.info(f"gil.switch_interval(ms={GIL_SWITCH_INTERVAL_S * 1000:g}, source=fast_path)")


def build_engine_executor(
    backend: SpanBackend,
    runtime: Runtime,
    traits: SpanTraits,
    *,
    kv_pool_bytes: int,
    max_seq_len_tokens: int,
    metrics: ServerMetrics | None = None,
    max_batch_rows: int = 64,
    max_alloc_timeout_s: float | None = None,
    warmup: bool = True,
    prefix_cache_tokens: int | None = None,
) -> EngineExecutor:
    """The engine over `backend`'s blocks (their tensors used in place) with a KV pool of `kv_pool_bytes`: fused
    kernels where the engine has them for `traits` (`engine.serving.unsupported_reason`), else the blocks eagerly."""
    config = EngineConfig(
        kv_pool_bytes=kv_pool_bytes,
        max_seq_len_tokens=max_seq_len_tokens,
        max_batch_rows=max_batch_rows,
        page_size_tokens=GPU_PAGE_TOKENS if traits.device_type == "cuda" else CPU_PAGE_TOKENS,
        prefix_cache_tokens=prefix_cache_tokens,
        kernel_choices_dir=str(default_cache_dir()),  # beside the throughput figures: a restart skips the tuning
    )
    reason = unsupported_reason(traits)
    blocks = [backend.blocks[i] for i in sorted(backend.blocks)]
    engine = SpanEngine.from_blocks(blocks, config, fused=reason is None)
    if warmup:
        engine.warmup()
    if engine.device.type == "cuda":
        shorten_gil_switch_interval()  # this process now serves a GPU span: see GIL_SWITCH_INTERVAL_S
    executor = EngineExecutor(backend, engine, runtime, metrics, max_alloc_timeout_s=max_alloc_timeout_s)
    logger.info(f"engine.built(layers={engine.model.num_layers}, pool_pages={engine.pool.num_pages}, "
                f"page_tokens={engine.pool.page_size_tokens})")  # fmt: skip
    logger.info(f"server.serving_path(path={executor.path}, reason={reason or 'fused kernels'!r})")
    if metrics is not None:
        metrics.serving_path(executor.path)
        metrics.read_work(executor)
    return executor


# The server's units of queued decode work: one `StepRequest` or a `StepGroup`, laid out as one request list for the
# engine (`flatten_units`), which knows requests only, and handed back per unit (`regroup`, `PendingUnits`).
@dataclass(eq=False, slots=True)
class StepGroup:
    """Step requests queued and answered as one unit (a device channel frame's decode steps: one runtime task, one
    callback), in the order of their rows in the merged forward. Its result is a list with one `StepResult` per
    request (each step fails alone); a failure of the whole batch fails the unit."""

    requests: list[StepRequest]

    def run(self) -> list[StepResult]:
        """The unit outside a merged batch: its requests merged as `execute_steps` merges them."""
        if not self.requests:
            return []
        engine = self.requests[0].session.engine
        assert isinstance(engine, SpanEngine), "a step group runs on the span engine of its sessions"
        return execute_steps(engine, self.requests)


# per unit of a batch: 0 for a lone request (its result handed over as it is), n >= 1 for a `StepGroup` of n
UnitSizes = list[int]


def flatten_units(units: Sequence[StepRequest | StepGroup]) -> tuple[list[StepRequest], UnitSizes | None]:
    """The requests of a batch's units, in order, and each unit's size (None where every unit is a lone request:
    the results need no regrouping)."""
    requests: list[StepRequest] = []
    sizes: UnitSizes = []
    grouped = False
    for unit in units:
        if isinstance(unit, StepGroup):
            requests.extend(unit.requests)
            sizes.append(len(unit.requests))
            grouped = True
        else:
            requests.append(unit)
            sizes.append(0)
    return requests, sizes if grouped else None


def regroup(results: Sequence[StepResult], sizes: UnitSizes | None) -> list[StepResult | list[StepResult]]:
    """One result per unit from one per request (`flatten_units`' order): a lone request's own, a group's list."""
    if sizes is None:
        return results if isinstance(results, list) else list(results)  # (a batch's own list: no copy)
    expected = sum(max(size, 1) for size in sizes)
    if expected != len(results):
        raise RuntimeError(f"{len(results)} step results for units of {expected} requests")
    out: list[StepResult | list[StepResult]] = []
    start = 0
    for size in sizes:
        if size == 0:
            out.append(results[start])
            start += 1
        else:
            out.append(list(results[start : start + size]))
            start += size
    return out


def note_ran(rates: StepRates, seconds: float, tokens: Sequence[int], layers: Sequence[int]) -> None:
    """Notes a batch the device thread ran for the step rates (`StepRates.ran`), counted here once
    `COUNT_EVERY_BATCHES` wait."""
    ran = rates.ran
    ran.append((time.monotonic(), seconds, tokens, layers))
    if len(ran) >= COUNT_EVERY_BATCHES:
        rates.count()


class PendingUnits:
    """`PendingSteps` of a batch of units (`flatten_units`): `wait()` gives one result per unit (`regroup`) and
    notes the forward for the step rates (`note_ran`: its steps over its blocks in its device seconds)."""

    def __init__(self, pending: PendingSteps, sizes: UnitSizes | None, rates: StepRates, steps: int, blocks: int):
        self._pending = pending
        self._sizes = sizes
        self._rates, self._steps, self._blocks = rates, steps, blocks

    @property
    def device_s(self) -> float | None:
        return self._pending.device_s

    def wait(self) -> list[StepResult | list[StepResult]]:
        results = self._pending.wait()
        device_s = self._pending.device_s
        if device_s is not None:  # the forward's own seconds on the device: its decode steps, counted as decode
            note_ran(self._rates, device_s, (1,) * self._steps, (self._blocks,) * self._steps)
        return regroup(results, self._sizes)


_UNIT_TYPES = frozenset({StepRequest, StepGroup})  # (exact types: neither has subclasses)
