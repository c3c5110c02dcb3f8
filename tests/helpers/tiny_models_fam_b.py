"""Tiny random configs of the FAM-B families (Gemma 2, Gemma 3 text, gpt-oss), registered with `tiny_models` on
import so `make_tiny_model("gemma2", ...)` builds them offline. Windows, soft caps and the SwiGLU limit are small
so that sliding, capping and clamping all change the numbers on 13-40 token tests."""

from __future__ import annotations

from typing import Any

from helpers.tiny_models import BOS_ID, EOS_ID, HIDDEN_SIZE, PAD_ID, VOCAB_SIZE, register_tiny_family

FAM_B_FAMILIES = ("gemma2", "gemma3_text", "gpt_oss")
WINDOW = 6  # sliding window (tokens) of every tiny sliding layer


def _common(num_layers: int) -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.15,  # larger than the default so attention patterns (and position bugs) show
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        sliding_window=WINDOW,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
    )


def gemma2_config(num_layers: int) -> Any:
    import transformers as tf

    return tf.Gemma2Config(
        **_common(num_layers),
        intermediate_size=96,
        query_pre_attn_scalar=24,  # != head_dim: the scale must come from here
        attn_logit_softcapping=1.5,
        final_logit_softcapping=3.0,
        tie_word_embeddings=True,
    )


def gemma3_config(num_layers: int) -> Any:
    import transformers as tf

    common = _common(num_layers)
    # Gemma 3's own pattern (every 3rd layer global here, every 6th in the real models)
    common["layer_types"] = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_layers)]
    return tf.Gemma3TextConfig(
        **common,
        intermediate_size=96,
        query_pre_attn_scalar=16,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        tie_word_embeddings=True,
    )


def gpt_oss_config(num_layers: int) -> Any:
    import transformers as tf

    return tf.GptOssConfig(
        **_common(num_layers),
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=0.5,  # small enough that the clamp bites
        tie_word_embeddings=False,
    )


register_tiny_family("gemma2", gemma2_config)
register_tiny_family("gemma3_text", gemma3_config)
register_tiny_family("gpt_oss", gpt_oss_config)
