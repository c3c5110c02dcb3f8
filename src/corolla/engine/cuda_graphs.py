"""Whole-span decode steps of any `SpanModel` captured as CUDA graphs, one per batch-size bucket, replayed with new inputs copied into
static buffers. Rows past the live batch are pointed at the pool's trash page so they never touch real caches."""

from __future__ import annotations

import torch

from corolla.engine.kv_pool import TRASH_PAGE, KVPool
from corolla.engine.span_model import SpanModel
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class DecodeGraphs:
    """Static inputs sized for the largest bucket; `run(rows)` replays the smallest bucket holding `rows` rows after
    the caller filled `hidden[:rows]`, `positions[:rows]`, `block_tables[:rows]`. Use from one thread."""

    def __init__(self, model: SpanModel, pool: KVPool, buckets: tuple[int, ...], *, warmup_iters: int = 2):
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA model")
        self.model = model
        self.pool = pool
        self.buckets = tuple(sorted(set(buckets)))
        self.max_rows = self.buckets[-1]
        self.warmup_iters = warmup_iters
        dev = model.device
        self.hidden = torch.zeros((self.max_rows, model.spec.hidden_size), dtype=model.dtype, device=dev)
        self.positions = torch.zeros((self.max_rows,), dtype=torch.long, device=dev)
        self.block_tables = torch.full(
            (self.max_rows, pool.max_pages_per_seq), TRASH_PAGE, dtype=torch.int32, device=dev
        )
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}  # (first layer, end layer, bucket)
        self._outputs: dict[tuple[int, int, int], torch.Tensor] = {}
        self._mempool = torch.cuda.graph_pool_handle()

    def bucket_for(self, rows: int) -> int:
        for bucket in self.buckets:
            if bucket >= rows:
                return bucket
        raise ValueError(f"{rows} rows exceed the largest CUDA-graph bucket ({self.max_rows})")

    def capture_all(self) -> None:
        """Captures every bucket of the whole span now (largest first, so smaller graphs reuse its memory).
        Sessions over part of the span get their graphs at first use."""
        for bucket in reversed(self.buckets):
            self._capture((0, self.model.num_layers, bucket))

    @torch.inference_mode()
    def _capture(self, key: tuple[int, int, int]) -> None:
        if key in self._graphs:
            return
        first, end, bucket = key
        saved = (self.positions[:bucket].clone(), self.block_tables[:bucket].clone())  # a caller may have filled them
        self._reset_rows(0, bucket)  # warm-up and capture touch only the trash page
        args = (self.hidden[:bucket], self.positions[:bucket], self.block_tables[:bucket], self.pool, (first, end))
        stream = torch.cuda.Stream(device=self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):  # warm-up compiles kernels and creates library handles outside capture
            for _ in range(self.warmup_iters):
                self.model.decode(*args)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            out = self.model.decode(*args)
        self._graphs[key] = graph
        self._outputs[key] = out
        self.positions[:bucket].copy_(saved[0])
        self.block_tables[:bucket].copy_(saved[1])
        logger.info(f"cuda_graphs.capture(bucket={bucket}, layers={first}:{end})")

    def _reset_rows(self, start: int, stop: int) -> None:
        if stop > start:
            self.positions[start:stop].zero_()
            self.block_tables[start:stop].fill_(TRASH_PAGE)

    def run(self, rows: int, layers: tuple[int, int] | None = None) -> torch.Tensor:
        """Replays layers [first, end) (default: all) for `rows` live rows; returns the static output [rows, H]
        (valid until the next run)."""
        first, end = layers or (0, self.model.num_layers)
        key = (first, end, self.bucket_for(rows))
        if key not in self._graphs:
            self._capture(key)
        self._reset_rows(rows, key[2])
        self._graphs[key].replay()
        return self._outputs[key][:rows]
