"""Typed settings of the fast path: `EngineConfig` (pool size, page size, graph buckets), `LlamaSpec` and `MlaSpec`,
the shape facts of a llama-family or DeepSeek-V3 (multi-head latent attention) span read once from a `transformers`
config; each spec names the `KVLayout` one token takes in the paged pool."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from corolla.engine.kernels.cpu_linear import CpuLinearConfig
from corolla.engine.kv.kv_pool import KVLayout
from corolla.models.deepseek_v3.mla import LATENT_NORM_EPS, mla_softmax_scale


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

    @classmethod
    def from_hf_config(cls, config) -> LlamaSpec:
        """Reads a `LlamaConfig`-like object; ValueError for features the fast path does not implement."""
        model_type = getattr(config, "model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"):
            raise ValueError(f"The fast path supports llama-family and Mixtral/Qwen3-MoE blocks, not {model_type!r}")
        if model_type in ("qwen3", "qwen3_moe") and getattr(config, "use_sliding_window", False):
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
            sliding_window_tokens=(
                getattr(config, "sliding_window", None) if model_type in ("mistral", "mixtral") else None
            ),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
        )

    @property
    def kv_layout(self) -> KVLayout:
        """K and V heads per token per layer."""
        return KVLayout.heads(self.num_kv_heads, self.head_dim)

    def kv_bytes_per_token(self, dtype: torch.dtype, num_layers: int) -> int:
        """K and V bytes that one token occupies across `num_layers` layers."""
        return self.kv_layout.bytes_per_token(dtype, num_layers)


@dataclass(frozen=True)
class MlaSpec:
    """Shapes and constants of DeepSeek-V3 decoder layers (multi-head latent attention; a dense SwiGLU MLP before
    `first_k_dense_replace`, routed + shared experts with group-limited sigmoid routing from it on)."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: one q_proj instead of q_a -> norm -> q_b
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_groups: int
    topk_groups: int
    num_shared_experts: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    rms_norm_eps: float
    latent_norm_eps: float
    softmax_scale: float
    rope_interleave: bool
    attention_bias: bool
    sliding_window_tokens: int | None = None  # MLA attends to the whole context

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_layout(self) -> KVLayout:
        """The latent (kv_lora_rank) and the shared rotary key (qk_rope_head_dim) per token per layer."""
        return KVLayout.latent(self.kv_lora_rank, self.qk_rope_head_dim)

    def kv_bytes_per_token(self, dtype: torch.dtype, num_layers: int) -> int:
        """(kv_lora_rank + qk_rope_head_dim) values per token per layer."""
        return self.kv_layout.bytes_per_token(dtype, num_layers)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and self.num_experts > 0

    @classmethod
    def from_hf_config(cls, config) -> MlaSpec:
        """Reads a `DeepseekV3Config`-like object; ValueError for features the fast path does not implement."""
        model_type = getattr(config, "model_type", None)
        if model_type != "deepseek_v3":
            raise ValueError(f"MlaSpec reads deepseek_v3 configs, not {model_type!r}")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"The fast path implements silu MLPs only, not {act!r}")
        num_experts = int(config.n_routed_experts or 0)
        num_groups = int(getattr(config, "n_group", 1) or 1)
        if num_experts and num_experts % num_groups:
            raise ValueError(f"n_routed_experts={num_experts} is not a multiple of n_group={num_groups}")
        rope_dim = int(config.qk_rope_head_dim)
        if rope_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {rope_dim}")
        q_lora = getattr(config, "q_lora_rank", None)
        return cls(
            hidden_size=int(config.hidden_size),
            num_heads=int(config.num_attention_heads),
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(config.kv_lora_rank),
            qk_rope_head_dim=rope_dim,
            qk_nope_head_dim=int(config.qk_nope_head_dim),
            v_head_dim=int(config.v_head_dim),
            intermediate_size=int(config.intermediate_size),
            moe_intermediate_size=int(config.moe_intermediate_size),
            num_experts=num_experts,
            num_experts_per_tok=int(config.num_experts_per_tok),
            num_groups=num_groups,
            topk_groups=int(getattr(config, "topk_group", 1) or 1),
            num_shared_experts=int(config.n_shared_experts or 0),
            norm_topk_prob=bool(config.norm_topk_prob),
            routed_scaling_factor=float(config.routed_scaling_factor),
            first_k_dense_replace=int(config.first_k_dense_replace),
            rms_norm_eps=float(config.rms_norm_eps),
            latent_norm_eps=LATENT_NORM_EPS,
            softmax_scale=mla_softmax_scale(config),
            rope_interleave=bool(getattr(config, "rope_interleave", False)),
            attention_bias=bool(getattr(config, "attention_bias", False)),
        )
