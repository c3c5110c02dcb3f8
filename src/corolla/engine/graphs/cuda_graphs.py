"""Whole-span decode steps of any `SpanModel` captured as CUDA graphs, one per batch-size bucket, replayed with new inputs copied into
static buffers (with the paged attention's split counters, `attention_counters`). Each bucket's static inputs lie in
one device byte block (`GraphInputs`, laid out by `InputLayout`: positions, block tables, hidden states), so that a
step writes all of them with one host-to-device copy of a pinned block laid out alike. Rows past the live batch are
pointed at the pool's trash page so they never touch real caches. A span with LoRA adapters (`fast_lora.SpanAdapters`)
gets two graphs per bucket: one applying each row's adapter (its index a static input, `adapters.row_ids`) and one
without adapters for steps where no row uses one."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from corolla.engine.kernels.attention_counters import reserve_attention_counters
from corolla.engine.kv.kv_pool import TRASH_PAGE, KVPool
from corolla.engine.spans.fast_lora import SpanAdapters
from corolla.engine.spans.span_model import SpanModel
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

INPUT_ALIGN_BYTES = 256  # each part of a bucket's input block starts on such a boundary (the allocator's own)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // INPUT_ALIGN_BYTES) * INPUT_ALIGN_BYTES


@dataclass(frozen=True)
class InputLayout:
    """Where a graph bucket's static inputs lie in its byte block: positions [rows] int64 at 0, block tables [rows,
    max_pages_per_seq] int32 at `tables_offset`, hidden states [rows, H] at `hidden_offset`; each part aligned. The
    hidden states come last, so that a copy of the block's first `hidden_end(n)` bytes writes the positions, the
    tables and the first n rows' hidden states (one copy per step), and one of its first `hidden_offset` bytes the
    positions and tables alone (a step whose hidden states are already on the device)."""

    rows: int
    hidden_size: int
    max_pages_per_seq: int
    dtype: torch.dtype
    tables_offset: int
    hidden_offset: int
    nbytes: int

    @classmethod
    def of(cls, rows: int, hidden_size: int, max_pages_per_seq: int, dtype: torch.dtype) -> InputLayout:
        tables_offset = _aligned(rows * 8)
        hidden_offset = tables_offset + _aligned(rows * max_pages_per_seq * 4)
        nbytes = hidden_offset + _aligned(rows * hidden_size * dtype.itemsize)
        return cls(rows, hidden_size, max_pages_per_seq, dtype, tables_offset, hidden_offset, nbytes)

    def hidden_end(self, rows: int) -> int:
        """The block's bytes up to the end of the first `rows` rows' hidden states."""
        return self.hidden_offset + rows * self.hidden_size * self.dtype.itemsize

    def views(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A byte block's (uint8, at least `nbytes`) positions [rows] int64, tables [rows, P] int32 and hidden
        states [rows, H] (views)."""
        positions = block[: self.rows * 8].view(torch.int64)
        tables = block[self.tables_offset : self.tables_offset + self.rows * self.max_pages_per_seq * 4]
        hidden = block[self.hidden_offset : self.hidden_end(self.rows)]
        return (positions, tables.view(torch.int32).view(self.rows, self.max_pages_per_seq),
                hidden.view(self.dtype).view(self.rows, self.hidden_size))  # fmt: skip


@dataclass(eq=False)
class GraphInputs:
    """One bucket's static inputs on the device: its byte `block` and the views the graph reads (`InputLayout`)."""

    layout: InputLayout
    block: torch.Tensor  # [layout.nbytes] uint8
    positions: torch.Tensor  # [rows] int64
    block_tables: torch.Tensor  # [rows, max pages per sequence] int32
    hidden: torch.Tensor  # [rows, H]

    @classmethod
    def allocate(cls, layout: InputLayout, device: torch.device) -> GraphInputs:
        """Position 0 and the trash page in every row (a row never staged touches no real cache)."""
        block = torch.zeros((layout.nbytes,), dtype=torch.uint8, device=device)
        positions, tables, hidden = layout.views(block)
        tables.fill_(TRASH_PAGE)
        return cls(layout, block, positions, tables, hidden)


class DecodeGraphs:
    """Static inputs per bucket (`inputs[bucket]`, `inputs_for(rows)`); `run(rows)` replays the smallest bucket
    holding `rows` rows after the caller filled that bucket's `hidden[:rows]`, `positions[:rows]`,
    `block_tables[:rows]` (and `adapters.row_ids[:rows]` for a step with adapters). Use from one thread."""

    def __init__(
        self,
        model: SpanModel,
        pool: KVPool,
        buckets: tuple[int, ...],
        *,
        warmup_iters: int = 2,
        adapters: SpanAdapters | None = None,
    ):
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA model")
        self.model = model
        self.pool = pool
        self.buckets = tuple(sorted(set(buckets)))
        self.max_rows = self.buckets[-1]
        self.warmup_iters = warmup_iters
        self.adapters = adapters  # the model's stacked LoRA adapters (row_ids sized for max_rows), or None
        if adapters is not None and adapters.row_ids.shape[0] < self.max_rows:
            raise ValueError(f"adapters.row_ids holds {adapters.row_ids.shape[0]} rows, buckets need {self.max_rows}")
        dev = model.device
        # one block per bucket (the buckets' rows together, ~2x the largest: ~1 MiB for Llama-3-8B's 7 buckets)
        self.inputs = {
            b: GraphInputs.allocate(InputLayout.of(b, model.spec.hidden_size, pool.max_pages_per_seq, model.dtype), dev)
            for b in self.buckets
        }
        # the paged attention's split counters (one per row x kv head; zero between replays), made before capture
        self.attention_counters = reserve_attention_counters(dev, self.max_rows * pool.layout.k_token_shape[0])
        # (first layer, end layer, bucket, with adapters) -> graph, static output
        self._graphs: dict[tuple[int, int, int, bool], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int, int, bool], torch.Tensor] = {}
        self._mempool = torch.cuda.graph_pool_handle()
        # one side stream for every warm-up and capture: cuBLAS keeps a workspace (32 MiB on Hopper) per stream it
        # ran on, so a fresh stream per capture (PyTorch hands out its 32 pool streams in turn) held one more
        # workspace per graph (tests/gpu/test_engine_mla_gpu: 4 of them, 128 MiB, for 3 buckets)
        self._stream = torch.cuda.Stream(device=dev)

    def clear(self) -> None:
        """Drops every captured graph (after a change to how the model's step runs, e.g. its adapters' form); the
        next `run` or `capture_all` captures again."""
        self._graphs.clear()
        self._outputs.clear()

    def bucket_for(self, rows: int) -> int:
        for bucket in self.buckets:
            if bucket >= rows:
                return bucket
        raise ValueError(f"{rows} rows exceed the largest CUDA-graph bucket ({self.max_rows})")

    def inputs_for(self, rows: int) -> GraphInputs:
        """The static inputs of the bucket that a step of `rows` rows replays."""
        return self.inputs[self.bucket_for(rows)]

    def capture_all(self) -> None:
        """Captures every bucket of the whole span now (largest first, so smaller graphs reuse its memory).
        Sessions over part of the span get their graphs at first use."""
        variants = (True, False) if self.adapters is not None else (False,)
        for bucket in reversed(self.buckets):
            for adapted in variants:
                self._capture((0, self.model.num_layers, bucket, adapted))

    def _variant(self, adapted: bool) -> contextlib.AbstractContextManager:
        return self.adapters.decode_rows(adapted) if self.adapters is not None else contextlib.nullcontext()

    @torch.inference_mode()
    def _capture(self, key: tuple[int, int, int, bool]) -> None:
        if key in self._graphs:
            return
        first, end, bucket, adapted = key
        if adapted and self.adapters is None:
            raise ValueError("A graph with adapters needs a span with adapters")
        inputs = self.inputs[bucket]
        saved = inputs.block.clone()  # a caller may have filled them
        saved_ids = None if self.adapters is None else self.adapters.row_ids[:bucket].clone()
        self._reset_rows(inputs, 0)  # warm-up and capture touch only the trash page
        args = (inputs.hidden, inputs.positions, inputs.block_tables, self.pool, (first, end))
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream), self._variant(adapted):  # warm-up compiles kernels outside capture
            for _ in range(self.warmup_iters):
                self.model.decode(*args)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool, stream=stream), self._variant(adapted):
            out = self.model.decode(*args)
        self._graphs[key] = graph
        self._outputs[key] = out
        inputs.block.copy_(saved)
        if self.adapters is not None and saved_ids is not None:
            self.adapters.row_ids[:bucket].copy_(saved_ids)
        logger.info(f"cuda_graphs.capture(bucket={bucket}, layers={first}:{end}, adapters={adapted})")

    def _reset_rows(self, inputs: GraphInputs, start: int) -> None:
        stop = inputs.layout.rows
        if stop > start:
            inputs.positions[start:stop].zero_()
            inputs.block_tables[start:stop].fill_(TRASH_PAGE)
            if self.adapters is not None:
                self.adapters.row_ids[start:stop].zero_()

    def run(
        self, rows: int, layers: tuple[int, int] | None = None, *, adapters: bool = False, reset: bool = True
    ) -> torch.Tensor:
        """Replays layers [first, end) (default: all) for `rows` live rows, with each row's adapter when `adapters`
        (the caller filled `self.adapters.row_ids[:rows]`); returns the static output [rows, H] (valid until the
        next run). `reset=False`: the caller also filled the bucket's rows past `rows` (position 0, every table entry
        `TRASH_PAGE`, adapter id 0 where `adapters`), so they are not reset here."""
        first, end = layers or (0, self.model.num_layers)
        key = (first, end, self.bucket_for(rows), adapters)
        if key not in self._graphs:
            self._capture(key)
        if reset:
            self._reset_rows(self.inputs[key[2]], rows)
        self._graphs[key].replay()
        return self._outputs[key][:rows]
