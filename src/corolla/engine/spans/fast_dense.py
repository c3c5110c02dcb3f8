"""Falcon and BLOOM spans as plain tensors: LayerNorm (with bias), a fused q/k/v projection in our
`[q heads | k heads | v heads]` row order (the blocks reorder BLOOM's and Falcon's per-head layouts at load time),
rotary or ALiBi positions, a dense GELU MLP, biases where the checkpoint has them, and either parallel attention +
MLP (Falcon: one shared LayerNorm, or `ln_attn` + `ln_mlp` in the new decoder architecture) or sequential residuals
(BLOOM, with `apply_residual_connection_post_layernorm` either way; Falcon-RW). Multi-query and grouped-query
attention read the paged `KVPool` through the same ops as `fast_llama` (ALiBi: per-head slopes inside the paged
attention kernel); projections may be bitsandbytes NF4/Int8 layouts read in place. A parallel layer with one
LayerNorm and plain bias-free q/k/v and up projections (Falcon-7B) holds those two in one tensor, read by one GEMM
per decode step, and runs its attention branch on a side stream beside the MLP (docs/decisions/0088)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from corolla.engine.kernels.alibi import ALIBI_BF16, ALIBI_FALCON_BF16, ALIBI_FP16, ALIBI_FP32, Alibi
from corolla.engine.kernels.prefill_attention import causal_prefill_attention
from corolla.engine.kv.kv_pool import KVLayout, KVPool
from corolla.engine.ops.decode_ops import DecodeOps
from corolla.engine.ops.dense_ops import DenseOps
from corolla.engine.quant.quant_weights import Int8Weight, NF4Weight, linear_bias, quant_key
from corolla.engine.spans.fast_llama import Weight, projection_weight
from corolla.engine.spans.span_model import PrefillChunk, SpanModel, static_rotary, tensors_nbytes
from corolla.models.attention import Attention
from corolla.models.bloom.block import BloomBlock
from corolla.models.falcon.block import FalconBlock
from corolla.models.layers import DenseMLP
from corolla.models.lora import LoraLinear
from corolla.models.positions import alibi_slopes, rotary_cos_sin
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DENSE_MODEL_TYPES = ("falcon", "bloom")
# ALiBi prefill materializes a [heads, queries, keys] bias; queries are taken in blocks that keep it this small
ALIBI_PREFILL_MASK_ELEMENTS = 1 << 26
_GELU_APPROXIMATION = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}
_GELU_APPROXIMATION["bloom_gelu"] = "tanh"
# row counts at which cuBLASLt's GELU epilogue must be the tanh GELU before the decode step uses it
GELU_PROBE_ROWS = (1, 2, 3, 8, 16)


@dataclass(frozen=True)
class DenseSpec:
    """Shapes and structure of one Falcon or BLOOM decoder layer."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layer_norm_eps: float
    parallel_attn: bool  # attention and MLP read the layer's input (Falcon); else MLP after attention's residual
    residual_after_norm: bool  # BLOOM's apply_residual_connection_post_layernorm: the residual is the normed input
    gelu_approximate: str  # "none" (erf GELU) or "tanh"
    alibi: bool
    sliding_window_tokens: int | None = None  # both families attend to the whole context

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_layout(self) -> KVLayout:
        """K and V heads per token per layer (one K/V head for multi-query Falcon)."""
        return KVLayout.heads(self.num_kv_heads, self.head_dim)

    @classmethod
    def from_block(cls, block: torch.nn.Module) -> DenseSpec:
        """Reads a loaded `FalconBlock` or `BloomBlock`; ValueError for anything else."""
        attn, mlp = _parts(block)
        approximate = _GELU_APPROXIMATION.get(mlp.act_name)
        if approximate is None:
            raise ValueError(f"The fast path implements GELU MLPs for Falcon/BLOOM, not {mlp.act_name!r}")
        norm = _norms(block)[0]
        return cls(
            hidden_size=attn.hidden_size,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            intermediate_size=mlp.intermediate_size,
            layer_norm_eps=float(norm.eps),
            parallel_attn=isinstance(block, FalconBlock) and block.parallel,
            residual_after_norm=isinstance(block, BloomBlock) and block.residual_after_norm,
            gelu_approximate=approximate,
            alibi=bool(attn.alibi),
        )


@dataclass
class DenseLayerWeights:
    """One layer's tensors. `ln1` normalizes attention's input (and the MLP's in a parallel layer without `ln2`);
    `ln2` is the MLP's norm (sequential layers: after attention's residual; Falcon's new architecture: `ln_mlp`)."""

    ln1_w: torch.Tensor  # [H]
    ln1_b: torch.Tensor  # [H]
    ln2_w: torch.Tensor | None  # [H]
    ln2_b: torch.Tensor | None  # [H]
    w_qkv: Weight  # [(nq + 2 nkv) D, H]
    b_qkv: torch.Tensor | None
    w_o: Weight  # [H, nq D]
    b_o: torch.Tensor | None
    w_up: Weight  # [I, H]
    b_up: torch.Tensor | None
    w_down: Weight  # [H, I]
    b_down: torch.Tensor | None
    # a parallel layer with one LayerNorm and plain bias-free projections (Falcon-7B): w_qkv and w_up are the row
    # blocks of this tensor (views of it, `_share_rows`), so that a decode step reads both in one GEMM
    w_qkv_up: torch.Tensor | None = None  # [(nq + 2 nkv) D + I, H]

    def joined_rows(self) -> torch.Tensor | None:
        """w_qkv_up while w_qkv and w_up are still its blocks (a caller may have replaced one since), else None."""
        whole = self.w_qkv_up
        if whole is None:
            return None
        ptr = whole.untyped_storage().data_ptr()
        parts = (self.w_qkv, self.w_up)
        return (
            whole if all(isinstance(p, torch.Tensor) and p.untyped_storage().data_ptr() == ptr for p in parts) else None
        )

    def nbytes(self) -> int:
        """Bytes of this layer's weights (quantized ones as stored): what one batch-1 decode step reads."""
        return tensors_nbytes(v for k, v in vars(self).items() if k != "w_qkv_up")  # its blocks are counted


class FastDenseSpan(SpanModel):
    """Consecutive Falcon or BLOOM layers with a batched decode step and a prefill step over a `KVPool`."""

    spec: DenseSpec

    def __init__(
        self,
        spec: DenseSpec,
        layers: Sequence[DenseLayerWeights],
        *,
        max_positions: int,
        inv_freq: torch.Tensor | None = None,
        rotary_scale: float = 1.0,
        alibi: Alibi | None = None,
        use_triton: bool = True,
        attention_splits_max: int = 16,
    ):
        if not layers:
            raise ValueError("FastDenseSpan needs at least one layer")
        if spec.alibi != (alibi is not None) or (inv_freq is None) == (alibi is None):
            raise ValueError("A dense span takes ALiBi slopes or rotary frequencies, as its spec says")
        if not spec.parallel_attn and any(w.ln2_w is None for w in layers):
            raise ValueError("A sequential layer needs its post-attention LayerNorm")
        self.spec = spec
        self.layers = list(layers)
        self.device = layers[0].ln1_w.device
        self.dtype = layers[0].ln1_w.dtype
        self.max_positions = max_positions
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        self.alibi = alibi
        if inv_freq is not None:
            self.cos, self.sin = rotary_cos_sin(inv_freq, 0, max_positions, self.device, rotary_scale)  # [P, D/2] each
        else:  # never read (rope_and_store(rotate=False))
            self.cos = self.sin = torch.zeros((1, spec.head_dim // 2), dtype=torch.float32, device=self.device)
        self.ops = DecodeOps(
            self.device, spec.head_dim, use_triton=use_triton, attention_splits_max=attention_splits_max
        )
        self.dense = DenseOps(self.device, spec.head_dim, use_triton=use_triton)
        # parallel layers' attention branch runs on it in decode steps (`_parallel_decode`); None on CPU
        self.side_stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    def tune(self) -> dict:
        """Times cuBLAS against the fused Triton GEMVs for the bias-free dense projections (Falcon; a decode step's
        projections add no residual: `DenseOps.add_norm` does), picks the quantized kernels of NF4/Int8 projections,
        and takes cuBLASLt's bias + tanh GELU epilogue for the up projection where it runs (BLOOM; CUDA + Triton
        only; `DenseOps.choose_gelu_epilogue`)."""
        slots: dict[tuple[int, int, str, bool], list[tuple]] = {}
        quantized: dict[tuple[str, int, int], list] = {}
        for layer in self.layers:
            rows = layer.joined_rows()  # the decode step's one GEMM for w_qkv and w_up
            pairs: list[tuple[Weight, torch.Tensor | None]] = [(layer.w_o, layer.b_o), (layer.w_down, layer.b_down)]
            pairs += [(rows, None)] if rows is not None else [(layer.w_qkv, layer.b_qkv), (layer.w_up, layer.b_up)]
            for w, bias in pairs:
                if isinstance(w, NF4Weight | Int8Weight):
                    quantized.setdefault(quant_key(w), []).append(w)
                elif bias is None:
                    slots.setdefault((w.shape[0], w.shape[1], "none", False), []).append((w, None))
        report = self.ops.tune_linear(slots, 0.0)
        for key, r in report.items():
            logger.info(f"fast_dense.tune(slot={key}, best={r['best']}, us={r['best_us']:.1f})")
        quant_report = self.ops.tune_quantized(quantized, prologues={})  # LayerNorm/GELU spans: no RMSNorm/SiLU
        for key, r in quant_report.items():
            logger.info(f"fast_dense.tune_quantized(shape={key}, best={r['best']}, us={r['best_us']:.1f})")
        ups = [layer.w_up for layer in self.layers if isinstance(layer.w_up, torch.Tensor) and layer.b_up is not None]
        if self.dense.use_triton and self.spec.gelu_approximate == "tanh" and len(ups) == len(self.layers):
            epilogue = self.dense.choose_gelu_epilogue(ups[0], GELU_PROBE_ROWS)
            logger.info(f"fast_dense.gelu_epilogue({epilogue})")
        return {**report, **quant_report}

    # ------------------------------------------------------------------------------------------ construction

    @classmethod
    def from_blocks(cls, blocks: Sequence[torch.nn.Module], *, max_positions: int, **kwargs) -> FastDenseSpan:
        """Uses the tensors of loaded Falcon or BLOOM blocks in place, bitsandbytes NF4/Int8 linears in their packed
        form, a parallel layer's w_qkv and w_up moved into one tensor (`_share_rows`; ValueError for adapters,
        tensor-parallel splits, mixed blocks or other layer types)."""
        if not blocks:
            raise ValueError("from_blocks needs at least one block")
        spec = DenseSpec.from_block(blocks[0])
        for block in blocks:
            if DenseSpec.from_block(block) != spec:
                raise ValueError("A dense span's blocks must share one layer structure")
            if getattr(block, "adapter_names", None):
                raise ValueError("The fast path does not apply LoRA adapters")
        attn = _parts(blocks[0])[0]
        if attn.head_ids != list(range(attn.total_heads)):
            raise ValueError("The fast path serves whole layers, not tensor-parallel head splits")
        layers = [_layer_weights(block, _share_rows(block)) for block in blocks]  # refused blocks stay untouched
        if spec.alibi:
            falcon = isinstance(blocks[0], FalconBlock)
            if falcon != bool(attn.alibi_bf16_product):
                raise ValueError("Falcon's ALiBi is built in bfloat16 and BLOOM's in float32")
            slopes = alibi_slopes(attn.total_heads).to(layers[0].ln1_w.device)  # [nq] fp32
            dtype = layers[0].ln1_w.dtype
            if falcon:
                slopes, mode = slopes.bfloat16().float(), ALIBI_FALCON_BF16
            else:
                mode = {torch.bfloat16: ALIBI_BF16, torch.float16: ALIBI_FP16}.get(dtype, ALIBI_FP32)
            return cls(spec, layers, max_positions=max_positions, alibi=Alibi(slopes, attn.alibi_scale, mode), **kwargs)
        inv_freq, rotary_scale = static_rotary(attn.rotary, max_positions, layers[0].ln1_w.device)
        return cls(spec, layers, max_positions=max_positions, inv_freq=inv_freq, rotary_scale=rotary_scale, **kwargs)

    # ------------------------------------------------------------------------------------------ compute

    def _norm(self, x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        assert w is not None and b is not None  # checked in __init__ (sequential layers) or chosen by the caller
        return self.dense.layer_norm(x, w, b, self.spec.layer_norm_eps)

    def _mlp_act(self, w: DenseLayerWeights, x: torch.Tensor) -> torch.Tensor:
        # x [N, H] normed -> gelu(up(x)) [N, I]; bias and tanh GELU in the GEMM epilogue where tune() chose it
        if self.dense.gelu_epilogue and isinstance(w.w_up, torch.Tensor) and w.b_up is not None:
            return self.dense.up_gelu(x, w.w_up, w.b_up)
        return F.gelu(self.ops.linear(x, w.w_up, w.b_up), approximate=self.spec.gelu_approximate)  # [N, I]

    def _tail(
        self,
        w: DenseLayerWeights,
        h: torch.Tensor,
        x: torch.Tensor,
        attn: torch.Tensor,
        nxt: DenseLayerWeights | None,
        *,
        released: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # h [N, H] layer input, x [N, H] its ln1, attn [N, nq D] -> (the layer's output [N, H], its LayerNorm by the
        # next layer's ln1 (decode) or None (prefill, or the span's last layer)). Projections add no residual: each
        # residual add runs with the LayerNorm after it in one kernel, rounded as the blocks round (Falcon:
        # h + (mlp + attention)). `released`: the decode attention released w_o's GEMV at its start.
        s, eps = self.spec, self.spec.layer_norm_eps
        o = self.ops.linear(attn, w.w_o, w.b_o, released=released)  # [N, H]
        if s.parallel_attn:
            x_mlp = x if w.ln2_w is None else self._norm(h, w.ln2_w, w.ln2_b)
            d = self.ops.linear(self._mlp_act(w, x_mlp), w.w_down, w.b_down)  # [N, H]
            a, b, res = d, o, h
        else:
            assert w.ln2_w is not None and w.ln2_b is not None  # checked in __init__
            h, x2 = self.dense.add_norm(o, None, x if s.residual_after_norm else h, w.ln2_w, w.ln2_b, eps)
            d = self.ops.linear(self._mlp_act(w, x2), w.w_down, w.b_down)  # [N, H]
            a, b, res = d, None, x2 if s.residual_after_norm else h
        if nxt is None:
            return self.dense.add(a, b, res), None
        return self.dense.add_norm(a, b, res, nxt.ln1_w, nxt.ln1_b, eps)

    @torch.inference_mode()
    def decode(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        pool: KVPool,
        layers: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        slots, _ = self.ops.decode_slots(positions, block_tables, pool.page_size_tokens)  # [B] long
        h = hidden
        start, end = layers or (0, self.num_layers)
        x: torch.Tensor | None = self._norm(h, self.layers[start].ln1_w, self.layers[start].ln1_b)  # [B, H]
        for i in range(start, end):
            w = self.layers[i]
            assert x is not None  # each layer but the last returns the next layer's normed input
            nxt = self.layers[i + 1] if i + 1 < end else None
            rows = w.joined_rows()
            if rows is not None:
                h, x = self._parallel_decode(w, rows, h, x, i, positions, slots, block_tables, pool, nxt)
                continue
            qkv = self.ops.linear(x, w.w_qkv, w.b_qkv)  # [B, (nq+2nkv)D]
            attn, released = self._decode_attention(qkv, w, i, positions, slots, block_tables, pool)  # [B, nq D]
            h, x = self._tail(w, h, x, attn, nxt, released=released)
        return h

    def _decode_attention(
        self,
        qkv: torch.Tensor,
        w: DenseLayerWeights,
        i: int,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        pool: KVPool,
    ) -> tuple[torch.Tensor, bool]:
        # layer i's one-token attention: qkv [B, (nq + 2 nkv) D] -> RoPE (unless ALiBi) and the K/V store, then the
        # paged attention over each row's cached tokens -> ([B, nq D], whether it released w_o's GEMV (w) early:
        # where that takes a multiprocessor a program, DecodeOps.on_tile_gemv)
        s = self.spec
        q = self.ops.rope_and_store(
            qkv, self.cos, self.sin, positions, slots, pool.k[i], pool.v[i],
            s.num_heads, s.num_kv_heads, s.head_dim, rotate=not s.alibi,
        )  # fmt: skip  # [B, nq, D]
        release = self.ops.on_tile_gemv(w.w_o, qkv.shape[0])
        attn = self.ops.paged_decode_attention(
            q, pool.k[i], pool.v[i], block_tables, positions, self.scale, self.alibi, release=release
        )  # [B, nq, D]
        return attn.reshape(qkv.shape[0], s.q_size), release

    def _parallel_decode(
        self,
        w: DenseLayerWeights,
        w_qkv_up: torch.Tensor,
        h: torch.Tensor,
        x: torch.Tensor,
        i: int,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        pool: KVPool,
        nxt: DenseLayerWeights | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # one decode layer of a parallel layer over w_qkv_up: h [B, H] input, x [B, H] its LayerNorm -> (output
        # [B, H], its LayerNorm by nxt's ln1 or None), rounded as `_tail` rounds. On CUDA the attention branch (RoPE
        # + KV store, attention, w_o) runs on the span's side stream while the MLP branch (GELU, w_down) runs on the
        # caller's, so the attention's few programs and w_o's reads hide under w_down's (a fork and a join in a
        # captured graph). No reuse race: side-stream tensors go back to the side stream's pool, and the side
        # stream's next work waits for the caller's stream first.
        s = self.spec
        qkv_up = self.ops.linear(x, w_qkv_up, None)  # [B, (nq + 2 nkv) D + I]
        qkv, up = qkv_up.split([qkv_up.shape[1] - s.intermediate_size, s.intermediate_size], dim=1)
        side = self.side_stream
        main = torch.cuda.current_stream(self.device) if side is not None else None
        if side is not None and main is not None:
            side.wait_stream(main)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            attn, released = self._decode_attention(qkv, w, i, positions, slots, block_tables, pool)  # [B, nq D]
            o = self.ops.linear(attn, w.w_o, w.b_o, released=released)  # [B, H]
        d = self.ops.linear(F.gelu(up, approximate=s.gelu_approximate), w.w_down, w.b_down)  # [B, H]
        if side is not None and main is not None:
            main.wait_stream(side)
        if nxt is None:
            return self.dense.add(d, o, h), None
        return self.dense.add_norm(d, o, h, nxt.ln1_w, nxt.ln1_b, s.layer_norm_eps)

    def _chunk_state(self, chunk: PrefillChunk) -> torch.Tensor | None:
        # ALiBi's bias [nq, L] of the chunk's keys, or None
        return None if self.alibi is None else self.alibi.bias(chunk.key_positions).to(self.dtype)

    def _prefill_layer(
        self, i: int, h: torch.Tensor, chunk: PrefillChunk, pool: KVPool, bias: torch.Tensor | None
    ) -> torch.Tensor:
        s, w = self.spec, self.layers[i]
        x = self._norm(h, w.ln1_w, w.ln1_b)  # [T, H]
        qkv = self.ops.linear(x, w.w_qkv, w.b_qkv)  # [T, (nq+2nkv)D]
        q = self.ops.rope_and_store(
            qkv, self.cos, self.sin, chunk.positions, chunk.slots, pool.k[i], pool.v[i],
            s.num_heads, s.num_kv_heads, s.head_dim, rotate=not s.alibi,
        )  # fmt: skip  # [T, nq, D]
        k = pool.k[i].view(-1, s.num_kv_heads, s.head_dim).index_select(0, chunk.key_slots).transpose(0, 1)[None]
        v = pool.v[i].view(-1, s.num_kv_heads, s.head_dim).index_select(0, chunk.key_slots).transpose(0, 1)[None]
        attn = self._prefill_attention(q.transpose(0, 1)[None], k, v, chunk.positions, chunk.key_positions, bias)
        return self._tail(w, h, x, attn[0].transpose(0, 1).reshape(h.shape[0], s.q_size), None)[0]  # [T, H]

    def _prefill_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        all_pos: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        # q [1, nq, T, D] at `positions` [T], k/v [1, nkv, L, D] at all_pos [L]; bias [nq, L] (ALiBi) -> [1, nq, T, D]
        gqa = self.spec.num_kv_heads != self.spec.num_heads
        t, total = q.shape[2], k.shape[2]
        if bias is None:
            return causal_prefill_attention(q, k, v, scale=self.scale, enable_gqa=gqa)
        rows = max(1, ALIBI_PREFILL_MASK_ELEMENTS // (self.spec.num_heads * total))  # query rows per block
        outs = []
        for r0 in range(0, t, rows):
            allowed = all_pos[None, :] <= positions[r0 : r0 + rows, None]  # [t', L]
            mask = bias[:, None, :].masked_fill(~allowed[None], float("-inf"))  # [nq, t', L]
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, r0 : r0 + rows], k, v, attn_mask=mask[None], scale=self.scale, enable_gqa=gqa
                )
            )  # [1, nq, t', D]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _parts(block: torch.nn.Module) -> tuple[Attention, DenseMLP]:
    """A Falcon or BLOOM block's attention and MLP modules (ValueError for any other block)."""
    attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
    if not isinstance(block, FalconBlock | BloomBlock) or not isinstance(attn, Attention):
        raise ValueError(f"{type(block).__name__} is not a Falcon or BLOOM block")
    if not isinstance(mlp, DenseMLP):
        raise ValueError(f"{type(block).__name__}.mlp is not a dense MLP")
    return attn, mlp


def _norms(block: torch.nn.Module) -> tuple[torch.nn.LayerNorm, torch.nn.LayerNorm | None]:
    """(attention's LayerNorm, the MLP's own LayerNorm or None when a parallel layer shares the first)."""
    ln1: object
    ln2: object
    if isinstance(block, FalconBlock) and block.new_arch and block.num_ln == 2:
        ln1, ln2 = block.ln_attn, block.ln_mlp
    elif isinstance(block, FalconBlock) and block.parallel:
        ln1, ln2 = block.input_layernorm, None
    else:
        ln1, ln2 = block.input_layernorm, block.post_attention_layernorm
    if not isinstance(ln1, torch.nn.LayerNorm) or not isinstance(ln2, torch.nn.LayerNorm | None):
        raise ValueError(f"{type(block).__name__} norms are not LayerNorms")
    return ln1, ln2


def _plain_linear(module: torch.nn.Module) -> torch.nn.Linear | None:
    """The plain `nn.Linear` of a projection (under a `LoraLinear`, its base layer), None for other layers."""
    if isinstance(module, LoraLinear):
        module = module.base
    return module if type(module) is torch.nn.Linear else None


def _share_rows(block: torch.nn.Module) -> torch.Tensor | None:
    """For a parallel layer with one shared LayerNorm and plain bias-free projections (Falcon-7B): moves w_qkv and
    w_up into the row blocks of one [(nq + 2 nkv) D + I, H] tensor, the block's two parameters becoming views of it
    (the same values, no second copy kept: the block's own forward reads the views), and returns it; a block moved
    so before (a span built earlier on it) keeps its tensor. None for any other layer."""
    if not (isinstance(block, FalconBlock) and block.parallel and _norms(block)[1] is None):
        return None
    attn, mlp = _parts(block)
    qkv, up = _plain_linear(attn.qkv), _plain_linear(mlp.up)
    if qkv is None or up is None or qkv.bias is not None or up.bias is not None:
        return None
    a, b = qkv.weight.data, up.weight.data  # [nqkv, H], [I, H]
    rows = a.shape[0] + b.shape[0]
    if (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.is_contiguous()
        and b.is_contiguous()
        and a.storage_offset() == 0
        and b.storage_offset() == a.numel()
        and a.untyped_storage().nbytes() == rows * a.shape[1] * a.element_size()
    ):
        return a.as_strided((rows, a.shape[1]), (a.shape[1], 1), 0)
    with torch.no_grad():
        joined = torch.cat([a, b], dim=0)  # [(nq + 2 nkv) D + I, H]
        qkv.weight.data, up.weight.data = joined[: a.shape[0]], joined[a.shape[0] :]
    return joined


def _layer_weights(block: torch.nn.Module, w_qkv_up: torch.Tensor | None) -> DenseLayerWeights:
    """The tensors of one loaded block, used in place (quantized linears in their packed form); `w_qkv_up`: its
    joined w_qkv and w_up (`_share_rows`) or None."""
    ln1, ln2 = _norms(block)
    attn, mlp = _parts(block)
    dtype = ln1.weight.dtype
    return DenseLayerWeights(
        ln1_w=ln1.weight.data,
        ln1_b=ln1.bias.data,
        ln2_w=None if ln2 is None else ln2.weight.data,
        ln2_b=None if ln2 is None else ln2.bias.data,
        w_qkv=projection_weight(attn.qkv, dtype),
        b_qkv=linear_bias(attn.qkv),
        w_o=projection_weight(attn.o_proj, dtype),
        b_o=linear_bias(attn.o_proj),
        w_up=projection_weight(mlp.up, dtype),
        b_up=linear_bias(mlp.up),
        w_down=projection_weight(mlp.down, dtype),
        b_down=linear_bias(mlp.down),
        w_qkv_up=w_qkv_up,
    )
