"""The decode step's non-matmul operations, each with a plain PyTorch version (CPU, reference, fallback) and a
Triton kernel on CUDA. All are CUDA-graph safe: static shapes, no host synchronization."""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F

from corolla.engine.kernels import cpu_linear
from corolla.engine.kernels.alibi import Alibi
from corolla.engine.kernels.graph_timing import graph_median_ms
from corolla.engine.kernels.kernel_choices import KernelChoices
from corolla.engine.kernels.mla_kernels import rope_rotate
from corolla.engine.kernels.qk_norm import qk_norm_ref, qk_norm_triton
from corolla.engine.quant.quant_weights import Int8Weight, NF4Weight, quant_key
from corolla.utils.logging import get_logger

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs use the reference versions.
    from corolla.engine.kernels import triton_kernels
    from corolla.engine.quant import quant_choices, quant_gemv, quant_kernels, quant_tile_gemv
    from corolla.engine.quant.prologues import PROLOGUES
    from corolla.engine.quant.quant_choices import quant_kernel

    TRITON_IMPORTED = True
except ImportError:  # pragma: no cover - depends on the installation
    TRITON_IMPORTED = False  # the kernel modules stay unbound: only `use_triton` paths name them

logger = get_logger(__name__)

# the decode attention's splits per (row, kv head) for groups of more than LARGE_GROUP query heads on a kv head: on an
# H200 at Falcon-7B's 71 on 1 (D 64), 8 splits took 11.9 / 15.6 us at 513 / 2049 tokens against 16.2 / 18.4 for 16
LARGE_GROUP, LARGE_GROUP_SPLITS = 16, 8
# The decode attention's splits by the rows' pages (`attention_splits`; decision 0262, H100 sweeps of 1-64 rows of
# 128-8,192 tokens): rows of REFERENCE_TOKENS make about REFERENCE_PROGRAMS_PER_SM programs a multiprocessor, a longer
# row takes more splits, up to LONG_ROW_SPLITS where that keeps the grid within LONG_ROW_PROGRAMS (one long row beside
# many short ones is not the forward's tail: 63 x 512 + one 16,384-token row 455 -> 100 us a layer), and a row of at
# most SHORT_ROW_TOKENS is not split (its combine costs more than its pages: one row of 128 tokens 6.8 -> 4.7 us)
REFERENCE_TOKENS, REFERENCE_PROGRAMS_PER_SM, SHORT_ROW_TOKENS = 512, 4, 192
LONG_ROW_SPLITS, LONG_ROW_PROGRAMS = 8, 4096


def triton_usable(device: torch.device, head_dim: int) -> bool:
    """Whether the Triton kernels can run for this device and head size."""
    return TRITON_IMPORTED and device.type == "cuda" and head_dim >= 16 and head_dim & (head_dim - 1) == 0


# ---------------------------------------------------------------------------------------------- reference versions


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x [N, H], weight [H] -> [N, H]; statistics in float32 as in the reference layer
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * y.to(x.dtype)).to(x.dtype)


def decode_slots_ref(
    positions: torch.Tensor, block_tables: torch.Tensor, page: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B] long, block_tables [B, maxp] int32 -> (flat KV slot of each row's position [B] long, sequence
    lengths positions + 1 [B] int32)."""
    pages = block_tables.gather(1, (positions // page)[:, None]).squeeze(1).long()  # [B]
    return pages * page + positions % page, (positions + 1).to(torch.int32)


def rope_and_store_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    rotate: bool = True,
) -> torch.Tensor:
    """qkv [N, (nq + 2 nkv) * D]; cos/sin tables [P, D/2] float32; positions, slots [N] long;
    caches [pages, page, nkv, D]. Writes rotated keys and values at `slots`; returns rotated queries [N, nq, D].
    `rotate=False` (ALiBi spans) stores and returns them as projected."""
    n = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = q.reshape(n, num_heads, head_dim), k.reshape(n, num_kv_heads, head_dim)
    if rotate:  # Llama's rotate-half convention, in float32
        c, s = cos[positions], sin[positions]  # [N, D/2]
        q, k = rope_rotate(q, c, s, interleaved=False), rope_rotate(k, c, s, interleaved=False)
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [pages * page, nkv, D]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, slots, k)
    v_flat.index_copy_(0, slots, v.reshape(n, num_kv_heads, head_dim))
    return q


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    alibi: Alibi | None = None,
) -> torch.Tensor:
    """q [B, nq, D]; caches [pages, page, nkv, D]; block_tables [B, maxp] int32; seq_lens [B] int32 (>= 1).
    Each row attends to its own first `seq_lens[b]` tokens (plus `alibi`'s bias). Returns [B, nq, D]."""
    b, nq, d = q.shape
    nkv = k_cache.shape[2]
    tables = block_tables.long()
    k = k_cache[tables].reshape(b, -1, nkv, d)  # [B, maxp * page, nkv, D]
    v = v_cache[tables].reshape(b, -1, nkv, d)
    key_pos = torch.arange(k.shape[1], device=q.device)  # [L]
    valid = key_pos[None, :] < seq_lens[:, None].long()  # [B, L]
    k = k.masked_fill(~valid[:, :, None, None], 0.0)  # what lies past a row's tokens never reaches the output
    v = v.masked_fill(~valid[:, :, None, None], 0.0)
    group = nq // nkv
    k = k.repeat_interleave(group, dim=2).float()  # [B, L, nq, D]
    v = v.repeat_interleave(group, dim=2).float()
    scores = torch.einsum("bhd,blhd->bhl", q.float(), k) * scale  # [B, nq, L]
    if alibi is not None:
        scores = scores + alibi.bias(key_pos)[None]  # [B, nq, L]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("bhl,blhd->bhd", probs, v).to(q.dtype)


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    alibi: Alibi | None = None,
) -> torch.Tensor:
    """`paged_decode_attention_ref` for CPU tensors (the engine's eager path where no Triton kernel runs). The
    reference gathers every row's whole block table and attends in float32 einsums: on a CPU server its cost grows
    with rows x table length. Here consecutive rows with one block table (one sequence's positions: a shadow's or a
    speculative step's T rows) gather their pages once and attend as T queries of one sequence, and sequences are
    batched by their query count and their longest row's pages rounded up to a power of two (`cpu_attention_batches`),
    so a row gathers no more than twice its own pages: gathering every row's pages up to the longest row of the step
    cost a replica serving 48 shadow rows beside 64 real ones 3.3x the step (decision 0235). Each batch attends in one
    call of torch's fused CPU attention; positions past a row's length are masked, and what a sequence's pages hold
    past its longest row is zeroed first, so that a recycled page's garbage (even NaN) can't reach the output. Equals
    the reference within float rounding (`tests/unit/test_engine_cpu_attention.py`)."""
    b, nq, d = q.shape
    if b == 0:
        return torch.empty_like(q)
    out: torch.Tensor | None = None  # (several batches: their rows scattered into it)
    page, nkv = k_cache.shape[1], k_cache.shape[2]
    lengths = seq_lens.tolist()  # on the CPU: no device sync
    for first_rows, rows, pages in cpu_attention_batches(block_tables, lengths, page):
        u, t = len(first_rows), rows
        whole = u * t == b  # one batch of every row, in order: no gather of the queries, no scatter of the outputs
        if whole:  # (sequences of T rows each, in row order)
            row_ids, tables = None, block_tables[::t, :pages].long()  # [U, pages]
        else:
            starts = torch.tensor(first_rows)
            row_ids = (starts[:, None] + torch.arange(t)[None, :]).reshape(-1)  # [U x T] rows of q, sequence-major
            tables = block_tables[starts, :pages].long()
        k_all = k_cache[tables].view(u, -1, nkv, d)  # [U, L, nkv, D]
        v_all = v_cache[tables].view(u, -1, nkv, d)
        longest = max(lengths[r] for r in first_rows) if t == 1 else 0
        if t == 1 and all(lengths[r] == longest for r in first_rows):  # rows as long as each other: nothing to mask
            keys = torch.arange(longest)
            k_all, v_all, mask = k_all[:, :longest], v_all[:, :longest], None
        else:
            lens = (seq_lens if whole else seq_lens[row_ids]).long().view(u, t)  # [U, T]
            keys = torch.arange(k_all.shape[1])  # [L]
            past = (keys[None, :] >= lens.max(dim=1).values[:, None])[:, :, None, None]  # [U, L, 1, 1]
            k_all.masked_fill_(past, 0.0)  # fresh copies: garbage past a sequence's rows (NaN in a recycled page)
            v_all.masked_fill_(past, 0.0)  # must not reach a score (masking adds -inf to it) nor the weighted sum
            mask = (keys[None, None, :] < lens[:, :, None])[:, None, :, :]  # [U, 1, T, L]
        if alibi is not None:
            bias = alibi.bias(keys)[None, :, None, :]  # [1, nq, 1, L] fp32
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))  # [U, nq, T, L]
        qf = (q if whole else q[row_ids]).float().view(u, t, nq, d).transpose(1, 2)  # [U, nq, T, D] float32
        # (as the reference; no copy for a float32 engine)
        o = F.scaled_dot_product_attention(
            qf, k_all.float().transpose(1, 2), v_all.float().transpose(1, 2), attn_mask=mask, scale=scale,
            enable_gqa=nq != nkv,
        )  # [U, nq, T, D]  # fmt: skip
        o = (o[:, :, 0] if t == 1 else o.transpose(1, 2).reshape(u * t, nq, d)).to(q.dtype)  # [U x T, nq, D]
        if whole:
            return o
        if out is None:
            out = torch.empty_like(q)
        out[row_ids] = o
    assert out is not None  # (every row is in one batch)
    return out


def cpu_attention_batches(
    block_tables: torch.Tensor, lengths: list[int], page: int
) -> list[tuple[list[int], int, int]]:
    """The rows of a CPU decode attention as batches of sequences: (first rows, rows per sequence T, pages gathered).
    A sequence is a run of consecutive rows with the same block table over the pages its longest row uses (rows of
    one step's positions; two tables equal over those pages attend to the same keys, whichever sessions they are);
    a batch holds sequences of T rows whose longest row needs more than half of the batch's pages (a power of two)."""
    b = len(lengths)
    used = [-(-n // page) for n in lengths]  # pages each row reads
    most = max(used)
    same = [False] * b
    if b > 1:
        # [B - 1]: row i's table equals row i - 1's over the pages the longest row of the step reads (a superset of
        # what either reads: tables equal there are equal where it matters)
        tables = block_tables[:, :most].numpy()  # (numpy: a fraction of torch's per-call cost on small tables)
        same = [False, *(tables[1:] == tables[:-1]).all(axis=1).tolist()]
    sequences: list[tuple[int, int, int]] = []  # (first row, rows, pages of its longest row)
    for row in range(b):
        if same[row] and sequences:
            first, rows, pages = sequences[-1]
            sequences[-1] = (first, rows + 1, max(pages, used[row]))
        else:
            sequences.append((row, 1, used[row]))
    batches: dict[tuple[int, int], list[int]] = {}
    for first, rows, pages in sequences:
        batches.setdefault((rows, 1 << (pages - 1).bit_length()), []).append(first)
    return [(firsts, rows, min(pages, most)) for (rows, pages), firsts in batches.items()]


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up [N, 2I] -> [N, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------------------------------------- dispatch


class DecodeOps:
    """Picks Triton kernels or reference versions once, for a device and head size."""

    def __init__(self, device: torch.device, head_dim: int, *, use_triton: bool, attention_splits_max: int = 16):
        self.use_triton = use_triton and triton_usable(device, head_dim)
        self.attention_splits_max = attention_splits_max
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        # (N, K, prologue, has_residual) -> Triton skinny-GEMM config for single-row inputs (absent: the prologue as
        # its own kernel, then cuBLAS); filled by tune_linear
        self.single_row_gemm: dict[tuple[int, int, str, bool], tuple[int, int, int, int]] = {}
        # (kind, N, K) -> (kernel, config) of quant_choices.quant_kernel for decode steps of up to GEMV_MAX_ROWS rows
        # (quant_small: "gemv", "tile", "i8mma" or "block"; one row only where quant_mid has the shape), of 2 to
        # quant_choices.MID_MAX_ROWS rows (quant_mid: NF4's "mma" / "mmaf" with 16-row tiles, INT8's "block" where
        # "i8mma" serves one row) and for larger merged steps (quant_gemm: INT8's "block", NF4's "mmaf" with 64-row
        # tiles: quant_choices.mma_candidates); filled by tune_quantized
        self.quant_small: dict[tuple[str, int, int], tuple[str, tuple[int, int, int, int, int]]] = {}
        self.quant_mid: dict[tuple[str, int, int], tuple[str, tuple[int, int, int, int, int]]] = {}
        self.quant_gemm: dict[tuple[str, int, int], tuple[str, tuple[int, int, int, int, int]]] = {}
        # (kind, N, K, prologue) -> the quant_small kernel that runs the prologue itself, where the tuner timed it
        # faster than the norm/SiLU kernel + quant_small's choice (absent: that pair); prologue "gated" (w_gate_up):
        # the INT8 row GEMV that runs the RMSNorm and gates its own output (gate_up), where it beat that + silu_mul
        self.quant_fused: dict[tuple[str, int, int, str], tuple[str, tuple[int, int, int, int, int]]] = {}
        # CPU: the formulation of each projection per row bucket (engine.kernels.cpu_linear); None: F.linear / addmm
        self.cpu_linear: cpu_linear.CpuLinearChoices | None = None
        # the tuners' choices kept on disk (SpanEngine.warmup sets it from EngineConfig.kernel_choices_dir); None:
        # every tune times every candidate
        self.kernel_choices: KernelChoices | None = None

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | NF4Weight | Int8Weight,
        bias: torch.Tensor | None,
        *,
        residual: torch.Tensor | None = None,
        prologue: str = "none",
        norm_weight: torch.Tensor | None = None,
        eps: float = 0.0,
        released: bool = False,
    ) -> torch.Tensor:
        """residual + f(x) @ weight^T + bias, with f = identity, "rmsnorm" (weight `norm_weight`) or "silu"
        (x = [gate | up]); x [M, K or 2K], weight [N, K] -> [M, N]. Single rows may run as one fused Triton kernel.
        A quantized weight (NF4/Int8) runs its dequantize-GEMM kernel for decode-sized inputs. `released`: the
        attention ahead released this GEMV at its start (`paged_decode_attention(release=True)`, where
        `on_tile_gemv`): the tile GEMV then leaves it room (`nf4_tile_gemv(released=True)`)."""
        if isinstance(weight, NF4Weight | Int8Weight):
            return self._quantized(x, weight, bias, residual, prologue, norm_weight, eps, released)
        if x.shape[0] == 1 and bias is None:
            key = (weight.shape[0], weight.shape[1], prologue, residual is not None)
            config = self.single_row_gemm.get(key)
            if config is not None:
                return self._fused(x, weight, residual, prologue, norm_weight, eps, config)
        return self._unfused(x, weight, bias, residual, prologue, norm_weight, eps)

    def gate_up(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | NF4Weight | Int8Weight,
        bias: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, str]:
        """A gated MLP's first projection of RMSNorm(x) [M, H]: (silu(gate) * up [M, I], "none") where the tuner
        chose a quantized kernel that gates its own output for these rows (quant_fused's "gated"), else
        ([gate | up] [M, 2I], "silu"): the prologue the down projection still owes it."""
        if self.use_triton and bias is None and isinstance(weight, Int8Weight | NF4Weight):
            key, rows = quant_key(weight), x.shape[0]
            gated = self.quant_fused.get((*key, "gated"))
            if gated is not None and rows <= quant_gemv.GEMV_MAX_ROWS and self._quant_choice(key, rows) is None:
                kernel = quant_kernel(*gated, PROLOGUES["rmsnorm"], gated=True)
                return kernel(x.contiguous(), weight, None, norm_weight, eps), "none"  # [M, I]
        return self.linear(x, weight, bias, prologue="rmsnorm", norm_weight=norm_weight, eps=eps), "silu"

    def on_tile_gemv(self, weight: torch.Tensor | NF4Weight | Int8Weight, rows: int) -> bool:
        """Whether `linear` (no prologue) runs `rows` rows of `weight` on the NF4 tile GEMV, whose programs each take
        a multiprocessor: the attention ahead of it releases it at the attention's start, so that its programs enter
        and build their tables where the attention's leave room (docs/decisions/0275). Released so into smaller
        programs (the INT8 row GEMV), every later kernel of the step, each releasing the next at its start, launched
        early and crowded the card: INT8 on an H200 2.945 ms a step against 2.359 without (docs/decisions/0288)."""
        if not self.use_triton or not isinstance(weight, NF4Weight):
            return False
        key = quant_key(weight)
        if rows > quant_gemv.GEMV_MAX_ROWS or self._quant_choice(key, rows) is not None:
            return False
        return self._small_rows_kernel(key)[0] == "tile"

    def _small_rows_kernel(self, key) -> tuple[str, tuple[int, int, int, int, int]]:
        """The (kernel, config) serving up to GEMV_MAX_ROWS rows of shape `key` outside quant_mid's range: the
        tuner's, else NF4 on the table GEMV, INT8 on the block kernel."""
        untuned = quant_gemv.DEFAULT_NF4_CONFIG if key[0] == "nf4" else quant_kernels.DEFAULT_CONFIG
        return self.quant_small.get(key, ("gemv" if key[0] == "nf4" else "block", untuned))

    def _fused(self, x, weight, residual, prologue, norm_weight, eps, config):
        code = {"none": 0, "rmsnorm": 1, "silu": 2}[prologue]
        if config[0] == "splitk":
            return triton_kernels.splitk_gemv(
                x, weight, residual, config, prologue=code, norm_weight=norm_weight, eps=eps
            )
        return triton_kernels.skinny_gemm(x, weight, residual, config, prologue=code, norm_weight=norm_weight, eps=eps)

    def _quant_choice(self, key, rows: int) -> tuple[str, tuple[int, int, int, int, int]] | None:
        """The tuned (kernel, config) serving `rows` rows of shape `key` where quant_mid has it (NF4: 2 to
        MID_MAX_ROWS rows), else None (quant_small / quant_gemm by GEMV_MAX_ROWS)."""
        if 2 <= rows <= quant_choices.MID_MAX_ROWS:
            return self.quant_mid.get(key)
        return None

    def _quantized(self, x, weight, bias, residual, prologue, norm_weight, eps, released=False):
        key, rows = quant_key(weight), x.shape[0]
        mid = self._quant_choice(key, rows) if self.use_triton else None
        fused = None  # the tuner's fused kernel for this prologue (quant_small's rows only), if it beat the pair
        if self.use_triton and prologue != "none" and rows <= quant_gemv.GEMV_MAX_ROWS and mid is None:
            fused = self.quant_fused.get((*key, prologue))
        stream = self.quant_small.get(key) if self.use_triton and rows == 1 and mid is None else None
        one_row = stream is not None and stream[0] == "tile"
        if fused is None and prologue != "none" and bias is None and stream is not None and one_row:
            # NF4 tile GEMV after a norm / SiLU kernel (bf16): that kernel writes x already converted as the
            # GEMV would convert it (fp16, times X_SCALE), so that no GEMV program converts x again
            if weight.dtype == torch.bfloat16:
                scale = quant_tile_gemv.X_SCALE
                x = self.rms_norm(x, norm_weight, eps, scale) if prologue == "rmsnorm" else self.silu_mul(x, scale)
                return quant_tile_gemv.nf4_tile_gemv(x, weight, residual, stream[1], prescaled=True)
        if fused is None and prologue == "rmsnorm":
            x = self.rms_norm(x, norm_weight, eps)
        elif fused is None and prologue == "silu":
            x = self.silu_mul(x)
        if self.use_triton and rows <= quant_kernels.QUANT_KERNEL_MAX_ROWS:
            res = None if bias is not None else residual
            if fused is not None:
                out = quant_kernel(*fused, PROLOGUES[prologue])(x.contiguous(), weight, res, norm_weight, eps)
            elif mid is not None:
                out = quant_kernel(*mid)(x.contiguous(), weight, res)
            else:
                if rows <= quant_gemv.GEMV_MAX_ROWS:
                    kernel, config = self._small_rows_kernel(key)
                else:
                    kernel, config = self.quant_gemm.get(key, ("block", quant_kernels.DEFAULT_CONFIG))
                out = quant_kernel(kernel, config, released=released)(x.contiguous(), weight, res)
            if bias is None:
                return out
            out = out + bias
            return out if residual is None else out + residual
        # prefill-sized inputs (or no Triton): dequantize once, then one dense GEMM
        dense = (
            quant_kernels.nf4_dequantize(weight)
            if self.use_triton and isinstance(weight, NF4Weight)
            else weight.dequantize()
        )  # [N, K]
        return self._unfused(x, dense, bias, residual, "none", None, eps)

    @torch.inference_mode()
    def tune_quantized(
        self, weights: dict[tuple[str, int, int], list], *, reps: int = 7, prologues: dict | None = None
    ) -> dict:
        """Times the quantized kernels of each shape (kind, N, K) -> [weight per layer] and keeps the fastest per
        row range and prologue (quant_choices.tune_quantized); {} without Triton."""
        if not self.use_triton:
            return {}
        return quant_choices.tune_quantized(self, weights, reps=reps, prologues=prologues)

    def qk_norm(self, qkv, q_weight, k_weight, num_heads: int, num_kv_heads: int, eps: float) -> torch.Tensor:
        if self.use_triton:
            return qk_norm_triton(qkv, q_weight, k_weight, num_heads, num_kv_heads, eps)
        return qk_norm_ref(qkv, q_weight, k_weight, num_heads, num_kv_heads, eps)

    def _unfused(self, x, weight, bias, residual, prologue, norm_weight, eps):
        if prologue == "rmsnorm":
            x = self.rms_norm(x, norm_weight, eps)
        elif prologue == "silu":
            x = self.silu_mul(x)
        if self.cpu_linear is not None and x.is_cpu:
            kernel = self.cpu_linear.kernel(
                x.shape[0], weight.shape[0], weight.shape[1], bias is not None, residual is not None
            )
            if kernel is not None:
                return kernel(x, weight, bias, residual)  # [M, N]
        if residual is None:
            return F.linear(x, weight, bias)
        out = torch.addmm(residual, x, weight.t())  # the residual rides in the GEMM epilogue
        return out if bias is None else out + bias

    @torch.inference_mode()
    def tune_linear(self, slots: dict[tuple[int, int, str, bool], list[tuple]], eps: float, *, reps: int = 7) -> dict:
        """For each single-row projection slot `(N, K, prologue, has_residual)` -> [(weight, norm_weight), ...]
        (one per layer), times the unfused path (prologue kernel + cuBLAS) against every Triton config, each as a
        CUDA graph over all layers' weights (distinct weights: no L2 flattery, no launch gaps), and keeps the
        fastest. Returns {slot: {"unfused_us", "best", "best_us", "all_us"}} per layer call."""
        if not self.use_triton:
            return {}
        report = {}
        for key, items in slots.items():
            n, k, prologue, has_res = key
            dev, dt = items[0][0].device, items[0][0].dtype
            candidates = (None, *triton_kernels.SKINNY_GEMM_CONFIGS, *triton_kernels.SPLITK_CONFIGS)
            digest = zlib.crc32(repr(candidates).encode())  # a changed candidate list tunes again
            problem = f"linear {n}x{k} {dt} prologue={prologue} residual={has_res} {digest:08x}"
            cached = self.kernel_choices.get(problem) if self.kernel_choices is not None else None
            if cached is not None:
                self.single_row_gemm.pop(key, None)
                if cached["best"] is not None:
                    self.single_row_gemm[key] = cached["best"]
                report[key] = {**cached, "cached": True}
                continue
            x = torch.randn(1, 2 * k if prologue == "silu" else k, device=dev, dtype=dt)
            res = torch.randn(1, n, device=dev, dtype=dt) if has_res else None

            def run(config, items=items, x=x, res=res, prologue=prologue):
                for w, nw in items:
                    if config is None:
                        self._unfused(x, w, None, res, prologue, nw, eps)
                    else:
                        self._fused(x, w, res, prologue, nw, eps, config)

            timings = {}
            for config in candidates:
                try:
                    timings[config] = graph_median_ms(lambda c=config: run(c), reps)
                except Exception:  # a config that does not compile or fit is skipped
                    continue
            best = min(timings, key=timings.__getitem__)
            if best is not None:
                self.single_row_gemm[key] = best
            per_call = 1000 / len(items)
            report[key] = {
                "unfused_us": timings[None] * per_call,
                "best": best,
                "best_us": timings[best] * per_call,
                "all_us": {str(c): t * per_call for c, t in timings.items()},
            }
            if self.kernel_choices is not None:
                self.kernel_choices.put(problem, {f: report[key][f] for f in ("unfused_us", "best", "best_us")})
        return report

    def tune_cpu_linear(
        self,
        slots: dict[cpu_linear.SlotKey, list[tuple[torch.Tensor, torch.Tensor | None]]],
        config: cpu_linear.CpuLinearConfig,
    ) -> dict:
        """CPU only: for each float32/16-bit projection shape `(N, K, has_bias, has_residual)` -> [(weight, bias)
        per layer], times `config.candidates` per row bucket on the real weights and keeps the fastest
        (`engine.kernels.cpu_linear.tune`); later `linear` calls on CPU inputs of a tuned bucket run it. Returns
        {(slot, bucket): {"best", "all_ms"}}."""
        if not slots:
            return {}
        self.cpu_linear, report = cpu_linear.tune(slots, config)
        return report

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, f16_scale: float | None = None
    ) -> torch.Tensor:
        """x [N, H] -> [N, H] in x's dtype; with `f16_scale` (Triton only): times it, in fp16
        (`triton_kernels.rms_norm`)."""
        if self.use_triton:
            return triton_kernels.rms_norm(x, weight, eps, f16_scale)
        if f16_scale is not None:
            raise ValueError("a scaled fp16 RMSNorm output needs the Triton kernel")
        return rms_norm_ref(x, weight, eps)

    def decode_slots(
        self, positions: torch.Tensor, block_tables: torch.Tensor, page: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [B] long, seq_lens [B] int32) of a decode step's rows, one kernel on CUDA."""
        if self.use_triton and block_tables.stride(1) == 1:
            return triton_kernels.decode_slots(positions, block_tables, page)
        return decode_slots_ref(positions, block_tables, page)

    def rope_and_store(
        self, qkv, cos, sin, positions, slots, k_cache, v_cache, num_heads, num_kv_heads, head_dim, *, rotate=True
    ):
        fn = triton_kernels.rope_and_store if self.use_triton else rope_and_store_ref
        return fn(qkv, cos, sin, positions, slots, k_cache, v_cache, num_heads, num_kv_heads, head_dim, rotate=rotate)

    def paged_decode_attention(
        self,
        q,
        k_cache,
        v_cache,
        block_tables,
        positions,
        scale: float,
        alibi: Alibi | None = None,
        *,
        release: bool = False,
    ) -> torch.Tensor:
        """q [B, nq, D] of rows at `positions` [B] long (each attending to its first positions + 1 tokens, the new
        one written by this step's `rope_and_store`) -> [B, nq, D] (`paged_decode_attention_ref`). `release`: the
        kernel after it may start at its start (`on_tile_gemv`)."""
        if self.use_triton:
            page, nkv = k_cache.shape[1], k_cache.shape[2]
            splits, pages = self.attention_splits(q.shape[0], nkv, q.shape[1] // nkv, page)
            # reading a page before the wait wins where every program has a multiprocessor to itself (one row: a
            # step 3% faster); its registers cost a 64-row grid occupancy (docs/decisions/0278)
            early = q.shape[0] * nkv * splits <= self.num_sms
            if alibi is None:
                return triton_kernels.paged_decode_attention(
                    q, k_cache, v_cache, block_tables, positions, scale, splits, pages_per_split=pages,
                    unsplit_pages=SHORT_ROW_TOKENS // page, early=early, release=release,
                )  # fmt: skip
            return triton_kernels.paged_decode_attention(
                q, k_cache, v_cache, block_tables, positions, scale, splits, pages_per_split=pages,
                unsplit_pages=SHORT_ROW_TOKENS // page,
                alibi_slopes=alibi.slopes, alibi_scale=alibi.scale, alibi_mode=alibi.mode, early=early,
                release=release,
            )  # fmt: skip
        seq_lens = (positions + 1).to(torch.int32)  # [B]
        if q.is_cpu:
            return paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale, alibi)
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, alibi)

    def silu_mul(self, gate_up: torch.Tensor, f16_scale: float | None = None) -> torch.Tensor:
        """gate_up [N, 2I] -> [N, I]; with `f16_scale` (Triton only): times it, in fp16 (`triton_kernels.silu_mul`)."""
        if self.use_triton:
            return triton_kernels.silu_mul(gate_up, f16_scale)
        if f16_scale is not None:
            raise ValueError("a scaled fp16 SiLU output needs the Triton kernel")
        return silu_mul_ref(gate_up)

    def num_splits(self, batch: int, num_kv_heads: int, group: int = 1) -> int:
        """Sequence splits per (row, kv head) so that about two programs run per multiprocessor; at most
        LARGE_GROUP_SPLITS for more than LARGE_GROUP query heads per kv head (`group`), whose splits' partial sums
        one program reads back one split after another (Falcon-7B's 71 heads on one: docs/decisions/0078)."""
        want = math.ceil(2 * self.num_sms / max(1, batch * num_kv_heads))
        return max(1, min(self._most_splits(group), want))

    def attention_splits(self, batch: int, num_kv_heads: int, group: int, page_tokens: int) -> tuple[int, int]:
        """(The grid's splits per (row, kv head), the pages a split takes): rows of REFERENCE_TOKENS make about
        REFERENCE_PROGRAMS_PER_SM programs a multiprocessor, a row of P pages takes ceil(P / pages) of the grid's
        splits (at least one), and the grid offers `num_splits`' count, or LONG_ROW_SPLITS where the cap and
        LONG_ROW_PROGRAMS allow (the kernel leaves rows of SHORT_ROW_TOKENS unsplit). Depends on the launch's shape
        only (CUDA graphs replay it), and a row's splits on its own length: its output does not depend on the
        other rows."""
        pairs = max(1, batch * num_kv_heads)
        offered = min(LONG_ROW_SPLITS, self._most_splits(group), LONG_ROW_PROGRAMS // pairs)
        reference_pages = math.ceil(REFERENCE_TOKENS / page_tokens)
        pages = math.ceil(reference_pages * pairs / (REFERENCE_PROGRAMS_PER_SM * self.num_sms))
        return max(self.num_splits(batch, num_kv_heads, group), offered), max(1, pages)

    def _most_splits(self, group: int) -> int:
        return min(self.attention_splits_max, LARGE_GROUP_SPLITS) if group > LARGE_GROUP else self.attention_splits_max
