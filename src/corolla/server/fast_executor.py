"""The fast `SpanExecutor`: inference steps run on the engine's `SpanEngine` (fused llama-family span, paged
`KVPool`, CUDA graphs) and single-token steps of all sessions queued at once are merged into one batched forward
by the runtime (`engine.batcher.execute_steps` as its batch executor). Forward and backward run on the same blocks
through `SpanBackend` (shared tensors). The paged pool is not handed off on drain: clients replay instead. A session's
LoRA adapter (Petals' `active_adapter`, fixed when the session opens) is bound to its engine session at the first
step; merged steps mix sessions on different adapters (`engine.fast_lora`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import torch

from corolla.engine.batcher import (
    PendingUnits,
    StepGroup,
    StepResult,
    execute_steps,
    flatten_units,
    launch_steps,
    regroup,
)
from corolla.engine.config import EngineConfig
from corolla.engine.span_engine import EngineSession, SpanEngine, StepRequest
from corolla.server.backend import SpanBackend
from corolla.server.executor import (
    PATH_FAST,
    BackwardInputs,
    ForwardInputs,
    HandoffUnsupported,
    PreparedStep,
    SessionCache,
    SessionSpec,
    StepInputs,
)
from corolla.server.memory_cache import TensorDescriptorLike
from corolla.server.metrics import ServerMetrics
from corolla.server.plain_executor import SpanCompute
from corolla.server.runtime import Runtime
from corolla.server.task import PRIORITY_INFERENCE, Task
from corolla.utils.errors import AllocationFailed
from corolla.utils.gil import lower_switch_interval
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

KIND_ENGINE_INFERENCE = "engine_inference"
ALLOC_POLL_S = 0.005  # how often a waiting allocation looks for free pages

# With the fast path the device thread needs the GIL for short moments between GPU waits, while the serving loop can
# run Python for a millisecond or more at a time (a burst of requests from many sessions); under the default 5 ms
# switch interval such a burst delays the merged forward that is waiting for the GIL. 0.5 ms bounds that delay.
GIL_SWITCH_INTERVAL_S = 0.0005


class FastSessionCache(SessionCache):
    """One engine session (all blocks of the request share its pages)."""

    def __init__(self, spec: SessionSpec, session: EngineSession):
        super().__init__(spec)
        self.session = session


class FastExecutor:
    """`SpanExecutor` over a `SpanEngine` built from the blocks of `backend` (see the module docstring)."""

    path = PATH_FAST

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
        self.max_alloc_timeout_s = max_alloc_timeout_s
        self.first_block = min(backend.block_indices)
        pool = engine.pool
        self.bytes_per_page = pool.page_bytes  # all layers, both tensors of the layout (K/V or MLA latent/rope)
        self._merge_key = ("engine", id(engine))
        # token chunks of a long forward use temporary caches of the plain blocks: the engine keeps its own pool
        self.compute = SpanCompute(backend, runtime, metrics, split_tokens=False)
        # one merged batch is at most what one decode forward serves (a graph bucket's rows): steps past it wait for
        # the next forward instead of adding a second forward (a second pass over the weights, for a few rows) that
        # every step of this batch would wait for
        # decode steps on the CUDA-graph path launch in two phases (`engine.batcher.launch_steps`): the runtime
        # launches the next merged forward before it sends this one's replies (no graphs: one phase, no launcher)
        runtime.register_batch_executor(
            KIND_ENGINE_INFERENCE, self._execute_tasks, inline_when_idle=True, max_merged_tokens=engine.max_batch_rows,
            launcher=self._launch_tasks if engine.graphs is not None else None,
        )  # fmt: skip

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    # ---- cache accounting (pages of the pool; page 0 is the pool's reserved null page)

    @property
    def max_size_bytes(self) -> int:
        return (self.engine.pool.num_pages - 1) * self.bytes_per_page

    @property
    def bytes_left(self) -> int:
        return self.engine.pool.pages_free * self.bytes_per_page

    @property
    def bytes_waiting(self) -> int:
        return 0  # waiting allocations poll the pool; none holds a place in a queue

    def session_bytes(self, spec: SessionSpec) -> int:
        return self.engine.pool.pages_for(spec.max_length_tokens) * spec.batch_size * self.bytes_per_page

    def cache_bytes_per_token(self, block_indices: tuple[int, ...]) -> int:
        return self.backend.cache_bytes_per_token(block_indices)

    def _layers(self, block_indices: tuple[int, ...]) -> tuple[int, int]:
        return block_indices[0] - self.first_block, block_indices[-1] + 1 - self.first_block

    @contextlib.asynccontextmanager
    async def open_session(self, spec: SessionSpec, alloc_timeout_s: float | None) -> AsyncIterator[SessionCache]:
        """Opens one engine session, waiting up to `alloc_timeout_s` (capped by `max_alloc_timeout_s`) for free
        pages; AllocationFailed if none come in time."""
        if alloc_timeout_s is not None and not alloc_timeout_s >= 0:
            raise ValueError(f"Allocation timeout must be >= 0 seconds, got {alloc_timeout_s}")
        if self.max_alloc_timeout_s is not None:
            cap = self.max_alloc_timeout_s
            alloc_timeout_s = cap if alloc_timeout_s is None else min(alloc_timeout_s, cap)
        deadline = time.monotonic() + (alloc_timeout_s or 0.0)
        layers = self._layers(spec.block_indices)
        while True:
            try:
                session = self.engine.open_session(spec.batch_size, spec.max_length_tokens, layers=layers)
                break
            except AllocationFailed:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(ALLOC_POLL_S)
        try:
            yield FastSessionCache(spec, session)
        finally:
            session.close()

    @staticmethod
    def _own(cache: SessionCache) -> FastSessionCache:
        if not isinstance(cache, FastSessionCache):
            raise TypeError(f"FastExecutor got a cache of another executor: {type(cache).__name__}")
        return cache

    # ---- compute

    async def step(self, cache: SessionCache, inputs: StepInputs) -> torch.Tensor:
        """A mergeable runtime task: queued steps of this span go to one batch executor call, which merges their
        single-token steps into one batched forward. A lone session's step may run inline on an idle runtime."""
        prepared = self.prepare_step(cache, inputs)
        started = time.perf_counter()
        output: torch.Tensor = await self._runtime.submit(
            prepared.fn, priority=prepared.priority, size_tokens=prepared.size_tokens, kind=prepared.kind,
            merge_key=prepared.merge_key, payload=prepared.payload, inline=prepared.inline,
        )  # fmt: skip
        if prepared.observe is not None:
            prepared.observe(time.perf_counter() - started)  # includes the queue wait
        return output

    def prepare_step(self, cache: SessionCache, inputs: StepInputs) -> PreparedStep:
        """`step` up to the runtime (a device channel's reader thread queues it without a coroutine)."""
        own = self._own(cache)
        self.engine.bind_adapter(own.session, inputs.adapter)  # ValueError: unknown, or not the session's adapter
        meta = inputs.hidden_meta  # (dtype, [B, T, H]) of `hidden_bytes` where no tensor was built
        raw = inputs.hidden_bytes
        if (inputs.hidden_states is None and raw is not None and meta is not None and len(meta[1]) == 3
                and inputs.hypo_ids is None and inputs.prompts is None):  # fmt: skip
            # a device channel's usual step: its bytes only (the cheaper constructor, the same request)
            request = StepRequest.of_bytes(own.session, inputs.prefix_length, raw, meta[0], meta[1],
                                           inputs.hidden_rows)  # fmt: skip
        else:
            request = StepRequest(
                own.session, inputs.hidden_states, inputs.prefix_length, inputs.hypo_ids, inputs.prompts, raw,
                None if meta is None else meta[0], None if meta is None else meta[1], inputs.hidden_rows,
            )  # fmt: skip
        # ValueError (refused here, before it is queued) for inputs this engine can't run; the device thread then
        # checks only the session's state (`SpanEngine.validate`)
        self.engine.check_inputs(request)
        metrics = self.metrics
        observe = None
        if metrics is not None:
            num_tokens = request.rows * request.num_tokens

            def observe(seconds: float) -> None:
                metrics.observe_step(seconds)
                metrics.tokens("inference", num_tokens)

        # positional (fn, priority, size_tokens, kind, merge_key, payload, inline, observe): keywords cost ~0.7 us
        # more per step; `fn` a bound method, cheaper per step than a partial
        return PreparedStep(request.run, PRIORITY_INFERENCE, request.rows * max(request.num_tokens, 1),
                            KIND_ENGINE_INFERENCE, self._merge_key, request, inputs.lone_session, observe)  # fmt: skip

    def _execute_tasks(self, tasks: list[Task]) -> list[StepResult | list[StepResult]]:
        requests, sizes = flatten_units(_units(tasks))
        return regroup(execute_steps(self.engine, requests), sizes)

    def _launch_tasks(self, tasks: list[Task]) -> PendingUnits | None:
        requests, sizes = flatten_units(_units(tasks))
        pending = launch_steps(self.engine, requests)
        return None if pending is None else PendingUnits(pending, sizes)

    async def forward(
        self, block_indices: tuple[int, ...], inputs: ForwardInputs, *, chunk_tokens: int
    ) -> torch.Tensor:
        return await self.compute.forward(block_indices, inputs, chunk_tokens=chunk_tokens)

    async def backward(self, block_indices: tuple[int, ...], inputs: BackwardInputs) -> list[torch.Tensor]:
        return await self.compute.backward(block_indices, inputs)

    # ---- KV hand-off: not for the paged pool

    def handoff_layout(self, spec: SessionSpec) -> list[list[TensorDescriptorLike]]:
        raise HandoffUnsupported("KV hand-off is not supported on the fast path (paged KV pool)")

    async def read_kv(self, cache: SessionCache, position: int) -> list[torch.Tensor]:
        raise HandoffUnsupported("KV hand-off is not supported on the fast path (paged KV pool)")

    async def write_kv(self, cache: SessionCache, tensors: list[torch.Tensor], position: int) -> None:
        raise HandoffUnsupported("KV hand-off is not supported on the fast path (paged KV pool)")


def _units(tasks: list[Task]) -> list[StepRequest | StepGroup]:
    """Each task's payload: one step (`prepare_step`) or a device channel frame's steps (`StepGroup`, one task)."""
    units: list[StepRequest | StepGroup] = []
    for task in tasks:
        payload = task.payload
        if not isinstance(payload, StepRequest | StepGroup):
            raise TypeError(f"{KIND_ENGINE_INFERENCE} task without a StepRequest or StepGroup payload")
        units.append(payload)
    return units


def shorten_gil_switch_interval() -> None:
    """Lowers this process's GIL switch interval to `GIL_SWITCH_INTERVAL_S` (never raises it; an operator's
    `COROLLA_GIL_SWITCH_INTERVAL_MS` wins: `corolla.utils.gil`)."""
    lower_switch_interval(GIL_SWITCH_INTERVAL_S, reason="fast_path")


def build_fast_executor(
    backend: SpanBackend,
    runtime: Runtime,
    *,
    kv_pool_bytes: int,
    max_seq_len_tokens: int,
    metrics: ServerMetrics | None = None,
    max_batch_rows: int = 64,
    max_alloc_timeout_s: float | None = None,
    warmup: bool = True,
) -> FastExecutor:
    """The engine over `backend`'s blocks (their tensors used in place) with a KV pool of `kv_pool_bytes`.
    ValueError if the engine can't serve these blocks; eligibility is decided before (`serving_path`)."""
    config = EngineConfig(
        kv_pool_bytes=kv_pool_bytes, max_seq_len_tokens=max_seq_len_tokens, max_batch_rows=max_batch_rows
    )
    engine = SpanEngine.from_blocks([backend.blocks[i] for i in sorted(backend.blocks)], config)
    if warmup:
        engine.warmup()
    if engine.device.type == "cuda":
        shorten_gil_switch_interval()  # this process now serves a GPU span: see GIL_SWITCH_INTERVAL_S
    logger.info(f"fast_path.enabled(layers={engine.model.num_layers}, pool_pages={engine.pool.num_pages})")
    return FastExecutor(backend, engine, runtime, metrics, max_alloc_timeout_s=max_alloc_timeout_s)
