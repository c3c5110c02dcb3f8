"""A DeepSeek-V3 span (multi-head latent attention; dense SwiGLU first layers, then routed + shared experts) as plain
tensors shared with the loaded blocks, over the engine's paged pool whose pages hold each token's normalized latent
(kv_lora_rank) and shared rotary key (qk_rope_head_dim) per layer, never per-head K/V.

Decode (batched over ragged positions, CUDA-graph safe) uses the absorbed form: q_nope goes through kv_b's key half
into the latent space, scores are taken against the cached latents + rotary keys, and kv_b's value half is applied
to the attention output in the latent space. Prefill (one sequence, chunked) decompresses the cached latents with
kv_b and runs ordinary attention. The MoE layers route with the blocks' `group_limited_route` and run the chosen
experts through `engine.moe.routed_experts.experts_forward` (the blocks' per-expert tensors read in place); the shared experts are
one dense SwiGLU."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from corolla.engine.kernels.mla_kernels import paged_latent_attention, rope_rotate, store_latent
from corolla.engine.kernels.prefill_attention import causal_prefill_attention
from corolla.engine.kv.kv_pool import KVLayout, KVPool
from corolla.engine.moe.routed_experts import ExpertWeights, experts_forward, time_expert_configs
from corolla.engine.ops.decode_ops import DecodeOps
from corolla.engine.quant.quant_weights import linear_bias
from corolla.engine.spans.span_model import PrefillChunk, SpanModel, tensors_nbytes
from corolla.models.deepseek_v3.block import DeepseekV3Block
from corolla.models.deepseek_v3.mla import LATENT_NORM_EPS, LatentAttention, mla_softmax_scale
from corolla.models.deepseek_v3.moe import GroupLimitedMoE, group_limited_route
from corolla.models.layers import GatedMLP, RMSNorm
from corolla.models.positions import RotaryEmbedding
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

# DecodeOps checks a head size before enabling its Triton kernels; the latent path uses none of its per-head kernels
# (only norms, SwiGLU and single-row GEMMs), so it passes a size those kernels accept.
OPS_HEAD_DIM = 64


@dataclass(frozen=True)
class MlaSpec:
    """Shapes and constants of DeepSeek-V3 decoder layers (multi-head latent attention; a dense SwiGLU MLP before
    `first_k_dense_replace`, routed + shared experts with group-limited sigmoid routing from it on)."""

    hidden_size: int
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    num_experts_per_tok: int
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    latent_norm_eps: float
    softmax_scale: float
    rope_interleave: bool
    sliding_window_tokens: int | None = None  # MLA attends to the whole context

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_layout(self) -> KVLayout:
        """The latent (kv_lora_rank) and the shared rotary key (qk_rope_head_dim) per token per layer."""
        return KVLayout.latent(self.kv_lora_rank, self.qk_rope_head_dim)

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
        return cls(
            hidden_size=int(config.hidden_size),
            num_heads=int(config.num_attention_heads),
            kv_lora_rank=int(config.kv_lora_rank),
            qk_rope_head_dim=rope_dim,
            qk_nope_head_dim=int(config.qk_nope_head_dim),
            v_head_dim=int(config.v_head_dim),
            num_experts_per_tok=int(config.num_experts_per_tok),
            num_groups=num_groups,
            topk_groups=int(getattr(config, "topk_group", 1) or 1),
            norm_topk_prob=bool(config.norm_topk_prob),
            routed_scaling_factor=float(config.routed_scaling_factor),
            rms_norm_eps=float(config.rms_norm_eps),
            latent_norm_eps=LATENT_NORM_EPS,
            softmax_scale=mla_softmax_scale(config),
            rope_interleave=bool(getattr(config, "rope_interleave", False)),
        )


@dataclass
class MlaAttentionWeights:
    """One layer's latent attention: queries through q_a -> norm -> q_b (or one q_proj), kv_a -> [latent | k_rope],
    kv_b [n (nope + v), c] (its key half absorbed into queries at decode), o [H, n v]."""

    q_a: torch.Tensor | None  # [q_lora, H]
    q_a_bias: torch.Tensor | None
    q_a_norm: torch.Tensor | None  # [q_lora]
    q_b: torch.Tensor  # [n qk, q_lora] (or q_proj [n qk, H] when q_a is None)
    kv_a: torch.Tensor  # [c + r, H]
    kv_a_bias: torch.Tensor | None
    kv_a_norm: torch.Tensor  # [c]
    kv_b: torch.Tensor  # [n (nope + v), c]
    o: torch.Tensor  # [H, n v]
    o_bias: torch.Tensor | None


@dataclass
class DenseMlpWeights:
    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]


@dataclass
class MoeWeights:
    """Router [E, H] and its choice bias [E] (fp32), the routed experts (read in place) and the shared experts."""

    router: torch.Tensor
    score_bias: torch.Tensor
    experts: ExpertWeights
    shared: DenseMlpWeights


@dataclass
class MlaLayerWeights:
    ln1: torch.Tensor  # [H]
    attn: MlaAttentionWeights
    ln2: torch.Tensor  # [H]
    mlp: DenseMlpWeights | MoeWeights

    def nbytes(self) -> int:
        """Bytes of all this layer's weights."""
        return tensors_nbytes((self.ln1, self.ln2, *vars(self.attn).values())) + _mlp_bytes(self.mlp, None)

    def active_nbytes(self, num_experts_used: int) -> int:
        """Bytes one decode step reads when `num_experts_used` distinct routed experts are chosen."""
        attention = tensors_nbytes((self.ln1, self.ln2, *vars(self.attn).values()))
        return attention + _mlp_bytes(self.mlp, num_experts_used)


def _mlp_bytes(mlp: DenseMlpWeights | MoeWeights, num_experts_used: int | None) -> int:
    if isinstance(mlp, DenseMlpWeights):
        return tensors_nbytes((mlp.gate_up, mlp.down))
    experts = mlp.experts.nbytes() if num_experts_used is None else num_experts_used * mlp.experts.expert_nbytes()
    return tensors_nbytes((mlp.router, mlp.score_bias, mlp.shared.gate_up, mlp.shared.down)) + experts


class FastMlaSpan(SpanModel):
    """Consecutive DeepSeek-V3 layers with a batched decode step and a prefill step over a latent `KVPool`."""

    spec: MlaSpec

    def __init__(
        self,
        spec: MlaSpec,
        layers: Sequence[MlaLayerWeights],
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        max_positions: int,
        use_triton: bool = True,
    ):
        if not layers:
            raise ValueError("FastMlaSpan needs at least one layer")
        if cos.shape != (max_positions, spec.qk_rope_head_dim // 2) or sin.shape != cos.shape:
            raise ValueError(f"cos/sin must be [{max_positions}, {spec.qk_rope_head_dim // 2}], got {tuple(cos.shape)}")
        self.spec = spec
        self.layers = list(layers)
        self.device = layers[0].ln1.device
        self.dtype = layers[0].ln1.dtype
        self.max_positions = max_positions
        self.cos = cos.to(self.device, torch.float32).contiguous()  # [P, r/2]
        self.sin = sin.to(self.device, torch.float32).contiguous()
        self.ops = DecodeOps(self.device, OPS_HEAD_DIM, use_triton=use_triton)
        self.expert_config: tuple[int, int, int, int] | None = None  # grouped-experts kernel config (tune)
        # the decode step's Triton kernels (rope + latent norm + cache write, paged latent attention); None: the
        # torch reference of `mla_kernels`. `use_attention_kernels` may be turned off (a benchmark's baseline).
        self.kernels: ModuleType | None = None
        if self.ops.use_triton:
            from corolla.engine.kernels import mla_triton

            self.kernels = mla_triton
        self.use_attention_kernels = self.kernels is not None
        n, nope = spec.num_heads, spec.qk_nope_head_dim
        # per layer: kv_b viewed as [n, nope + v, c]; key half [n, nope, c], value half transposed [n, c, v]: views
        self._w_uk = [w.attn.kv_b.view(n, nope + spec.v_head_dim, -1)[:, :nope] for w in self.layers]
        self._w_uv_t = [w.attn.kv_b.view(n, nope + spec.v_head_dim, -1)[:, nope:].transpose(1, 2) for w in self.layers]

    def active_weight_bytes(self) -> int:
        """Bytes a batch-1 decode step reads: attention, dense MLPs, routers, top-k routed and shared experts."""
        return sum(layer.active_nbytes(self.spec.num_experts_per_tok) for layer in self.layers)

    def tune(self) -> dict:
        """Times cuBLAS against the Triton single-row kernels for each decode projection (CUDA + Triton only)."""
        slots: dict[tuple[int, int, str, bool], list[tuple]] = {}

        def add(w: torch.Tensor, prologue: str, norm: torch.Tensor | None, residual: bool) -> None:
            slots.setdefault((w.shape[0], w.shape[1], prologue, residual), []).append((w, norm))

        for layer in self.layers:
            a = layer.attn
            if a.q_a is not None and a.q_a_bias is None:
                add(a.q_a, "none", None, False)
            add(a.q_b, "rmsnorm" if a.q_a is not None else "none", a.q_a_norm, False)
            if a.kv_a_bias is None:
                add(a.kv_a, "none", None, False)
            if a.o_bias is None:
                add(a.o, "none", None, True)
            mlp = layer.mlp
            if isinstance(mlp, DenseMlpWeights):
                add(mlp.gate_up, "rmsnorm", layer.ln2, False)
                add(mlp.down, "silu", None, True)
            else:  # the shared experts read the normed input the router also reads
                add(mlp.shared.gate_up, "none", None, False)
                add(mlp.shared.down, "silu", None, True)
        report: dict = self.ops.tune_linear(slots, self.spec.rms_norm_eps)
        for key, r in report.items():
            logger.info(f"fast_mla.tune(slot={key}, best={r['best']}, us={r['best_us']:.1f})")
        experts = self._tune_experts()
        if experts:
            report["experts"] = experts
        return report

    @torch.inference_mode()
    def _tune_experts(self) -> dict:
        """The grouped-experts kernel config for every MoE layer (`time_expert_configs`, tokens routed by each
        layer's own group-limited router); {} without CUDA + Triton or MoE layers."""
        moes = [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoeWeights)]
        if not moes or not self.ops.use_triton:
            return {}

        def calls_at(n: int) -> Callable[[tuple[int, ...]], object]:
            x = torch.randn(n, self.spec.hidden_size, device=self.device, dtype=self.dtype)  # [n, H]
            routes = [self._route(m, x) for m in moes]  # (weights, ids) [n, k] each
            return lambda config: [
                experts_forward(x, ids, w, m.experts, config=config) for m, (w, ids) in zip(moes, routes, strict=True)
            ]

        result = time_expert_configs(moes[0].experts, len(moes), calls_at)
        if result:
            self.expert_config = result["best"]
            logger.info(f"fast_mla.tune_experts(best={result['best']}, us={result['best_us']:.1f})")
        return result

    # ------------------------------------------------------------------------------------------ construction

    @classmethod
    def from_blocks(
        cls, blocks: Sequence[torch.nn.Module], *, max_positions: int, use_triton: bool = True
    ) -> FastMlaSpan:
        """Uses the tensors of loaded `corolla.models.deepseek_v3` blocks in place (ValueError for adapters,
        quantized or wrapped linears, dynamic rope, or other blocks)."""
        if not blocks:
            raise ValueError("from_blocks needs at least one block")
        spec = MlaSpec.from_hf_config(blocks[0].config)
        layers = []
        for block in blocks:
            if not isinstance(block, DeepseekV3Block):
                raise ValueError(f"{type(block).__name__} is not a DeepSeek-V3 block")
            if getattr(block, "adapter_names", None):
                raise ValueError("The fast path does not apply LoRA adapters")
            layers.append(_layer_weights(block))
        rotary = _attention(blocks[0]).rotary
        if not isinstance(rotary, RotaryEmbedding) or rotary.rope_type == "dynamic":
            raise ValueError("The DeepSeek-V3 fast path needs static rotary tables (not dynamic NTK scaling)")
        half = spec.qk_rope_head_dim // 2
        device = layers[0].ln1.device
        cos, sin = rotary.cos_sin(0, max_positions, device, torch.float32)  # [P, r]: equal halves, scaling applied
        return cls(spec, layers, cos[:, :half], sin[:, :half], max_positions=max_positions, use_triton=use_triton)

    # ------------------------------------------------------------------------------------------ compute

    def _project_raw(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] (normed) -> q [N, n, qk] (rope part not rotated), kv [N, c + r] (kv_a's output)."""
        s, a = self.spec, self.layers[i].attn
        if a.q_a is not None:
            cq = self.ops.linear(x, a.q_a, a.q_a_bias)  # [N, q_lora]
            q = self.ops.linear(cq, a.q_b, None, prologue="rmsnorm", norm_weight=a.q_a_norm, eps=s.latent_norm_eps)
        else:
            q = self.ops.linear(x, a.q_b, None)  # [N, n qk]
        return q.view(x.shape[0], s.num_heads, s.qk_head_dim), self.ops.linear(x, a.kv_a, a.kv_a_bias)

    def _project(self, i: int, x: torch.Tensor, positions: torch.Tensor):
        """x [N, H] (normed) at positions [N] -> q_nope [N, n, nope], q_rope [N, n, r] (rotated), latent [N, c]
        (normed), k_rope [N, r] (rotated)."""
        s, a = self.spec, self.layers[i].attn
        q, kv = self._project_raw(i, x)  # [N, n, qk], [N, c + r]
        latent = self.ops.rms_norm(kv[:, : s.kv_lora_rank].contiguous(), a.kv_a_norm, s.latent_norm_eps)  # [N, c]
        cos, sin = self.cos[positions], self.sin[positions]  # [N, r/2]
        q_rope = rope_rotate(q[..., s.qk_nope_head_dim :], cos, sin, interleaved=s.rope_interleave)  # [N, n, r]
        k_rope = rope_rotate(kv[:, None, s.kv_lora_rank :], cos, sin, interleaved=s.rope_interleave)[:, 0]  # [N, r]
        return q[..., : s.qk_nope_head_dim], q_rope, latent, k_rope

    def _route(self, mlp: MoeWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] (normed) -> (weights [N, k] fp32, expert ids [N, k])."""
        s = self.spec
        return group_limited_route(
            x,
            mlp.router,
            mlp.score_bias,
            top_k=s.num_experts_per_tok,
            num_groups=s.num_groups,
            topk_groups=s.topk_groups,
            normalize=s.norm_topk_prob,
            scaling=s.routed_scaling_factor,
        )

    def _mlp(self, i: int, h: torch.Tensor, *, graph_safe: bool = False) -> torch.Tensor:
        """Residual + MLP of layer i: h [N, H] -> [N, H]; `graph_safe`: no host sync whatever N (decode steps)."""
        s, w = self.spec, self.layers[i]
        mlp = w.mlp
        if isinstance(mlp, DenseMlpWeights):
            gate_up = self.ops.linear(h, mlp.gate_up, None, prologue="rmsnorm", norm_weight=w.ln2, eps=s.rms_norm_eps)
            return self.ops.linear(gate_up, mlp.down, None, residual=h, prologue="silu")
        x = self.ops.rms_norm(h, w.ln2, s.rms_norm_eps)  # [N, H]
        weights, ids = self._route(mlp, x)  # [N, k] each
        routed = experts_forward(
            x,
            ids,
            weights,
            mlp.experts,
            use_triton=self.ops.use_triton,
            config=self.expert_config,
            graph_safe=graph_safe,
        )  # [N, H]
        shared = self.ops.linear(x, mlp.shared.gate_up, None)  # [N, 2 I_shared]
        return self.ops.linear(shared, mlp.shared.down, None, residual=h + routed, prologue="silu")

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
        slots, seq_lens = self.ops.decode_slots(positions, block_tables, pool.page_size_tokens)  # [B] long, int32
        h = hidden
        start, end = layers or (0, self.num_layers)
        for i in range(start, end):
            w = self.layers[i]
            x = self.ops.rms_norm(h, w.ln1, s.rms_norm_eps)  # [B, H]
            kernels = self.kernels if self.use_attention_kernels else None
            if kernels is not None:  # one launch: q's rope, the latent's norm, both cache entries written
                q, kv = self._project_raw(i, x)  # [B, n, qk], [B, c + r]
                q_nope = q[..., : s.qk_nope_head_dim]  # [B, n, nope]
                q_rope = kernels.rope_norm_store(
                    q, kv, w.attn.kv_a_norm, self.cos, self.sin, positions, slots, pool.k[i], pool.v[i],
                    nope=s.qk_nope_head_dim, eps=s.latent_norm_eps, interleaved=s.rope_interleave,
                )  # fmt: skip
            else:
                q_nope, q_rope, latent, k_rope = self._project(i, x, positions)
                store_latent(latent, k_rope, slots, pool.k[i], pool.v[i])
            q_latent = torch.bmm(q_nope.transpose(0, 1), self._w_uk[i]).transpose(0, 1)  # [B, n, c]
            if kernels is not None:  # reads only each row's real tokens, whatever the table's width
                head_blocks = -(-s.num_heads // kernels.HEADS_PER_PROGRAM)
                out_latent = kernels.paged_latent_attention(
                    q_latent, q_rope, pool.k[i], pool.v[i], block_tables, seq_lens, s.softmax_scale,
                    self.ops.num_splits(b, head_blocks),
                )  # fmt: skip
            else:
                out_latent = paged_latent_attention(
                    q_latent, q_rope, pool.k[i], pool.v[i], block_tables, seq_lens, s.softmax_scale
                )  # [B, n, c]
            out = torch.bmm(out_latent.transpose(0, 1), self._w_uv_t[i]).transpose(0, 1)  # [B, n, v]
            h = self.ops.linear(out.reshape(b, s.num_heads * s.v_head_dim), w.attn.o, w.attn.o_bias, residual=h)
            h = self._mlp(i, h, graph_safe=True)
        return h

    def _prefill_layer(self, i: int, h: torch.Tensor, chunk: PrefillChunk, pool: KVPool, state: None) -> torch.Tensor:
        s, w = self.spec, self.layers[i]
        n, nope, c = s.num_heads, s.qk_nope_head_dim, s.kv_lora_rank
        t, total = h.shape[0], chunk.key_slots.shape[0]
        x = self.ops.rms_norm(h, w.ln1, s.rms_norm_eps)  # [T, H]
        q_nope, q_rope, latent, k_rope = self._project(i, x, chunk.positions)
        store_latent(latent, k_rope, chunk.slots, pool.k[i], pool.v[i])
        lat_all = pool.k[i].view(-1, c).index_select(0, chunk.key_slots)  # [L, c]
        rope_all = pool.v[i].view(-1, s.qk_rope_head_dim).index_select(0, chunk.key_slots)  # [L, r]
        kv = F.linear(lat_all, w.attn.kv_b).view(total, n, nope + s.v_head_dim)  # [L, n, nope + v]
        k = torch.cat((kv[..., :nope], rope_all[:, None].expand(total, n, s.qk_rope_head_dim)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)  # [T, n, qk]
        attn = causal_prefill_attention(
            q.transpose(0, 1)[None],  # [1, n, T, qk]
            k.transpose(0, 1)[None],  # [1, n, L, qk]
            kv[..., nope:].transpose(0, 1)[None],  # [1, n, L, v]
            scale=s.softmax_scale,
        )  # [1, n, T, v]
        attn = attn[0].transpose(0, 1).reshape(t, n * s.v_head_dim)  # [T, n v]
        h = self.ops.linear(attn, w.attn.o, w.attn.o_bias, residual=h)
        return self._mlp(i, h)


def _plain_weight(module: torch.nn.Module | None, name: str, *, allow_bias: bool = False) -> torch.Tensor:
    if type(module) is not torch.nn.Linear:
        raise ValueError(f"The DeepSeek-V3 fast path needs a plain linear {name}, not {type(module).__name__}")
    if module.bias is not None and not allow_bias:
        raise ValueError(f"The DeepSeek-V3 fast path implements {name} without a bias")
    return module.weight.data


def _attention(block: torch.nn.Module) -> LatentAttention:
    attn = block.get_submodule("attn")
    if not isinstance(attn, LatentAttention):
        raise ValueError(f"{type(block).__name__} has no latent attention")
    return attn


def _norm(module: RMSNorm | None) -> torch.Tensor:
    if module is None:
        raise ValueError("missing RMSNorm")
    return module.weight.data


def _layer_weights(block: DeepseekV3Block) -> MlaLayerWeights:
    """The tensors of one loaded `DeepseekV3Block` (no copies)."""
    attn = _attention(block)
    q_a: torch.Tensor | None
    q_a_bias: torch.Tensor | None
    q_a_norm: torch.Tensor | None
    if attn.q_a_proj is not None:
        q_a, q_a_bias = _plain_weight(attn.q_a_proj, "q_a_proj", allow_bias=True), linear_bias(attn.q_a_proj)
        q_a_norm, q_b = _norm(attn.q_a_layernorm), _plain_weight(attn.q_b_proj, "q_b_proj")
    else:
        q_a = q_a_bias = q_a_norm = None
        q_b = _plain_weight(attn.q_proj, "q_proj")
    attention = MlaAttentionWeights(
        q_a=q_a,
        q_a_bias=q_a_bias,
        q_a_norm=q_a_norm,
        q_b=q_b,
        kv_a=_plain_weight(attn.kv_a_proj_with_mqa, "kv_a_proj_with_mqa", allow_bias=True),
        kv_a_bias=linear_bias(attn.kv_a_proj_with_mqa),
        kv_a_norm=_norm(attn.kv_a_layernorm),
        kv_b=_plain_weight(attn.kv_b_proj, "kv_b_proj"),
        o=_plain_weight(attn.o_proj, "o_proj", allow_bias=True),
        o_bias=linear_bias(attn.o_proj),
    )
    mlp_module = block.mlp
    mlp: DenseMlpWeights | MoeWeights
    if isinstance(mlp_module, GroupLimitedMoE):
        shared = mlp_module.shared_experts
        mlp = MoeWeights(
            router=mlp_module.router.weight.data.float(),  # kept fp32 by the block: no copy
            score_bias=mlp_module.e_score_correction_bias.data.float(),
            experts=ExpertWeights.from_modules(list(mlp_module.experts)),
            shared=DenseMlpWeights(_plain_weight(shared.gate_up, "shared gate_up"), _plain_weight(shared.down, "down")),
        )
    elif isinstance(mlp_module, GatedMLP) and mlp_module.act_name in ("silu", "swish"):
        mlp = DenseMlpWeights(_plain_weight(mlp_module.gate_up, "gate_up"), _plain_weight(mlp_module.down, "down"))
    else:
        raise ValueError(f"The DeepSeek-V3 fast path needs a SwiGLU or group-limited MoE MLP, not {mlp_module}")
    return MlaLayerWeights(
        ln1=_norm(block.input_layernorm), attn=attention, ln2=_norm(block.post_attention_layernorm), mlp=mlp
    )
