"""The Phi-3 / Phi-4 decoder layer: Llama's layout with the checkpoint's fused projections read as stored
(`self_attn.qkv_proj` rows `[q heads | k heads | v heads]`, `mlp.gate_up_proj` rows `[gate | up]`, both the row
order of our fused parameters), optional partial rotary (`partial_rotary_factor`, Phi-4-mini), LongRoPE scaling
and a sliding window over every layer where the config sets `sliding_window`."""

from __future__ import annotations

from corolla.models.attention import Attention
from corolla.models.block_base import TensorTarget, same_names
from corolla.models.llama.block import LlamaBlock, head_dim_of, num_kv_heads_of
from corolla.models.positions import RotaryEmbedding, rope_parameters


def make_phi3_attention(config) -> Attention:
    hd = head_dim_of(config)
    window = getattr(config, "sliding_window", None)
    params = rope_parameters(config, also=("longrope",))
    rotary_dim = int(hd * float(params.get("partial_rotary_factor", 1.0)))  # Phi-4-mini rotates a head's first dims
    if rotary_dim < 2 or rotary_dim > hd or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and in [2, head_dim={hd}], got {rotary_dim}")
    return Attention(
        config.hidden_size, config.num_attention_heads, num_kv_heads_of(config), hd, qkv_bias=False, out_bias=False,
        rotary=RotaryEmbedding(rotary_dim, params, int(config.max_position_embeddings)),
        sliding_window=None if window is None else int(window),
    )  # fmt: skip


class Phi3Block(LlamaBlock):
    def _make_attention(self, config, layer_idx: int) -> Attention:
        return make_phi3_attention(config)

    def checkpoint_layout(self) -> dict[str, TensorTarget]:
        return {
            **same_names("input_layernorm.weight", "post_attention_layernorm.weight"),
            "self_attn.qkv_proj.weight": TensorTarget("attn.qkv.weight"),
            "self_attn.o_proj.weight": TensorTarget("attn.o_proj.weight"),
            "mlp.gate_up_proj.weight": TensorTarget("mlp.gate_up.weight"),
            "mlp.down_proj.weight": TensorTarget("mlp.down.weight"),
        }
