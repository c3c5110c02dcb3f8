"""The model families corolla serves, keyed by `config.model_type`: weight prefix, block builder, KV head count,
default DHT prefix rule (Petals' rules for hub names)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from corolla.models.block_base import CorollaBlock
from corolla.models.bloom.block import BloomBlock
from corolla.models.deepseek_v3.block import DeepseekV3Block, is_moe_layer
from corolla.models.falcon.block import FalconBlock, falcon_kv_heads
from corolla.models.gemma.block import Gemma2Block, Gemma3Block
from corolla.models.gpt_oss.block import GptOssBlock
from corolla.models.llama.block import LlamaBlock, Qwen3Block, num_kv_heads_of
from corolla.models.mixtral.block import MixtralBlock
from corolla.models.phi3.block import Phi3Block
from corolla.models.qwen3_moe.block import Qwen3MoeBlock, is_sparse_layer


def _repo_name(repo_id: str) -> str:
    return str(repo_id).rstrip("/").split("/")[-1]


def _llama_prefix(repo_id: str) -> str:
    """Repo name only, "." -> "-", "-hf" appended if missing (e.g. `Meta-Llama-3-1-405B-Instruct-hf`)."""
    prefix = _repo_name(repo_id).replace(".", "-")
    return prefix if prefix.endswith("-hf") else prefix + "-hf"


def _falcon_prefix(repo_id: str) -> str:
    """Repo name only, "." -> "-"."""
    return _repo_name(repo_id).replace(".", "-")


def _mixtral_prefix(repo_id: str) -> str:
    """Full repo id, "." -> "-" (e.g. `mistralai/Mixtral-8x22B-Instruct-v0-1`)."""
    return str(repo_id).replace(".", "-")


def _bloom_prefix(repo_id: str) -> str:
    """Full repo id + "-petals", "." -> "-" (e.g. `bigscience/bloom-petals`)."""
    return (str(repo_id) + "-petals").replace(".", "-")


def _bloom_kv_heads(config) -> int:
    return config.n_head


def _mla_kv_heads(config) -> int:
    """MLA caches one latent "head" per token (the latent and the shared rotary key), whatever the query heads."""
    return 1


def _mla_cache_values(config) -> int:
    """MLA: the compressed latent (`kv_lora_rank`) + the shared rotary key (`qk_rope_head_dim`) per token."""
    return int(config.kv_lora_rank) + int(config.qk_rope_head_dim)


@dataclass(frozen=True)
class ModelFamily:
    """What corolla needs to know about one `model_type`."""

    model_type: str
    family: str  # the family's name (its folder under corolla.models, but Qwen3 whose block is in llama/)
    block_prefix: str  # e.g. "model.layers": block i's tensors are "<block_prefix>.<i>.<name>"
    build_block: Callable[..., CorollaBlock]  # (config, layer_idx) -> the block, on the current default device
    num_kv_heads: Callable[[Any], int]  # (config) -> KV heads cached per block (all shards together)
    default_dht_prefix: Callable[[str], str]  # (hub repo id) -> DHT prefix; local paths: see config.default_dht_prefix
    alt_block_prefixes: tuple[str, ...] = field(default=())  # other spellings found in checkpoints
    # (config) -> values one token takes in one block's KV cache; None: K + V = 2 * kv heads * head_dim
    cache_values_per_token: Callable[[Any], int] | None = None
    # (config, layer index) -> whether that layer holds routed experts; None: every layer alike
    is_sparse_layer: Callable[[Any, int], bool] | None = None

    @property
    def block_prefixes(self) -> tuple[str, ...]:
        return (self.block_prefix, *self.alt_block_prefixes)


def _family(
    model_type: str,
    family: str,
    build_block: Callable[..., CorollaBlock],
    *,
    block_prefix: str = "model.layers",
    num_kv_heads: Callable[[Any], int] = num_kv_heads_of,
    dht_prefix: Callable[[str], str] = _llama_prefix,
    **more: Any,
) -> ModelFamily:
    """A `ModelFamily` with llama-style block names, KV heads and DHT prefixes unless given."""
    return ModelFamily(model_type, family, block_prefix, build_block, num_kv_heads, dht_prefix, **more)


_FAMILIES: dict[str, ModelFamily] = {
    f.model_type: f
    for f in [
        _family("llama", "llama", LlamaBlock),
        _family("mistral", "llama", LlamaBlock),
        _family("qwen2", "llama", LlamaBlock),
        _family("mixtral", "mixtral", MixtralBlock, dht_prefix=_mixtral_prefix),
        _family(
            "falcon", "falcon", FalconBlock, block_prefix="transformer.h",
            num_kv_heads=falcon_kv_heads, dht_prefix=_falcon_prefix,
        ),
        _family("gemma2", "gemma", Gemma2Block),
        _family("gemma3_text", "gemma", Gemma3Block),
        _family("gpt_oss", "gpt_oss", GptOssBlock),
        _family(
            "bloom", "bloom", BloomBlock, block_prefix="h", num_kv_heads=_bloom_kv_heads,
            dht_prefix=_bloom_prefix, alt_block_prefixes=("transformer.h",),
        ),
        _family("qwen3", "qwen3", Qwen3Block),
        _family("qwen3_moe", "qwen3_moe", Qwen3MoeBlock, is_sparse_layer=is_sparse_layer),
        _family("phi3", "phi3", Phi3Block),
        _family(
            "deepseek_v3", "deepseek_v3", DeepseekV3Block, num_kv_heads=_mla_kv_heads,
            cache_values_per_token=_mla_cache_values, is_sparse_layer=is_moe_layer,
        ),
    ]
}  # fmt: skip

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILIES)


def get_family(config_or_type) -> ModelFamily:
    """The family for a config (or a `model_type` string); `ValueError` listing the supported types otherwise."""
    model_type = config_or_type if isinstance(config_or_type, str) else getattr(config_or_type, "model_type", None)
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(f"Unsupported model_type {model_type!r}; corolla supports {', '.join(SUPPORTED_MODEL_TYPES)}")
    return family
