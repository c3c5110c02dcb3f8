"""Tiny random configs of the FAM-A families (Qwen3, Qwen3-MoE, Phi-3, DeepSeek-V3), registered with
`tiny_models` on import so `make_tiny_model("qwen3", ...)` builds them offline like the older families."""

from __future__ import annotations

from typing import Any

from helpers.tiny_models import common_config, register_tiny_family

FAM_A_FAMILIES = ("qwen3", "qwen3_moe", "phi3", "deepseek_v3")


def _common(num_layers: int) -> dict[str, Any]:
    return {**common_config(num_layers), "max_position_embeddings": 512, "rms_norm_eps": 1e-5}


def qwen3_config(num_layers: int) -> Any:
    import transformers as tf

    # head_dim 32 != hidden/heads (16), as in real Qwen3 models whose head_dim is set explicitly
    return tf.Qwen3Config(**_common(num_layers), intermediate_size=128, num_key_value_heads=2, head_dim=32)


def qwen3_moe_config(num_layers: int) -> Any:
    import transformers as tf

    return tf.Qwen3MoeConfig(
        **_common(num_layers),
        intermediate_size=128,  # the dense layers (mlp_only_layers)
        moe_intermediate_size=48,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
    )


def phi3_config(num_layers: int) -> Any:
    import transformers as tf

    return tf.Phi3Config(
        **_common(num_layers), intermediate_size=128, num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0
    )


def deepseek_v3_config(num_layers: int) -> Any:
    import transformers as tf

    return tf.DeepseekV3Config(
        **_common(num_layers),
        intermediate_size=128,  # the first_k_dense_replace dense layers
        moe_intermediate_size=32,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        rope_interleave=True,
    )


for _name, _build in (
    ("qwen3", qwen3_config),
    ("qwen3_moe", qwen3_moe_config),
    ("phi3", phi3_config),
    ("deepseek_v3", deepseek_v3_config),
):
    register_tiny_family(_name, _build)


def tiny_config_of(family: str, num_layers: int = 2) -> Any:
    """The tiny config of a FAM-A family (see FAM_A_FAMILIES)."""
    builders = {"qwen3": qwen3_config, "qwen3_moe": qwen3_moe_config, "phi3": phi3_config}
    builders["deepseek_v3"] = deepseek_v3_config
    return builders[family](num_layers)
