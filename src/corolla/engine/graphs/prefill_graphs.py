"""Short prefill chunks of a llama-family span replayed as one CUDA graph over all the span's layers: the next turn of
a conversation whose history is cached computes ~100-250 positions, and eagerly the host spent longer issuing its ~30
operations per layer than the device spent running them (issue 34, docs/decisions/0019).

A chunk's rows are padded to a bucket (8, 16, then multiples of 32 up to `EngineConfig.prefill_graph_tokens`), and
everything the graph reads that changes between chunks lives in two static buffers: the residual stream `h` [rows,
H] and `index` [2 + max pages] int32 (the chunk's first position, its row count, the sequence's block table). The
graph derives the rows' positions and cache slots from `index` (padding rows: position 0, the pool's trash page),
runs each layer's `chunk_pre` (norm, QKV projection, rotation, cache write), the attention over the sequence's pages
(`prefill_attention_triton`: split over the keys, lengths read on the device, so one graph serves any prefix
length) and `chunk_post` (output projection, MLP).

`warmup` (before serving) compiles and times every row bucket's work, so no chunk pays a Triton compile (seconds);
the graph of a (layer range, row bucket) group is captured at its first chunk, which runs the same work eagerly
first; the graphs share one memory pool (they run one at a time); at most `MAX_GROUPS` groups are kept (least
recently used dropped). With `capture=False` (the CPU, in tests) the same work runs eagerly with the attention's
reference."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from corolla.engine.kernels.graph_timing import time_configs
from corolla.engine.kernels.prefill_attention import paged_prefill_attention_ref
from corolla.engine.kv.kv_pool import TRASH_PAGE, KVPool, SequenceSlot
from corolla.engine.ops.decode_ops import triton_usable
from corolla.engine.spans.fast_llama import FastLlamaSpan
from corolla.engine.spans.span_model import table_slots
from corolla.utils.logging import get_logger

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs run the graphs' work eagerly, with the reference
    from corolla.engine.kernels.prefill_attention_triton import (
        ATTENTION_CONFIGS,
        PrefillAttentionConfig,
        paged_prefill_attention,
    )

    TRITON_IMPORTED = True
except ImportError:  # pragma: no cover - depends on the installation
    TRITON_IMPORTED = False

logger = get_logger(__name__)

MAX_GROUPS = 8  # (layer range, row bucket) groups kept: one graph each
TUNE_PREFIX_TOKENS = 4096  # the prefix the attention's launches are timed over (issue 34's conversations)


def chunk_bucket(tokens: int) -> int:
    """The padded row count of a chunk of `tokens` rows: 8, 16, then the next multiple of 32 (GEMM tiles)."""
    if tokens <= 16:
        return 8 if tokens <= 8 else 16
    return -(-tokens // 32) * 32


def graphs_serve(model: object) -> bool:
    """Whether a span's short prefill chunks can run as graphs: a llama-family span on CUDA with Triton, without
    adapters or routed experts."""
    if not isinstance(model, FastLlamaSpan) or model.adapters is not None:
        return False
    if not TRITON_IMPORTED or not triton_usable(model.device, model.spec.head_dim):
        return False
    return all(layer.moe is None for layer in model.layers)


class PrefillGraphs:
    """`run(hidden, start, slot, layers)` computes a chunk of at most `max_tokens` rows (see the module docstring).
    Use from one thread (the engine's device thread)."""

    def __init__(self, model: FastLlamaSpan, pool: KVPool, max_tokens: int, *, capture: bool = True):
        if capture and not graphs_serve(model):
            raise ValueError("prefill graphs need a llama-family CUDA span with Triton, without adapters or experts")
        self.model = model
        self.pool = pool
        self.max_tokens = max_tokens
        self.capture = capture
        s, dev, dtype = model.spec, model.device, model.dtype
        rows = chunk_bucket(max_tokens)
        # what a graph reads: the residual stream [Rmax, H] (also its output), and index [2 + maxp] int32: the
        # chunk's first position, its rows, the sequence's block table
        self.h = torch.zeros((rows, s.hidden_size), dtype=dtype, device=dev)
        self.index = torch.zeros((2 + pool.max_pages_per_seq,), dtype=torch.int32, device=dev)
        self.row_ids = torch.arange(rows, device=dev)  # [Rmax]
        self.trash_slots = TRASH_PAGE * pool.page_size_tokens + self.row_ids % pool.page_size_tokens  # [Rmax]
        # (first layer, end layer, rows) -> the group's graph replay (or its eager work), least recently used first
        self._groups: dict[tuple[int, int, int], Callable[[], None]] = {}
        self.attention_configs: dict[int, PrefillAttentionConfig] = {}  # rows -> the launch taken (CUDA)
        # rows -> {launch: ms over the group's layers} as `_tune_attention` timed them (the tuner census reads them)
        self.attention_timings: dict[int, dict[PrefillAttentionConfig, float]] = {}
        self._mempool = torch.cuda.graph_pool_handle() if capture else None
        self.reserved_bytes = 0  # what the captures added to the device's reserved memory
        self.chunks = 0
        self.capture_error: str | None = None  # a capture that failed: later chunks run eagerly
        self.warmup_s = 0.0  # what `warmup` took (compiles and timings no chunk pays)

    @property
    def graph_count(self) -> int:
        """The groups held as captured graphs (not those that run eagerly)."""
        return sum(isinstance(getattr(step, "__self__", None), torch.cuda.CUDAGraph) for step in self._groups.values())

    def takes(self, tokens: int) -> bool:
        return 0 < tokens <= self.max_tokens and self.capture_error is None

    @property
    def buckets(self) -> list[int]:
        """Every padded row count a chunk of at most `max_tokens` rows may have."""
        return sorted({chunk_bucket(t) for t in range(1, self.max_tokens + 1)})

    @torch.inference_mode()
    def warmup(self, layers: tuple[int, int]) -> None:
        """Chooses the attention's launch of every row bucket (CUDA) and runs each bucket's work over `layers` once,
        its rows at positions [0, rows) of a sequence whose block table names only the trash page: every kernel a
        chunk will run is compiled now, and nothing but the trash page is written. Captures nothing (a group's graph
        is captured at its first chunk, in a fraction of the time of a compile)."""
        began = time.perf_counter()
        capacity = self.pool.max_pages_per_seq * self.pool.page_size_tokens
        for rows in self.buckets:
            if self.capture and rows not in self.attention_configs:
                config = self._tune_attention(rows, layers)
                if config is None:
                    self.capture_error = "no prefill attention launch ran on this device"
                    break
                self.attention_configs[rows] = config
            self.index.fill_(TRASH_PAGE)  # the block table: every page the trash page
            self.index[0] = 0  # the chunk's first position; its rows (a short sequence holds fewer than a bucket):
            self.index[1] = min(rows, capacity)
            self._work(layers, rows)()
        self.warmup_s += time.perf_counter() - began
        logger.info(f"prefill_graphs.warmup(layers={layers[0]}:{layers[1]}, buckets={self.buckets}, "
                    f"s={self.warmup_s:.2f}, error={self.capture_error})")  # fmt: skip

    @torch.inference_mode()
    def run(self, hidden: torch.Tensor, start: int, slot: SequenceSlot, layers: tuple[int, int]) -> torch.Tensor:
        """hidden [t, H] on the device at positions [start, start + t) of the sequence in `slot` through layers
        [first, end) -> [t, H] (a new tensor)."""
        t = hidden.shape[0]
        rows = chunk_bucket(t)
        # one host-to-device copy for the chunk's whole index (from pageable memory: staged at once, so the host
        # tensor may go)
        self.index.copy_(torch.cat((torch.tensor((start, t), dtype=torch.int32), slot.table)))
        self.h[:t].copy_(hidden)
        key = (*layers, rows)
        step = self._groups.pop(key, None)
        if step is None:  # this group's first chunk: its launch chosen, its work run eagerly, then captured
            logger.info(f"prefill_graphs.group(layers={layers[0]}:{layers[1]}, rows={rows}, capture={self.capture})")
            if self.capture and rows not in self.attention_configs:
                config = self._tune_attention(rows, layers)
                if config is None:  # this chunk runs eagerly with the reference, later ones on the eager path
                    self.capture_error = "no prefill attention launch ran on this device"
                else:
                    self.attention_configs[rows] = config
            work = self._work(layers, rows)
            work()
            step = self._captured(work, layers, rows)
        else:
            step()
        self._groups[key] = step  # the most recently used last
        while len(self._groups) > MAX_GROUPS:
            self._groups.pop(next(iter(self._groups)))
        self.chunks += 1
        return self.h[:t].clone()

    def _work(self, layers: tuple[int, int], rows: int) -> Callable[[], None]:
        """The group's work on the static buffers: rows' positions and slots from `index`, then every layer."""
        model, pool, page = self.model, self.pool, self.pool.page_size_tokens
        h, r, trash = self.h[:rows], self.row_ids[:rows], self.trash_slots[:rows]
        attend = self._attention(rows)

        def work() -> None:
            start, t = self.index[0].long(), self.index[1].long()  # (0-d, on the device)
            real = r < t  # [rows]
            positions = torch.where(real, start + r, 0)  # [rows]
            slots = torch.where(real, table_slots(self.index[2:], positions, page), trash)  # [rows]
            x = h
            for i in range(*layers):
                q = model.chunk_pre(i, x, positions, slots, pool)  # [rows, nq, D]
                attn = attend(q, pool.k[i], pool.v[i], self.index)  # [rows, nq, D]
                x = model.chunk_post(i, x, attn.view(rows, -1))  # [rows, H]
            h.copy_(x)

        return work

    def _attention(self, rows: int) -> Callable[..., torch.Tensor]:
        """(q, k_cache, v_cache, index) -> the chunk's attention: the Triton kernel with the bucket's launch on CUDA,
        the reference elsewhere."""
        scale = self.model.scale
        config = self.attention_configs.get(rows)
        if config is None or not TRITON_IMPORTED:
            return lambda q, k, v, index: paged_prefill_attention_ref(q, k, v, index, scale=scale)
        return lambda q, k, v, index: paged_prefill_attention(q, k, v, index, scale=scale, config=config)

    def _tune_attention(self, rows: int, layers: tuple[int, int]) -> PrefillAttentionConfig | None:
        """The fastest of `ATTENTION_CONFIGS` for `rows` query rows over a TUNE_PREFIX_TOKENS prefix, timed over the
        group's layers' pages (a made-up block table: the reads are what counts, nothing is written); None when none
        ran (logged)."""
        s, pool, page = self.model.spec, self.pool, self.pool.page_size_tokens
        capacity = pool.max_pages_per_seq * page  # (a sequence's longest: a short one may hold fewer than `rows`)
        t = min(rows, capacity)
        start = max(0, min(TUNE_PREFIX_TOKENS, capacity - t))
        table = torch.arange(pool.max_pages_per_seq, dtype=torch.int32, device=self.index.device) % pool.num_pages
        index = torch.cat((torch.tensor((start, t), dtype=torch.int32, device=table.device), table))
        q = torch.randn((rows, s.num_heads, s.head_dim), dtype=self.model.dtype, device=self.index.device)
        scale = self.model.scale

        def call(config: PrefillAttentionConfig, i: int) -> torch.Tensor:
            return paged_prefill_attention(q, pool.k[i], pool.v[i], index, scale=scale, config=config)

        timings = time_configs(ATTENTION_CONFIGS, call, list(range(*layers)), reps=5)
        if not timings:
            logger.warning(f"prefill_graphs.tune_failed(rows={rows}): every launch failed, chunks run eagerly")
            return None
        self.attention_timings[rows] = timings
        best = min(timings, key=lambda c: timings[c])
        logger.info(f"prefill_graphs.tune(rows={rows}, best={best}, ms={timings[best]:.3f}, "
                    f"all={ {str(c): round(ms, 4) for c, ms in timings.items()} })")  # fmt: skip
        return best

    def _captured(self, work: Callable[[], None], layers: tuple[int, int], rows: int) -> Callable[[], None]:
        """`work` as a CUDA graph's replay (or itself, without capture or after a failed capture)."""
        if not self.capture or self.capture_error is not None:
            return work
        dev = self.model.device
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._mempool):  # (entering empties the allocator's cache)
                before = torch.cuda.memory_reserved(dev)
                work()
                self.reserved_bytes += torch.cuda.memory_reserved(dev) - before
        except RuntimeError as e:  # (a kernel this device or torch can't capture): serve on, eagerly
            self.capture_error = repr(e)
            logger.warning(f"prefill_graphs.capture_failed(layers={layers}, rows={rows}, error={e!r}): runs eagerly")
            return work
        logger.debug(f"prefill_graphs.capture(layers={layers}, rows={rows}, reserved_bytes={self.reserved_bytes})")
        return graph.replay
