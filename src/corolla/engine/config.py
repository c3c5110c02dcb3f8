"""Typed settings of the engine: `EngineConfig` (pool size, page size, graph buckets, tuning). The shape facts of a
span (`LlamaSpec`, `MlaSpec`, `DenseSpec`) live with their span models in `spans/`."""

from __future__ import annotations

from dataclasses import dataclass

from corolla.engine.kernels.cpu_linear import CpuLinearConfig


@dataclass(frozen=True)
class EngineConfig:
    """How the engine sizes its KV pool and batches. `kv_pool_bytes` is the whole pool for all layers of the span;
    `page_size_tokens` must be a power of two (the attention kernel reads one page per iteration)."""

    kv_pool_bytes: int = 2 << 30
    page_size_tokens: int = 64
    max_seq_len_tokens: int = 8192
    max_batch_rows: int = 64
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    use_cuda_graphs: bool = True
    use_triton: bool = True
    tune_gemm: bool = True  # at warm-up, time cuBLAS against Triton for single-row projections and keep the faster
    prefill_chunk_tokens: int = 4096
    # CUDA, llama-family spans: prefill chunks of at most this many tokens (the turn after a cached prefix) replay
    # one CUDA graph over the span's layers (`prefill_graphs`); 0: always eager
    prefill_graph_tokens: int = 256
    # the operator's cap on cached prefix positions no session holds, per layer (None: every free page)
    prefix_cache_tokens: int | None = None
    attention_splits_max: int = 16
    cpu_linear: CpuLinearConfig = CpuLinearConfig()  # CPU: projections' GEMM chosen per row bucket at warm-up
    # GPU: the warm-up tuner's choices kept here between starts, per card and versions (engine.kernels.kernel_choices);
    # None: every warm-up times every candidate
    kernel_choices_dir: str | None = None

    def __post_init__(self) -> None:
        if self.page_size_tokens < 16 or self.page_size_tokens & (self.page_size_tokens - 1):
            raise ValueError(f"page_size_tokens must be a power of two >= 16, got {self.page_size_tokens}")
        if self.max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {self.max_batch_rows}")
        if self.max_seq_len_tokens < 1:
            raise ValueError(f"max_seq_len_tokens must be >= 1, got {self.max_seq_len_tokens}")
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0, got {self.prefill_graph_tokens}")
