"""The plain `SpanExecutor`: the blocks of a `SpanBackend` with one `MemoryCache` tensor per K and V per block,
one runtime task per request (long forwards as chunk tasks, `forward_chunks`). Serves every family, quantization,
adapter and tensor-parallel setup; its caches can be handed off when the server drains (`kv_handoff`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import torch

from corolla.server.backend import SpanBackend
from corolla.server.executor import (
    PATH_PLAIN,
    BackwardInputs,
    ForwardInputs,
    HandoffUnsupported,
    PreparedStep,
    SessionCache,
    SessionSpec,
    StepInputs,
)
from corolla.server.forward_chunks import run_forward_chunked
from corolla.server.memory_cache import Handle, MemoryCache, TensorDescriptorLike, allocation_size_bytes
from corolla.server.metrics import ServerMetrics
from corolla.server.runtime import Runtime
from corolla.server.task import (
    KIND_BACKWARD,
    KIND_FORWARD,
    KIND_GENERIC,
    KIND_INFERENCE,
    PRIORITY_BACKWARD,
    PRIORITY_FORWARD,
    PRIORITY_INFERENCE,
)

T = TypeVar("T")
KV_TENSORS_PER_BLOCK = 2  # K and V
LENGTH_DIM = 2  # [B, kv_heads, max_length, head_dim]


def measured(
    fn: Callable[[], T], metrics: ServerMetrics | None, kind: str, batch_size: int, num_tokens: int
) -> Callable[[], T]:
    """Wraps a runtime task so that it reports its queue wait, execution time, batch size and tokens."""
    if metrics is None:
        return fn
    submitted = time.perf_counter()

    def task() -> T:
        started = time.perf_counter()
        metrics.queue_wait(started - submitted)
        result = fn()
        metrics.observe_step(time.perf_counter() - started)
        metrics.batch_size(batch_size)
        metrics.tokens(kind, num_tokens)
        return result

    return task


class PlainSessionCache(SessionCache):
    """One `MemoryCache` handle per K/V tensor, grouped per block (in `spec.block_indices` order)."""

    def __init__(self, spec: SessionSpec, handles: tuple[tuple[Handle, ...], ...]):
        super().__init__(spec)
        self.handles = handles


class SpanCompute:
    """Forward and backward over a `SpanBackend` as runtime tasks: shared by both executors (the fast path runs
    only inference steps on its engine)."""

    def __init__(self, backend: SpanBackend, runtime: Runtime, metrics: ServerMetrics | None, *, split_tokens: bool):
        self.backend = backend
        self._runtime = runtime
        self.metrics = metrics
        self.split_tokens = split_tokens  # chunked forwards may use temporary per-block caches of the backend

    async def forward(
        self, block_indices: tuple[int, ...], inputs: ForwardInputs, *, chunk_tokens: int
    ) -> torch.Tensor:
        batch_size, length, _ = inputs.hidden_states.shape
        indices = list(block_indices)
        if chunk_tokens and (len(indices) > 1 or batch_size * length > chunk_tokens):
            return await run_forward_chunked(
                self.backend,
                self._runtime,
                indices,
                inputs.hidden_states,
                inputs.prompts,
                active_adapter=inputs.adapter,
                chunk_tokens=chunk_tokens,
                split_tokens=self.split_tokens,
                measured=lambda fn, num_tokens: measured(fn, self.metrics, "forward", batch_size, num_tokens),
            )
        backend = self.backend

        def task() -> torch.Tensor:
            return backend.forward(indices, inputs.hidden_states, inputs.prompts, inputs.adapter)

        return await self._runtime.submit(
            measured(task, self.metrics, "forward", batch_size, batch_size * length),
            priority=PRIORITY_FORWARD,
            size_tokens=batch_size * length,
            kind=KIND_FORWARD,
        )

    async def backward(self, block_indices: tuple[int, ...], inputs: BackwardInputs) -> list[torch.Tensor]:
        batch_size, length, _ = inputs.hidden_states.shape
        backend, indices = self.backend, list(block_indices)

        def task() -> tuple[torch.Tensor, torch.Tensor | None]:
            return backend.backward(indices, inputs.hidden_states, inputs.grad_outputs, inputs.prompts, inputs.adapter)

        grad_inputs, grad_prompts = await self._runtime.submit(
            measured(task, self.metrics, "backward", batch_size, batch_size * length),
            priority=PRIORITY_BACKWARD,
            size_tokens=batch_size * length,
            kind=KIND_BACKWARD,
        )
        return [grad_inputs] if grad_prompts is None else [grad_inputs, grad_prompts]


class PlainExecutor:
    """`SpanExecutor` over a `SpanBackend` and a `MemoryCache` (see the module docstring)."""

    path = PATH_PLAIN

    def __init__(
        self,
        backend: SpanBackend,
        memory_cache: MemoryCache,
        runtime: Runtime,
        metrics: ServerMetrics | None = None,
        *,
        tensor_parallel: bool = False,
    ):
        self.backend = backend
        self.memory_cache = memory_cache
        self._runtime = runtime
        self.metrics = metrics
        self.tensor_parallel = tensor_parallel  # caches spread over several devices: no hand-off
        self.compute = SpanCompute(backend, runtime, metrics, split_tokens=True)

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    # ---- cache accounting

    @property
    def max_size_bytes(self) -> int:
        return self.memory_cache.max_size_bytes

    @property
    def bytes_left(self) -> int:
        return self.memory_cache.bytes_left

    @property
    def bytes_waiting(self) -> int:
        return self.memory_cache.bytes_waiting

    def _descriptors(self, spec: SessionSpec) -> list[list[TensorDescriptorLike]]:
        return self.backend.cache_descriptors(spec.block_indices, spec.batch_size, spec.max_length_tokens)

    def session_bytes(self, spec: SessionSpec) -> int:
        return allocation_size_bytes([d for per_block in self._descriptors(spec) for d in per_block])

    def cache_bytes_per_token(self, block_indices: tuple[int, ...]) -> int:
        return self.backend.cache_bytes_per_token(block_indices)

    @contextlib.asynccontextmanager
    async def open_session(self, spec: SessionSpec, alloc_timeout_s: float | None) -> AsyncIterator[SessionCache]:
        per_block = self._descriptors(spec)
        flat = [d for descriptors in per_block for d in descriptors]
        async with self.memory_cache.allocate_cache(*flat, timeout_s=alloc_timeout_s) as handles:
            nested, offset = [], 0
            for descriptors in per_block:
                nested.append(tuple(handles[offset : offset + len(descriptors)]))
                offset += len(descriptors)
            yield PlainSessionCache(spec, tuple(nested))

    @staticmethod
    def _own(cache: SessionCache) -> PlainSessionCache:
        if not isinstance(cache, PlainSessionCache):
            raise TypeError(f"PlainExecutor got a cache of another executor: {type(cache).__name__}")
        return cache

    # ---- compute

    async def step(self, cache: SessionCache, inputs: StepInputs) -> torch.Tensor:
        prepared = self.prepare_step(cache, inputs)
        return await self._runtime.submit(
            prepared.fn, priority=prepared.priority, size_tokens=prepared.size_tokens, kind=prepared.kind
        )

    def prepare_step(self, cache: SessionCache, inputs: StepInputs) -> PreparedStep:
        """`step` up to the runtime: one unmerged task (its metrics are taken inside it, `measured`)."""
        own = self._own(cache)
        hidden = inputs.tensor()  # [B, T, H]
        batch_size, length, _ = hidden.shape
        backend, memory_cache, spec = self.backend, self.memory_cache, own.spec

        def task() -> torch.Tensor:
            cache_tensors = [memory_cache.use_cache(*handles) for handles in own.handles]
            return backend.inference_step(
                spec.block_indices,
                hidden,
                cache_tensors,
                prefix_length=inputs.prefix_length,
                max_length=spec.max_length_tokens,
                hypo_ids=inputs.hypo_ids,
                prompts=inputs.prompts,
                adapter=inputs.adapter,
            )

        return PreparedStep(
            fn=measured(task, self.metrics, "inference", batch_size, batch_size * length),
            priority=PRIORITY_INFERENCE, size_tokens=batch_size * max(length, 1), kind=KIND_INFERENCE,
            merge_key=None, payload=None, inline=False, observe=None,
        )  # fmt: skip

    async def forward(
        self, block_indices: tuple[int, ...], inputs: ForwardInputs, *, chunk_tokens: int
    ) -> torch.Tensor:
        return await self.compute.forward(block_indices, inputs, chunk_tokens=chunk_tokens)

    async def backward(self, block_indices: tuple[int, ...], inputs: BackwardInputs) -> list[torch.Tensor]:
        return await self.compute.backward(block_indices, inputs)

    # ---- KV hand-off

    def handoff_layout(self, spec: SessionSpec) -> list[list[TensorDescriptorLike]]:
        if self.tensor_parallel:
            raise HandoffUnsupported("KV hand-off is not supported with tensor parallelism")
        per_block = self._descriptors(spec)
        for descriptors in per_block:
            if len(descriptors) != KV_TENSORS_PER_BLOCK or any(len(d.shape) != 4 for d in descriptors):
                raise HandoffUnsupported("KV hand-off needs one K and one V [B, kv_heads, length, head_dim] per block")
        return per_block

    async def read_kv(self, cache: SessionCache, position: int) -> list[torch.Tensor]:
        own, memory_cache = self._own(cache), self.memory_cache

        def task() -> list[torch.Tensor]:
            result = []
            for handles in own.handles:
                for tensor in memory_cache.use_cache(*handles):  # [B, kv, max_length, hd]
                    result.append(tensor[:, :, :position].to("cpu", copy=True).contiguous())
            return result

        # a copy of the cache is no compute: it counts as one token of the batch budget
        return await self._runtime.submit(task, priority=PRIORITY_INFERENCE, size_tokens=1, kind=KIND_GENERIC)

    async def write_kv(self, cache: SessionCache, tensors: list[torch.Tensor], position: int) -> None:
        own, memory_cache = self._own(cache), self.memory_cache

        def task() -> None:
            flat = [t for handles in own.handles for t in memory_cache.use_cache(*handles)]
            if len(flat) != len(tensors):
                raise ValueError(f"KV import has {len(tensors)} tensors, the session's cache {len(flat)}")
            for target, tensor in zip(flat, tensors, strict=True):
                target[:, :, :position].copy_(tensor)  # [B, kv, position, hd]

        await self._runtime.submit(task, priority=PRIORITY_INFERENCE, size_tokens=1, kind=KIND_GENERIC)
