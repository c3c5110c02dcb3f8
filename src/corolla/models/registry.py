"""The model families corolla serves, keyed by `config.model_type`: weight prefix, block builder, KV head count,
default DHT prefix rule (Petals' rules for hub names) and, for tests, the transformers reference layer."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from corolla.models.block_base import CorollaBlock
from corolla.models.bloom.block import BloomBlock
from corolla.models.deepseek_v3.block import DeepseekV3Block, is_moe_layer
from corolla.models.falcon.block import FalconBlock
from corolla.models.gemma.block import Gemma2Block, Gemma3Block
from corolla.models.gpt_oss.block import GptOssBlock
from corolla.models.llama.block import LlamaBlock, Qwen3Block
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


def _config_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _falcon_kv_heads(config) -> int:
    if getattr(config, "new_decoder_architecture", False):
        return config.num_kv_heads
    if getattr(config, "multi_query", False):
        return 1
    return config.num_attention_heads


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
    hf_layer_path: str  # "module:Class" of the transformers reference decoder layer
    alt_block_prefixes: tuple[str, ...] = field(default=())  # other spellings found in checkpoints
    # (config) -> values one token takes in one block's KV cache; None: K + V = 2 * kv heads * head_dim
    cache_values_per_token: Callable[[Any], int] | None = None
    # (config, layer index) -> whether that layer holds routed experts; None: every layer alike
    is_sparse_layer: Callable[[Any, int], bool] | None = None

    @property
    def hf_layer_class(self) -> type[nn.Module]:
        module_name, attr = self.hf_layer_path.rsplit(":", 1)
        return getattr(importlib.import_module(module_name), attr)

    @property
    def block_prefixes(self) -> tuple[str, ...]:
        return (self.block_prefix, *self.alt_block_prefixes)


_TF = "transformers.models"
_FAMILIES: dict[str, ModelFamily] = {
    f.model_type: f
    for f in [
        ModelFamily(
            "llama", "llama", "model.layers", LlamaBlock, _config_kv_heads,
            _llama_prefix, f"{_TF}.llama.modeling_llama:LlamaDecoderLayer",
        ),
        ModelFamily(
            "mistral", "llama", "model.layers", LlamaBlock, _config_kv_heads,
            _llama_prefix, f"{_TF}.mistral.modeling_mistral:MistralDecoderLayer",
        ),
        ModelFamily(
            "qwen2", "llama", "model.layers", LlamaBlock, _config_kv_heads,
            _llama_prefix, f"{_TF}.qwen2.modeling_qwen2:Qwen2DecoderLayer",
        ),
        ModelFamily(
            "mixtral", "mixtral", "model.layers", MixtralBlock,
            _config_kv_heads, _mixtral_prefix, f"{_TF}.mixtral.modeling_mixtral:MixtralDecoderLayer",
        ),
        ModelFamily(
            "falcon", "falcon", "transformer.h", FalconBlock, _falcon_kv_heads,
            _falcon_prefix, f"{_TF}.falcon.modeling_falcon:FalconDecoderLayer",
        ),
        ModelFamily(
            "gemma2", "gemma", "model.layers", Gemma2Block, _config_kv_heads,
            _llama_prefix, f"{_TF}.gemma2.modeling_gemma2:Gemma2DecoderLayer",
        ),
        ModelFamily(
            "gemma3_text", "gemma", "model.layers", Gemma3Block,
            _config_kv_heads, _llama_prefix, f"{_TF}.gemma3.modeling_gemma3:Gemma3DecoderLayer",
        ),
        ModelFamily(
            "gpt_oss", "gpt_oss", "model.layers", GptOssBlock,
            _config_kv_heads, _llama_prefix, f"{_TF}.gpt_oss.modeling_gpt_oss:GptOssDecoderLayer",
        ),
        ModelFamily(
            "bloom", "bloom", "h", BloomBlock, _bloom_kv_heads,
            _bloom_prefix, f"{_TF}.bloom.modeling_bloom:BloomBlock", alt_block_prefixes=("transformer.h",),
        ),
        ModelFamily(
            "qwen3", "qwen3", "model.layers", Qwen3Block, _config_kv_heads,
            _llama_prefix, f"{_TF}.qwen3.modeling_qwen3:Qwen3DecoderLayer",
        ),
        ModelFamily(
            "qwen3_moe", "qwen3_moe", "model.layers", Qwen3MoeBlock,
            _config_kv_heads, _llama_prefix, f"{_TF}.qwen3_moe.modeling_qwen3_moe:Qwen3MoeDecoderLayer",
            is_sparse_layer=is_sparse_layer,
        ),
        ModelFamily(
            "phi3", "phi3", "model.layers", Phi3Block, _config_kv_heads,
            _llama_prefix, f"{_TF}.phi3.modeling_phi3:Phi3DecoderLayer",
        ),
        ModelFamily(
            "deepseek_v3", "deepseek_v3", "model.layers", DeepseekV3Block,
            _mla_kv_heads, _llama_prefix, f"{_TF}.deepseek_v3.modeling_deepseek_v3:DeepseekV3DecoderLayer",
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
