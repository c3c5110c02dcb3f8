"""Short prefill chunks of a llama-family span replayed as CUDA graphs: the next turn of a conversation whose history
is cached computes ~100-250 positions, and eagerly the host spends longer issuing its ~30 operations per layer than
the device spends running them (issue 34, docs/decisions/0019). A graph per (layers, chunk bucket, key bucket) runs
`FastLlamaSpan.prefill_static`: the chunk's rows padded to a bucket (8, 16, then multiples of 32 up to
`EngineConfig.prefill_graph_tokens`), the keys gathered for the sequence's length rounded up to 1,024 positions, the
real lengths in device tensors read by flash attention's variable-length form; so one graph serves any prefix
length in its key bucket. Padding rows write only into the pool's trash page. Graphs are captured at first use into
one memory pool (they run one at a time, so each reuses the others' scratch) and write into one shared output; at
most `MAX_GRAPHS` are kept; `reserved_bytes` is what their captures added to the device's reserved memory (the
pool: about one chunk's activations and one gather of keys and values)."""

from __future__ import annotations

import torch

from corolla.engine.fast_llama import FastLlamaSpan
from corolla.engine.kv_pool import KVPool, SequenceSlot
from corolla.engine.prefill_attention import flash_fits
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_GRAPHS = 32  # captured graphs kept (least recently used dropped): their count is bounded, not their buckets'
KEY_BUCKET_TOKENS = 1024  # keys gathered per graph: the sequence's length rounded up to this (gathering is cheap)


def chunk_bucket(tokens: int) -> int:
    """The padded row count of a chunk of `tokens` rows: 8, 16, then the next multiple of 32 (GEMM tiles)."""
    if tokens <= 16:
        return 8 if tokens <= 8 else 16
    return -(-tokens // 32) * 32


def key_bucket(total_tokens: int) -> int:
    return -(-total_tokens // KEY_BUCKET_TOKENS) * KEY_BUCKET_TOKENS


def graphs_serve(model: object) -> bool:
    """Whether a span's short prefill chunks can run as graphs: a llama-family span on CUDA without adapters or
    routed experts whose attention shapes flash attention takes."""
    if not isinstance(model, FastLlamaSpan) or model.device.type != "cuda" or model.adapters is not None:
        return False
    if any(layer.moe is not None for layer in model.layers):
        return False
    s = model.spec
    q = torch.empty((1, s.num_heads, 2, s.head_dim), dtype=model.dtype, device=model.device)
    kv = torch.empty((1, s.num_kv_heads, 4, s.head_dim), dtype=model.dtype, device=model.device)
    return flash_fits(q, kv, kv, s.num_heads != s.num_kv_heads)


class PrefillGraphs:
    """`run(hidden, start, slot, layers)` computes a chunk of at most `max_tokens` rows through the captured graph
    of its buckets (captured on first use). Use from one thread (the engine's device thread)."""

    def __init__(self, model: FastLlamaSpan, pool: KVPool, max_tokens: int):
        if not graphs_serve(model):
            raise ValueError("prefill graphs need a llama-family span on CUDA without adapters or experts")
        self.model = model
        self.pool = pool
        self.max_tokens = max_tokens
        dev = model.device
        rows = chunk_bucket(max_tokens)
        self.hidden = torch.zeros((rows, model.spec.hidden_size), dtype=model.dtype, device=dev)  # [Tmax, H]
        self.output = torch.zeros_like(self.hidden)  # every graph's result lands here: [Tmax, H]
        # the session's page table, then cu_seq_q = [0, t] and cu_seq_k = [0, start + t]: one copy per chunk
        self.ints = torch.zeros((pool.max_pages_per_seq + 4,), dtype=torch.int32, device=dev)
        # (first layer, end layer, rows, key tokens) -> graph, least recently used first
        self._graphs: dict[tuple[int, int, int, int], torch.cuda.CUDAGraph] = {}
        self._mempool = torch.cuda.graph_pool_handle()
        self.reserved_bytes = 0  # what the captures added to the device's reserved memory
        self.replays = 0
        self.capture_error: str | None = None  # a capture that failed: every chunk runs eagerly from then on

    @property
    def graph_count(self) -> int:
        return len(self._graphs)

    def takes(self, tokens: int) -> bool:
        return 0 < tokens <= self.max_tokens and self.capture_error is None

    @torch.inference_mode()
    def run(self, hidden: torch.Tensor, start: int, slot: SequenceSlot, layers: tuple[int, int]) -> torch.Tensor:
        """hidden [t, H] on the device at positions [start, start + t) of the sequence in `slot` through layers
        [first, end) -> [t, H] (a new tensor)."""
        t = hidden.shape[0]
        total = start + t
        host = torch.cat([slot.table, torch.tensor([0, t, 0, total], dtype=torch.int32)])  # [maxp + 4]
        self.ints.copy_(host, non_blocking=True)  # pageable source: staged before the call returns
        self.hidden[:t].copy_(hidden)
        key = (*layers, chunk_bucket(t), key_bucket(total))
        graph = self._graphs.pop(key, None)
        if graph is None:
            try:
                graph = self._capture(key)
            except RuntimeError as e:  # (a kernel this device or torch can't capture): serve on, eagerly
                self.capture_error = repr(e)
                logger.warning(f"prefill_graphs.capture_failed(key={key}, error={e!r}): short chunks run eagerly")
                return self.model.prefill(hidden, start, slot, self.pool, chunk_tokens=t, layers=layers)
        self._graphs[key] = graph  # the most recently used last
        graph.replay()
        self.replays += 1
        return self.output[:t].clone()

    def _capture(self, key: tuple[int, int, int, int]) -> torch.cuda.CUDAGraph:
        first, end, rows, key_tokens = key
        maxp = self.pool.max_pages_per_seq
        args = (
            self.hidden[:rows],
            self.ints[:maxp],
            self.ints[maxp : maxp + 2],
            self.ints[maxp + 2 :],
            key_tokens,
            self.pool,
            (first, end),
        )
        dev = self.model.device
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # compiles this shape's kernels outside capture (writes what the replay will)
            self.model.prefill_static(*args)
        torch.cuda.current_stream(dev).wait_stream(stream)
        if len(self._graphs) >= MAX_GRAPHS:  # the least recently used goes (its scratch stays in the shared pool)
            self._graphs.pop(next(iter(self._graphs)))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):  # (entering empties the allocator's cache: measured inside)
            before = torch.cuda.memory_reserved(dev)
            self.output[:rows].copy_(self.model.prefill_static(*args))
            self.reserved_bytes += torch.cuda.memory_reserved(dev) - before
        self._graphs[key] = graph
        logger.info(
            f"prefill_graphs.capture(layers={first}:{end}, rows={rows}, key_tokens={key_tokens}, "
            f"graphs={len(self._graphs)}, reserved_bytes={self.reserved_bytes})"
        )
        return graph
