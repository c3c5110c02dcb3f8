"""A llama-family span as plain tensors: fused q/k/v and gate/up weights (shared with the loaded blocks, no copy),
rotary tables, a batched single-token decode step over ragged per-row positions (CUDA-graph safe) and a chunked
prefill for one sequence with large matmuls. Projection weights may be bitsandbytes' NF4/Int8 layouts
(`engine.quant.quant_weights`, read in place); Qwen3's per-head q/k RMSNorm runs when the layer has `q_norm`/`k_norm`. A layer
whose MLP is a routed mixture of experts (Mixtral, Qwen3-MoE) carries a `moe.RoutedMoE` instead of gate_up/down:
softmax top-k routing and the grouped expert kernels of `engine.moe.routed_experts`, inside the same CUDA-graphed step. LoRA
adapters (`engine.spans.fast_lora.SpanAdapters`) add each row's low-rank delta to the projections they target."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from corolla.engine.kernels.cpu_linear import CpuLinearConfig, SlotKey
from corolla.engine.kernels.prefill_attention import causal_prefill_attention
from corolla.engine.kv.kv_pool import KVLayout, KVPool
from corolla.engine.moe.routed_experts import RoutedMoE, tune_experts
from corolla.engine.ops.decode_ops import DecodeOps
from corolla.engine.quant.quant_weights import Int8Weight, NF4Weight, linear_bias, quant_key, quantized_weight_of
from corolla.engine.spans.fast_lora import DecodeRows, FusedProjection, OneAdapter, SpanAdapters, adapters_from_blocks
from corolla.engine.spans.span_model import (
    PrefillChunk,
    SpanModel,
    static_rotary,
    tensors_nbytes,
)
from corolla.models.layers import SparseMoE
from corolla.models.llama.block import head_dim_of, num_kv_heads_of, sliding_window_of
from corolla.models.lora import LoraLinear
from corolla.models.positions import rotary_cos_sin
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


Weight = torch.Tensor | NF4Weight | Int8Weight


@dataclass(frozen=True)
class LlamaSpec:
    """Shapes and constants of one llama-family decoder layer (Llama 2/3.x, Mistral, Qwen2, Qwen3: a sliding window
    only where it is no shorter than the positions served); biases are the loaded layers' own (`LayerWeights`)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    sliding_window_tokens: int | None = None
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of queries and keys before the rotary embedding

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
        num_heads = int(config.num_attention_heads)
        num_kv_heads, head_dim = int(num_kv_heads_of(config)), int(head_dim_of(config))
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"The fast path implements silu MLPs only, not {act!r}")
        # the blocks' own rule (Mistral: every layer; Qwen2/Qwen3: the layers `layer_types` slides): the span attends
        # to every key, which equals a window no shorter than the positions it serves (`SpanEngine` caps them there)
        layers = range(int(getattr(config, "num_hidden_layers", 1)))
        windows = [w for w in (sliding_window_of(config, i) for i in layers) if w is not None]
        return cls(
            hidden_size=int(config.hidden_size),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=int(config.intermediate_size),
            rms_norm_eps=float(config.rms_norm_eps),
            sliding_window_tokens=min(windows) if windows else None,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
        )

    @property
    def kv_layout(self) -> KVLayout:
        """K and V heads per token per layer."""
        return KVLayout.heads(self.num_kv_heads, self.head_dim)


@dataclass
class LayerWeights:
    """One decoder layer's tensors: `w_qkv` rows are [q heads | k heads | v heads], `w_gate_up` rows [gate | up];
    the four projections are dense tensors or quantized layouts; `q_norm`/`k_norm` [D] for Qwen3-style layers.
    A mixture-of-experts layer has `moe` and no `w_gate_up`/`w_down`."""

    ln1: torch.Tensor  # [H]
    w_qkv: Weight  # [(nq + 2 nkv) D, H]
    b_qkv: torch.Tensor | None
    w_o: Weight  # [H, nq D]
    b_o: torch.Tensor | None
    ln2: torch.Tensor  # [H]
    w_gate_up: Weight | None  # [2 I, H]; None in a mixture-of-experts layer
    b_gate_up: torch.Tensor | None
    w_down: Weight | None  # [H, I]; None in a mixture-of-experts layer
    b_down: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # [D]
    k_norm: torch.Tensor | None = None  # [D]
    moe: RoutedMoE | None = None  # the routed MLP of a Mixtral / Qwen3-MoE layer

    def __post_init__(self) -> None:
        if (self.moe is None) == (self.w_gate_up is None or self.w_down is None):
            raise ValueError("A layer has either gate_up/down projections or a routed mixture of experts")

    def nbytes(self) -> int:
        """Bytes of this layer's weights (quantized ones as stored; every expert of a mixture): what one decode
        step of a dense layer reads."""
        return tensors_nbytes(vars(self).values()) + (0 if self.moe is None else self.moe.nbytes())

    def projections(self) -> tuple[Weight, Weight, Weight | None, Weight | None]:
        return self.w_qkv, self.w_o, self.w_gate_up, self.w_down


class FastLlamaSpan(SpanModel):
    """Consecutive llama-family layers with a batched decode step and a prefill step over a `KVPool`."""

    spec: LlamaSpec

    def __init__(
        self,
        spec: LlamaSpec,
        layers: Sequence[LayerWeights],
        inv_freq: torch.Tensor,
        *,
        max_positions: int,
        rotary_scale: float = 1.0,
        use_triton: bool = True,
        attention_splits_max: int = 16,
        adapters: SpanAdapters | None = None,
    ):
        if not layers:
            raise ValueError("FastLlamaSpan needs at least one layer")
        self.spec = spec
        self.layers = list(layers)
        self.device = layers[0].ln1.device
        self.dtype = layers[0].ln1.dtype
        self.max_positions = max_positions
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        self.cos, self.sin = rotary_cos_sin(inv_freq, 0, max_positions, self.device, rotary_scale)  # [P, D/2] each
        self.ops = DecodeOps(
            self.device, spec.head_dim, use_triton=use_triton, attention_splits_max=attention_splits_max
        )
        self.use_triton = use_triton  # the expert kernels need CUDA + Triton only (not the head-size rule of `ops`)
        self.moe_configs: dict[tuple[int, int, int, int], tuple[int, int, int, int]] = {}  # moe.moe_shape -> config
        if adapters is not None and len(adapters.layers) != len(self.layers):
            raise ValueError(f"adapters cover {len(adapters.layers)} layers, the span has {len(self.layers)}")
        self.adapters = adapters  # LoRA adapters of the loaded blocks (engine.spans.fast_lora), or None
        # decode steps with adapters (fused form): run a projection's norm/gating prologue inside both its GEMM and
        # the adapters' shrink GEMM (None: when both have a tuned single-row Triton kernel; True/False: always/never)
        self.lora_prologue_fused: bool | None = None

    def tune(self) -> dict:
        """Picks, per projection of the single-row decode step, the unfused path (norm/gating kernel + cuBLAS) or
        a fused Triton kernel, by timing both on this device (CUDA + Triton only)."""
        slots: dict[tuple[int, int, str, bool], list[tuple]] = {}
        quantized: dict[tuple[str, int, int], list] = {}
        prologues: dict[tuple[str, int, int], set[str]] = {}  # quantized shape -> the prologues it takes
        for layer in self.layers:
            for w in layer.projections():
                if isinstance(w, NF4Weight | Int8Weight):
                    quantized.setdefault(quant_key(w), []).append(w)
            for w, bias, prologue, norm_w, has_res in (
                (layer.w_qkv, layer.b_qkv, "rmsnorm", layer.ln1, False),
                (layer.w_o, layer.b_o, "none", None, True),
                (layer.w_gate_up, layer.b_gate_up, "rmsnorm", layer.ln2, False),
                (layer.w_down, layer.b_down, "silu", None, True),
            ):
                if isinstance(w, NF4Weight | Int8Weight) and prologue == "rmsnorm":  # (no quantized kernel gates x)
                    prologues.setdefault(quant_key(w), set()).add(prologue)
                    if w is layer.w_gate_up:  # may gate its own output (ops.gate_up)
                        prologues[quant_key(w)].add("gated")
                if bias is None and isinstance(w, torch.Tensor):
                    slots.setdefault((w.shape[0], w.shape[1], prologue, has_res), []).append((w, norm_w))
        for layer, stacks in zip(self.layers, self.adapters.layers if self.adapters is not None else (), strict=False):
            for projection, prologue, norm_w in (("qkv", "rmsnorm", layer.ln1), ("gate_up", "rmsnorm", layer.ln2),
                                                 ("down", "silu", None)):  # fmt: skip
                p = stacks.get(projection)
                if isinstance(p, FusedProjection):  # the adapters' shrink, with the projection's prologue
                    slots.setdefault((p.a.shape[0], p.a.shape[1], prologue, False), []).append((p.a, norm_w))
        report = self.ops.tune_linear(slots, self.spec.rms_norm_eps)
        for key, r in report.items():
            logger.info(
                f"fast_llama.tune(slot={key}, best={r['best']}, us={r['best_us']:.1f}, unfused_us={r['unfused_us']:.1f})"
            )
        quant_report = self.ops.tune_quantized(quantized, prologues={k: tuple(sorted(v)) for k, v in prologues.items()})
        for key, r in quant_report.items():
            logger.info(f"fast_llama.tune_quantized(shape={key}, best={r['best']}, us={r['best_us']:.1f})")
        moe_report = {}
        if self.use_triton:
            mixtures: dict[tuple[int, int, int, int], list[RoutedMoE]] = {}
            for layer in self.layers:
                if layer.moe is not None:
                    mixtures.setdefault(layer.moe.shape, []).append(layer.moe)
            for key, items in mixtures.items():
                r = tune_experts(items)
                if r:
                    self.moe_configs[key] = r["best"]
                    moe_report[("moe", *key)] = r
                    logger.info(f"fast_llama.tune_experts(shape={key}, best={r['best']}, us={r['best_us']:.1f})")
        return {**report, **quant_report, **moe_report}

    def tune_cpu(self, config: CpuLinearConfig) -> dict:
        """CPU: picks each dense projection's GEMM formulation per row bucket by timing them on these weights
        (`DecodeOps.tune_cpu_linear`; quantized weights and the MoE experts keep their own path)."""
        slots: dict[SlotKey, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
        for layer in self.layers:
            for w, bias, has_res in (
                (layer.w_qkv, layer.b_qkv, False),
                (layer.w_o, layer.b_o, True),
                (layer.w_gate_up, layer.b_gate_up, False),
                (layer.w_down, layer.b_down, True),
            ):
                if isinstance(w, torch.Tensor):
                    slots.setdefault((w.shape[0], w.shape[1], bias is not None, has_res), []).append((w, bias))
        return self.ops.tune_cpu_linear(slots, config)

    # ------------------------------------------------------------------------------------------ construction

    @classmethod
    def from_blocks(cls, blocks: Sequence[torch.nn.Module], *, max_positions: int, **kwargs) -> FastLlamaSpan:
        """Uses the tensors of loaded `corolla.models.llama` blocks in place, bitsandbytes NF4/Int8 linears in their
        packed form, LoRA adapters stacked (`fast_lora`; ValueError for an adapter on another module, split linears
        or a block that is not a llama-family layer)."""
        if not blocks:
            raise ValueError("from_blocks needs at least one block")
        spec = LlamaSpec.from_hf_config(blocks[0].config)
        adapters = adapters_from_blocks(blocks)  # first: refuses adapters on other modules
        layers = []
        for block in blocks:
            attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
            moe = RoutedMoE.from_module(mlp) if isinstance(mlp, SparseMoE) else None
            if attn is None or mlp is None or not hasattr(attn, "qkv") or (moe is None and not hasattr(mlp, "gate_up")):
                raise ValueError(f"{type(block).__name__} is not a llama-family block with fused qkv/gate_up")
            dtype = _norm_weight(block, "input_layernorm").dtype
            w_qkv, w_o = projection_weight(attn.qkv, dtype), projection_weight(attn.o_proj, dtype)
            w_gate_up = w_down = None
            if moe is None:
                w_gate_up, w_down = projection_weight(mlp.gate_up, dtype), projection_weight(mlp.down, dtype)
            if getattr(attn, "alibi", False) or getattr(mlp, "act_name", "silu") not in ("silu", "swish"):
                raise ValueError("The fast path needs rotary attention and a SiLU-gated MLP")
            q_norm = k_norm = None
            if spec.qk_norm:
                q_norm, k_norm = attn.q_norm.weight.data, attn.k_norm.weight.data
            layers.append(
                LayerWeights(
                    ln1=_norm_weight(block, "input_layernorm").data,
                    w_qkv=w_qkv,
                    b_qkv=linear_bias(attn.qkv),
                    w_o=w_o,
                    b_o=linear_bias(attn.o_proj),
                    ln2=_norm_weight(block, "post_attention_layernorm").data,
                    w_gate_up=w_gate_up,
                    b_gate_up=None if moe is not None else linear_bias(mlp.gate_up),
                    w_down=w_down,
                    b_down=None if moe is not None else linear_bias(mlp.down),
                    q_norm=q_norm,
                    k_norm=k_norm,
                    moe=moe,
                )
            )
        rotary = getattr(blocks[0].attn, "rotary", None)
        inv_freq, rotary_scale = static_rotary(rotary, max_positions, layers[0].ln1.device)
        return cls(
            spec, layers, inv_freq, max_positions=max_positions, rotary_scale=rotary_scale, adapters=adapters, **kwargs
        )

    # ------------------------------------------------------------------------------------------ compute

    @torch.inference_mode()
    def decode(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        pool: KVPool,
        layers: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        s = self.spec
        b = hidden.shape[0]
        slots, _ = self.ops.decode_slots(positions, block_tables, pool.page_size_tokens)  # [B] long
        h = hidden
        eps = s.rms_norm_eps
        lora = None if self.adapters is None else self.adapters.for_decode(b)  # rows' adapters, or None
        start, end = layers or (0, self.num_layers)
        for i in range(start, end):
            w = self.layers[i]
            if lora is not None and lora.targets(i, "qkv"):
                qkv = self._adapted_linear(lora, i, "qkv", h, w.w_qkv, w.b_qkv, "rmsnorm", w.ln1)
            else:
                qkv = self.ops.linear(
                    h, w.w_qkv, w.b_qkv, prologue="rmsnorm", norm_weight=w.ln1, eps=eps
                )  # [B, (nq+2nkv)D]
            if w.q_norm is not None:
                qkv = self.ops.qk_norm(qkv, w.q_norm, w.k_norm, s.num_heads, s.num_kv_heads, eps)
            q = self.ops.rope_and_store(
                qkv, self.cos, self.sin, positions, slots, pool.k[i], pool.v[i], s.num_heads, s.num_kv_heads, s.head_dim
            )  # [B, nq, D]
            release = self.ops.on_tile_gemv(w.w_o, b)  # (w_o's GEMV may start beside the attention)
            attn = self.ops.paged_decode_attention(
                q, pool.k[i], pool.v[i], block_tables, positions, self.scale, release=release
            )  # [B, nq, D]
            attn = attn.reshape(b, s.q_size)  # [B, nq D]
            h = self.ops.linear(attn, w.w_o, w.b_o, residual=h, released=release)  # [B, H]
            if lora is not None:
                h = lora.apply(i, "o", attn, h)
            if w.moe is not None:
                h = h + self._experts(w.moe, self.ops.rms_norm(h, w.ln2, eps), graph_safe=True)  # [B, H]
                continue
            assert w.w_gate_up is not None and w.w_down is not None  # LayerWeights.__post_init__: moe or both
            if lora is not None and (lora.targets(i, "gate_up") or lora.targets(i, "down")):
                h = self._adapted_mlp(lora, i, w, h)
                continue
            # [B, I] gated by the projection's kernel, or [B, 2I] with the gating left to w_down's ("silu")
            act, owed = self.ops.gate_up(h, w.w_gate_up, w.b_gate_up, w.ln2, eps)
            h = self.ops.linear(act, w.w_down, w.b_down, residual=h, prologue=owed)  # [B, H]
        return h

    def prologue_fused(self, n: int, k: int, c: int, prologue: str, has_residual: bool) -> bool:
        """Whether a single-row projection [n, k] and its adapters' shrink [c, k] both run the prologue inside a
        tuned Triton kernel (then computing it once ahead would add a kernel)."""
        if self.lora_prologue_fused is not None:
            return self.lora_prologue_fused
        chosen = self.ops.single_row_gemm
        base, shrink = chosen.get((n, k, prologue, has_residual)), chosen.get((c, k, prologue, False))
        return base is not None and shrink is not None

    def _adapted_linear(
        self,
        lora: DecodeRows,
        i: int,
        projection: str,
        h: torch.Tensor,
        weight: torch.Tensor | NF4Weight | Int8Weight,
        bias: torch.Tensor | None,
        prologue: str,
        norm_weight: torch.Tensor | None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h [B, K] (or [B, 2K] for "silu") -> residual + prologue(h) @ weight^T + bias + each row's adapter delta
        [B, N]. In the fused form with single-row kernels tuned for both, the base GEMM and the shrink GEMM each
        run the prologue inside (`prologue_fused`); otherwise the prologue runs once ahead of both."""
        eps = self.spec.rms_norm_eps
        p = lora.fused(i, projection)
        if p is not None and h.shape[0] == 1 and bias is None:
            n, k = int(p.bt.shape[1]), int(p.a.shape[1])
            if self.prologue_fused(n, k, int(p.a.shape[0]), prologue, residual is not None):
                y = self.ops.linear(
                    h, weight, None, residual=residual, prologue=prologue, norm_weight=norm_weight, eps=eps
                )
                t = self.ops.linear(h, p.a, None, prologue=prologue, norm_weight=norm_weight, eps=eps)  # [1, C]
                return lora.expand(p, t, y)  # [1, N]
        if prologue == "rmsnorm":
            assert norm_weight is not None
            x = self.ops.rms_norm(h, norm_weight, eps)  # [B, K]
        else:
            x = self.ops.silu_mul(h) if prologue == "silu" else h  # [B, K]
        return lora.apply(i, projection, x, self.ops.linear(x, weight, bias, residual=residual))  # [B, N]

    def _adapted_mlp(self, lora: DecodeRows | OneAdapter, i: int, w: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """h [N, H] + the gated MLP of layer i with the adapters' deltas on gate_up and down -> [N, H]."""
        assert w.w_gate_up is not None and w.w_down is not None
        if isinstance(lora, DecodeRows):
            gate_up = self._adapted_linear(lora, i, "gate_up", h, w.w_gate_up, w.b_gate_up, "rmsnorm", w.ln2)
            return self._adapted_linear(lora, i, "down", gate_up, w.w_down, w.b_down, "silu", None, residual=h)
        x = self.ops.rms_norm(h, w.ln2, self.spec.rms_norm_eps)  # [N, H]
        gate_up = lora.apply(i, "gate_up", x, self.ops.linear(x, w.w_gate_up, w.b_gate_up))  # [N, 2 I]
        act = self.ops.silu_mul(gate_up)  # [N, I]
        return lora.apply(i, "down", act, self.ops.linear(act, w.w_down, w.b_down, residual=h))  # [N, H]

    def _experts(self, moe: RoutedMoE, x: torch.Tensor, *, graph_safe: bool = False) -> torch.Tensor:
        # x [N, H] normed -> routed experts' output [N, H]
        return moe.forward(x, use_triton=self.use_triton, config=self.moe_configs.get(moe.shape), graph_safe=graph_safe)

    def _chunk_state(self, chunk: PrefillChunk) -> OneAdapter | None:
        return None if self.adapters is None else self.adapters.for_prefill()  # the sequence's adapter, or None

    def _prefill_layer(
        self, i: int, h: torch.Tensor, chunk: PrefillChunk, pool: KVPool, lora: OneAdapter | None
    ) -> torch.Tensor:
        q = self.chunk_pre(i, h, chunk.positions, chunk.slots, pool, lora)  # [T, nq, D]
        return self.chunk_post(i, h, self.chunk_attend(i, q, chunk.key_slots, pool), lora)  # [T, H]

    # The three pieces of a prefill chunk's layer. `prefill_graphs` captures `chunk_pre` and `chunk_post` of every
    # layer in static shapes (rows padded to a bucket) as one CUDA graph, with the paged Triton attention that reads
    # the chunk's lengths on the device in place of `chunk_attend`, whose key count is the sequence's length.

    def chunk_pre(
        self,
        i: int,
        h: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        pool: KVPool,
        lora: OneAdapter | None = None,
    ) -> torch.Tensor:
        """Layer i's attention input: h [T, H] at `positions` [T] long; writes the rotated keys and values at the
        cache `slots` [T] long. Returns the rotated queries [T, nq, D]."""
        s, w = self.spec, self.layers[i]
        x = self.ops.rms_norm(h, w.ln1, s.rms_norm_eps)  # [T, H]
        qkv = self.ops.linear(x, w.w_qkv, w.b_qkv)  # [T, (nq+2nkv)D]
        if lora is not None:
            qkv = lora.apply(i, "qkv", x, qkv)
        if w.q_norm is not None:
            qkv = self.ops.qk_norm(qkv, w.q_norm, w.k_norm, s.num_heads, s.num_kv_heads, s.rms_norm_eps)
        return self.ops.rope_and_store(
            qkv, self.cos, self.sin, positions, slots, pool.k[i], pool.v[i], s.num_heads, s.num_kv_heads, s.head_dim
        )  # [T, nq, D]

    def chunk_attend(self, i: int, q: torch.Tensor, key_slots: torch.Tensor, pool: KVPool) -> torch.Tensor:
        """q [T, nq, D], the last T of the L positions whose cache slots are `key_slots` [L] long -> layer i's
        causal attention [T, nq D]."""
        s = self.spec
        # index_select: advanced indexing costs more host time per call (the chunk after a prefix is host-bound)
        k = pool.k[i].view(-1, s.num_kv_heads, s.head_dim).index_select(0, key_slots)  # [L, nkv, D]
        v = pool.v[i].view(-1, s.num_kv_heads, s.head_dim).index_select(0, key_slots)
        attn = causal_prefill_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=self.scale,
            enable_gqa=s.num_kv_heads != s.num_heads,
        )  # fmt: skip
        return attn[0].transpose(0, 1).reshape(q.shape[0], s.q_size)  # [T, nq D]

    def chunk_post(self, i: int, h: torch.Tensor, attn: torch.Tensor, lora: OneAdapter | None = None) -> torch.Tensor:
        """Layer i's output projection and MLP: residual h [T, H] and attention output attn [T, nq D] -> [T, H]."""
        s, w = self.spec, self.layers[i]
        h = self.ops.linear(attn, w.w_o, w.b_o, residual=h)
        if lora is not None:
            h = lora.apply(i, "o", attn, h)
        if w.moe is not None:
            return h + self._experts(w.moe, self.ops.rms_norm(h, w.ln2, s.rms_norm_eps))  # [T, H]
        assert w.w_gate_up is not None and w.w_down is not None
        if lora is not None:
            return self._adapted_mlp(lora, i, w, h)
        x = self.ops.rms_norm(h, w.ln2, s.rms_norm_eps)
        act = self.ops.silu_mul(self.ops.linear(x, w.w_gate_up, w.b_gate_up))  # [T, I]
        return self.ops.linear(act, w.w_down, w.b_down, residual=h)  # [T, H]


def _norm_weight(block: torch.nn.Module, name: str) -> torch.Tensor:
    """The weight [H] of the block's norm layer `name` (ValueError when that layer has no weight tensor)."""
    weight = block.get_submodule(name).weight
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{type(block).__name__}.{name} has no weight tensor")
    return weight


def projection_weight(module: torch.nn.Module, dtype: torch.dtype) -> Weight:
    """A projection's weight as the fast path reads it: a plain linear's tensor or a bitsandbytes layout (under a
    `LoraLinear`, its base layer's)."""
    if isinstance(module, LoraLinear):
        module = module.base
    if type(module) is torch.nn.Linear:
        return module.weight.data
    quantized = quantized_weight_of(module, dtype)
    if quantized is None:
        raise ValueError(f"The fast path needs plain or bitsandbytes linear layers, not {type(module).__name__}")
    return quantized
