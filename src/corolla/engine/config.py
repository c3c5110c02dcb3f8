"""Typed settings of the fast path: `EngineConfig` (pool size, page size, graph buckets) and `LlamaSpec`, the
shape facts of a llama-family span read once from a `transformers` config."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    attention_splits_max: int = 16

    def __post_init__(self) -> None:
        if self.page_size_tokens < 16 or self.page_size_tokens & (self.page_size_tokens - 1):
            raise ValueError(f"page_size_tokens must be a power of two >= 16, got {self.page_size_tokens}")
        if self.max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {self.max_batch_rows}")
        if self.max_seq_len_tokens < 1:
            raise ValueError(f"max_seq_len_tokens must be >= 1, got {self.max_seq_len_tokens}")
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_seq_len_tokens // self.page_size_tokens)

    def bucket_for(self, rows: int) -> int:
        """The smallest graph bucket holding `rows` (rows itself when above every bucket)."""
        for bucket in sorted(self.graph_buckets):
            if bucket >= rows:
                return bucket
        return rows


@dataclass(frozen=True)
class LlamaSpec:
    """Shapes and constants of one llama-family decoder layer (Llama 2/3.x, Mistral without a sliding window
    shorter than the context, Qwen2-style q/k/v biases)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window_tokens: int | None = None
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of queries and keys before the rotary embedding
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, config) -> LlamaSpec:
        """Reads a `LlamaConfig`-like object; ValueError for features the fast path does not implement."""
        model_type = getattr(config, "model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ValueError(f"The fast path supports llama/mistral/qwen2/qwen3 blocks, not {model_type!r}")
        if model_type == "qwen3" and getattr(config, "use_sliding_window", False):
            raise ValueError("The fast path does not implement Qwen3's sliding-window layers")
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"The fast path implements silu MLPs only, not {act!r}")
        qkv_bias = bool(getattr(config, "attention_bias", False)) or model_type == "qwen2"
        return cls(
            hidden_size=int(config.hidden_size),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=int(config.intermediate_size),
            rms_norm_eps=float(config.rms_norm_eps),
            qkv_bias=qkv_bias,
            o_bias=bool(getattr(config, "attention_bias", False)) and model_type != "qwen2",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            sliding_window_tokens=getattr(config, "sliding_window", None) if model_type == "mistral" else None,
            qk_norm=model_type == "qwen3",
        )

    def kv_bytes_per_token(self, dtype: torch.dtype, num_layers: int) -> int:
        """K and V bytes that one token occupies across `num_layers` layers."""
        return 2 * num_layers * self.kv_size * torch.empty((), dtype=dtype).element_size()
