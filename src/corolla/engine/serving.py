"""The fast path inside a corolla server, behind the interfaces the handler already uses: `EngineSpanBackend`
(a `SpanBackend` whose inference steps run on the engine) and `EngineMemoryCache` (`MemoryCache`'s interface over
the engine's KV pool). `build_fast_path` decides eligibility. Merging steps across sessions needs one hook in
`block_functions.run_inference_step`: delegate to `backend.submit_inference_step` when the backend has it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from corolla.engine.batcher import execute_steps
from corolla.engine.config import EngineConfig
from corolla.engine.span_engine import EngineSession, SpanEngine, StepRequest
from corolla.utils.errors import AllocationFailed
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

KIND_ENGINE_INFERENCE = "engine_inference"
PRIORITY_INFERENCE = 1.0  # same as corolla.server.task.PRIORITY_INFERENCE
_POLL_S = 0.005


@dataclass(frozen=True)
class EngineCacheDescriptor:
    """One engine session (all blocks of a request) as `allocate_cache` sees it; `shape`, `dtype` and `device`
    describe its K/V bytes so that generic byte accounting still works."""

    batch_size: int
    max_length: int
    layers: tuple[int, int]
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class EngineMemoryCache:
    """`MemoryCache`'s interface (allocate_cache / use_cache / byte counters) over a `SpanEngine`'s KV pool:
    an allocation opens an `EngineSession`, `use_cache` returns it, leaving the context closes it."""

    def __init__(self, engine: SpanEngine, max_alloc_timeout_s: float | None = None):
        self.engine = engine
        self.max_alloc_timeout_s = max_alloc_timeout_s
        pool = engine.pool
        self.bytes_per_page = 2 * pool.k[:, 0].numel() * pool.k.element_size()
        self._sessions: dict[int, EngineSession] = {}
        self._counter = itertools.count()
        self._lock = threading.Lock()

    @property
    def max_size_bytes(self) -> int:
        return (self.engine.pool.num_pages - 1) * self.bytes_per_page

    @property
    def bytes_left(self) -> int:
        return self.engine.pool.pages_free * self.bytes_per_page

    @property
    def current_size_bytes(self) -> int:
        return self.max_size_bytes - self.bytes_left

    @property
    def num_handles(self) -> int:
        with self._lock:
            return len(self._sessions)

    @contextlib.asynccontextmanager
    async def allocate_cache(
        self, *descriptors: EngineCacheDescriptor, timeout_s: float | None = 0.0
    ) -> AsyncIterator[tuple[int, ...]]:
        """Opens one engine session for the single descriptor, waiting up to `timeout_s` (capped by
        `max_alloc_timeout_s`) for free pages; AllocationFailed if none come in time."""
        if len(descriptors) != 1 or not isinstance(descriptors[0], EngineCacheDescriptor):
            raise ValueError("EngineMemoryCache.allocate_cache takes exactly one EngineCacheDescriptor")
        if timeout_s is not None and not timeout_s >= 0:
            raise ValueError(f"Allocation timeout must be >= 0 seconds, got {timeout_s}")
        if self.max_alloc_timeout_s is not None:
            timeout_s = self.max_alloc_timeout_s if timeout_s is None else min(timeout_s, self.max_alloc_timeout_s)
        d = descriptors[0]
        deadline = time.monotonic() + (timeout_s or 0.0)
        while True:
            try:
                session = self.engine.open_session(d.batch_size, d.max_length, layers=d.layers)
                break
            except AllocationFailed:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(_POLL_S)
        with self._lock:
            handle = next(self._counter)
            self._sessions[handle] = session
        try:
            yield (handle,)
        finally:
            with self._lock:
                self._sessions.pop(handle, None)
            session.close()

    def use_cache(self, *handles: int) -> list[EngineSession]:
        """The sessions of `handles` (KeyError for a closed or unknown handle); thread-safe."""
        with self._lock:
            try:
                return [self._sessions[h] for h in handles]
            except KeyError as e:
                raise KeyError(f"Cache handle {e.args[0]} is not allocated (freed or never allocated)") from None


class EngineSpanBackend:
    """Wraps a `SpanBackend`: forward/backward and everything else go to it; inference runs on `engine`, whose
    layers are the same blocks (shared tensors). Use with an `EngineMemoryCache` over the same engine."""

    def __init__(self, backend: Any, engine: SpanEngine):
        self.backend = backend
        self.engine = engine
        self.first_block = min(backend.block_indices)
        self._runtimes: set[int] = set()

    def __getattr__(self, name: str) -> Any:  # forward, backward, validate_block_indices, hidden_size, ...
        return getattr(self.backend, name)

    def _layers(self, block_indices: Sequence[int]) -> tuple[int, int]:
        indices = self.backend.validate_block_indices(block_indices)
        return indices[0] - self.first_block, indices[-1] + 1 - self.first_block

    def cache_descriptors(self, block_indices: Sequence[int], batch_size: int, max_length: int) -> list[list[Any]]:
        """One `EngineCacheDescriptor` for the first block of the request, none for the others."""
        layers = self._layers(block_indices)
        if batch_size < 1 or max_length < 0:
            raise ValueError(f"Need batch_size >= 1 and max_length >= 0, got {batch_size} and {max_length}")
        e = self.engine
        pages = e.pool.pages_for(max_length) * batch_size
        shape = (2, e.model.num_layers, pages * e.pool.page_size_tokens, e.pool.num_kv_heads, e.pool.head_dim)
        first = EngineCacheDescriptor(batch_size, max_length, layers, shape, e.dtype, e.device)
        return [[first]] + [[] for _ in range(layers[1] - layers[0] - 1)]

    def inference_step(
        self,
        block_indices: Sequence[int],
        hidden: torch.Tensor,
        cache_tensors: Sequence[Sequence[Any]],
        *,
        prefix_length: int,
        max_length: int,
        hypo_ids: torch.Tensor | None = None,
        prompts: torch.Tensor | None = None,
        adapter: str = "",
    ) -> torch.Tensor:
        """`SpanBackend.inference_step`'s contract, on the engine (runtime thread)."""
        return self.engine.step(
            *self._request(block_indices, hidden, cache_tensors, prefix_length, hypo_ids, prompts, adapter)
        )

    def _request(self, block_indices, hidden, cache_tensors, prefix_length, hypo_ids, prompts, adapter):
        if adapter:
            raise ValueError("This server's fast inference path serves the base model only (no adapters)")
        session = cache_tensors[0][0]
        if session.layers != self._layers(block_indices):
            raise ValueError(f"blocks {list(block_indices)} differ from the session's {session.layers}")
        if isinstance(prefix_length, bool) or not isinstance(prefix_length, int):
            raise ValueError(f"prefix_length must be an int, got {prefix_length!r}")
        if hypo_ids is not None and hypo_ids.numel() == 0:
            hypo_ids = None
        return session, hidden, prefix_length, hypo_ids, prompts

    async def submit_inference_step(
        self,
        runtime: Any,
        memory_cache: EngineMemoryCache,
        block_indices: Sequence[int],
        hidden_states: torch.Tensor,
        *,
        cache_handles: Sequence[Sequence[int]],
        prefix_length: int,
        max_length: int,
        prompts: torch.Tensor | None,
        hypo_ids: torch.Tensor | None,
        active_adapter: str,
        inline: bool = False,
    ) -> torch.Tensor:
        """Submits one inference step as a mergeable runtime task: the runtime hands queued steps of this span to
        one batch executor, which merges their single-token steps into one batched forward. `inline`: the caller
        is the only session, so an idle runtime may run the step in the caller's thread (see `Runtime.submit`)."""
        if id(runtime) not in self._runtimes:
            runtime.register_batch_executor(KIND_ENGINE_INFERENCE, self._execute_tasks, inline_when_idle=True)
            self._runtimes.add(id(runtime))
        cache_tensors = [memory_cache.use_cache(*handles) for handles in cache_handles]
        req = StepRequest(
            *self._request(
                block_indices, hidden_states, cache_tensors, prefix_length, hypo_ids, prompts, active_adapter
            )
        )
        batch_size, length = hidden_states.shape[:2]
        return await runtime.submit(
            lambda: self.engine.step(req.session, req.hidden, req.position, req.hypo_ids, req.prompts),
            priority=PRIORITY_INFERENCE,
            size_tokens=batch_size * max(length, 1),
            kind=KIND_ENGINE_INFERENCE,
            merge_key=("engine", id(self.engine)),
            payload=req,
            inline=inline,
        )

    def _execute_tasks(self, tasks: list) -> list:
        return execute_steps(self.engine, [task.payload for task in tasks])


# With the fast path the device thread needs the GIL for short moments between GPU waits, while the serving loop can
# run Python for a millisecond or more at a time (a burst of requests from many sessions); under the default 5 ms
# switch interval such a burst delays the merged forward that is waiting for the GIL. 0.5 ms bounds that delay.
GIL_SWITCH_INTERVAL_S = 0.0005


def shorten_gil_switch_interval() -> None:
    """Lowers this process's GIL switch interval to `GIL_SWITCH_INTERVAL_S` (never raises it)."""
    if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        logger.info(f"fast_path.gil_switch_interval(seconds={GIL_SWITCH_INTERVAL_S})")


def build_fast_path(
    backend: Any,
    *,
    kv_pool_bytes: int,
    max_seq_len_tokens: int,
    max_batch_rows: int = 64,
    max_alloc_timeout_s: float | None = None,
    warmup: bool = True,
    require_cuda: bool = True,
) -> tuple[EngineSpanBackend, EngineMemoryCache] | None:
    """Wraps `backend` (a `SpanBackend`) with the fast path when it can serve it: CUDA, bf16/fp16 llama-family
    blocks without quantization, tensor parallelism or adapters. Returns None (and logs why) otherwise.
    The KV pool takes `kv_pool_bytes` of device memory at once. `require_cuda=False` allows the CPU (tests)."""
    device = torch.device(backend.device)
    reason = None
    if device.type != "cuda" and require_cuda:
        reason = "not on CUDA"
    elif backend.dtype not in (torch.bfloat16, torch.float16) and require_cuda:
        reason = f"dtype {backend.dtype}"
    elif getattr(backend, "adapters", ()):
        reason = "adapters are loaded"
    if reason is None:
        try:
            config = EngineConfig(
                kv_pool_bytes=kv_pool_bytes, max_seq_len_tokens=max_seq_len_tokens, max_batch_rows=max_batch_rows
            )
            blocks = [backend.blocks[i] for i in sorted(backend.blocks)]
            engine = SpanEngine.from_blocks(blocks, config)
        except ValueError as e:
            reason = str(e)
    if reason is not None:
        logger.info(f"fast_path.disabled(reason={reason!r})")
        return None
    if warmup:
        engine.warmup()
    logger.info(f"fast_path.enabled(layers={engine.model.num_layers}, pool_pages={engine.pool.num_pages})")
    if device.type == "cuda":
        shorten_gil_switch_interval()  # this process now serves a GPU span: see GIL_SWITCH_INTERVAL_S
    return EngineSpanBackend(backend, engine), EngineMemoryCache(engine, max_alloc_timeout_s)
