"""The INT8 row GEMV for one-row decode steps, on the matrix units: out[M, N] = x[M, K] @ W[N, K]^T * row_absmax /
127 (+ residual), LLM.int8's codes read in place, every x row on its own. The tuner (quant_choices) times it per
weight shape against the Triton kernels. Hand-written because at one row the Triton kernels were bound by their
instruction count, not by the bytes (~0.3 warp instructions a byte against the 0.25 the copy bandwidth allows; this
kernel ~0.055: docs/decisions/0050).

Layout. `mma.m16n8k16` (fp16 x fp16 -> fp32): a program owns RT tiles of 16 rows; lane (g, t) of a warp loads the
16 bytes 16 t .. 16 t + 15 of a 64-value chunk of rows g and g + 8 of a tile (a warp: one chunk of 16 rows, 1 KiB),
and those bytes are the A operand as they stand: mma step s takes the lane's word s, its bytes 0, 1 in k slots 2 t,
2 t + 1 and bytes 2, 3 in slots 2 t + 8, 2 t + 9. x's 16 values at the lane's chunk position sit in the same slots
of column 0 of B (lanes g = 0; the other columns are zeros), so the k order inside a chunk is permuted alike for
both. A code pair becomes an exact fp16 pair by one XOR per word (codes + 128 as unsigned bytes), one byte permute
that puts each byte under the exponent of 1024 (1024 + 128 + code) and one fp16x2 subtraction of 1152.

Work. K's chunks go to the program's W warps in turn (chunk c to warp c mod W); each warp keeps the next P chunks' codes
in flight in registers, the first P issued before `griddepcontrol.wait` (ungated builds by cp.async into a shared
ring, since ptxas moved plain register loads below the wait: 0114), each load asking the L2 for the 256 bytes around
it (`ld_stream_256`: 0069). x is staged once per program in shared memory as fp16 (bf16 x times X_SCALE = 2^-8,
against overflow; the sums times 2^8, exact). The warps' column-0 sums are added in warp order through shared memory,
then the row's scale (row absmax / 127, fp32) and the residual are applied and the value is rounded once to the
output dtype. Both are asked for at the program's start so they are not a cold round trip on the critical path: the
scale before the wait by cp.async, the residual right after it by a volatile load (a plain one was hoisted above the
wait; 0055).

The RMSNorm prologue (prologues.PROLOGUES["rmsnorm"], 0063): the norm before w_qkv and w_gate_up runs in the x
staging (nvrtc_kernels' stage_x, shared with the NF4 tile GEMV), rounded as triton_kernels.rms_norm rounds it, so the
step launches no norm kernel; every program forms the same 1/rms (fixed summation order).

The gated form (`gated`, w_gate_up = [gate | up], 0048): a program's first RT / 2 row tiles are gate rows and the other
RT / 2 the same rows of the up half, so it writes silu(gate) * up [I] itself, rounded as the GEMV + silu_mul would:
no SiLU kernel, and w_down reads I values, not 2I. Launch is programmatic (nvrtc_kernels, 0047).

Batch invariance and determinism: a row's value depends only on its own x row (grid [ceil(N / 16 RT), M]: programs
never mix x rows; every sum's order is fixed by K and the config). Rows past N in the last tile read row N - 1 and
store nothing. Numerics: exact codes, x in fp16, exact products, fp32 sums: within the rounding of the dequantized
weight. Compiled at run time (nvrtc_kernels); CUDA-graph safe. Importing fails without Triton (quant_splits)."""

from __future__ import annotations

import ctypes

import torch

from corolla.engine.kernels.nvrtc_kernels import CUDA_HELPERS, NvrtcKernel
from corolla.engine.quant.prologues import PROLOGUES, check_prologue
from corolla.engine.quant.quant_weights import Int8Weight

CHUNK_VALUES = 64  # 4 lanes x 16 codes of each of a tile's 16 rows; K must be a multiple of this
X_SCALE = 2.0**-8  # bf16 x into fp16 times this (range), the sums times its inverse (exact)
# (RT row tiles of 16 a program, W warps splitting K, P chunks in flight per warp, 0, 0; the zeros keep the tuner's
# 5-int configs): each won a Llama-3-8B projection on an H200 (docs/decisions/0050, 0114); those that won none are
# not offered
INT8_MMA_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    (1, 8, 4, 0, 0), (1, 16, 2, 0, 0), (4, 4, 2, 0, 0), (1, 16, 3, 0, 0)
)  # fmt: skip

# the tilings offered for the gated form (w_gate_up: silu(gate) * up written; an even row-tile count: half of the
# program's tiles gate rows, half the same up rows): the one that won on an H200 (docs/decisions/0048)
GATED_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = ((4, 4, 2, 0, 0),)

# the prologues the kernel runs (prologues.PROLOGUES' codes): none and RMSNorm (SiLU gating lost: decision 0063)
PROLOGUE_CODES = (PROLOGUES["none"], PROLOGUES["rmsnorm"])

# the kernel, compiled after nvrtc_kernels.CUDA_HELPERS (the helpers the row GEMVs share, RMSNorm's pairs among them)
_SOURCE = r"""
#define THREADS (W * 32)
// [2][OUT_ROWS] floats after RMSNorm's gain: each output row's scale and its residual (GATED: its up row's scale)
#define ENDS reinterpret_cast<float*>(smem + 2 * (size_t)K + W * RT * 16 * 4 + (PRO == 1 ? 2 * (size_t)K : 0))
#define OUT_ROWS (GATED ? RT * 8 : RT * 16)  // output rows of a program (GATED: half its weight rows)
// ungated builds: [P][RT][2][THREADS] 16-byte words after ENDS, the first P chunks of each thread's two rows of each
// tile, copied by cp.async before the wait (ptxas moved register loads written there below it; the gated build keeps
// them above, and a ring cost its (4, 4, 2) tiling a program per multiprocessor: docs/decisions/0084, 0114)
#define RING (!GATED)
#define RING_WORDS reinterpret_cast<U4*>(smem + 2 * (size_t)K + W * RT * 16 * 4 + (PRO == 1 ? 2 * (size_t)K : 0) + \
                                         8 * OUT_ROWS)
static_assert(OUT_ROWS <= THREADS, "a thread per output row");

// bytes j, j + 1 of a biased code word (codes + 128) -> their codes as an exact fp16 pair: each byte under the
// exponent of 1024 (one permute with 0x64 bytes: 1024 + 128 + code), minus 1152 in both halves
static __device__ __forceinline__ u32 codes_f16x2(u32 b, u32 sel) {
  const u32 h = __byte_perm(b, 0x64646464u, sel);
  u32 d;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(d) : "r"(h), "r"(0x64806480u));
  return d;
}

// the weight row of row r (0..15) of the program's tile rt: GATED, tiles [0, RT / 2) are rows of the gate half and
// [RT / 2, RT) the same rows of the up half (N: the half's rows); rows past N read row N - 1 of their half
static __device__ __forceinline__ int weight_row(int n0, int rt, int r, int N) {
#if GATED
  const int up = rt >= RT / 2;
  return min(n0 + 16 * (rt - up * (RT / 2)) + r, N - 1) + up * N;
#else
  return min(n0 + 16 * rt + r, N - 1);
#endif
}

#define MMA(c, a0, a1, a2, a3, b0, b1)                                                                         \
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "              \
      "{%0,%1,%2,%3};"                                                                                         \
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                                         \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));

// one code word of rows g (wg) and g + 8 (w8) against x's pair words b0, b1: k slots 2t, 2t + 1 take the word's
// bytes 0, 1 and slots 2t + 8, 2t + 9 its bytes 2, 3 (x's lane words in the same order)
#define STEP(c, wg, w8, b0, b1)                                                                                \
  {                                                                                                            \
    const u32 bg = (wg) ^ 0x80808080u, b8 = (w8) ^ 0x80808080u;                                                \
    MMA(c, codes_f16x2(bg, 0x5140), codes_f16x2(b8, 0x5140), codes_f16x2(bg, 0x5342), codes_f16x2(b8, 0x5342), \
        b0, b1)                                                                                                \
  }

extern __shared__ __align__(16) unsigned char smem[];

extern "C" __global__ void __launch_bounds__(THREADS)
int8_row_mma(const U4* __restrict__ codes, const float* __restrict__ scale, const u16* __restrict__ x,
             const u16* __restrict__ res, u16* __restrict__ out, const u16* __restrict__ nw, int N, int K,
             long long sxm, long long srm, long long som, int has_res, float out_scale, float eps) {
  grid_release();  // the next kernel's programs may start (they wait for this one's output)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * OUT_ROWS;
  const long long m = blockIdx.y;
  const int kw = K >> 4;        // 16-byte words per weight row (K a multiple of 64)
  const int chunks = kw >> 2;   // 64-value chunks: lane t's word 4 c + t of rows g and g + 8 of each tile
  U4* xs = reinterpret_cast<U4*>(smem);                          // [K / 8] x as the B operand's fp16 pairs
  float* red = reinterpret_cast<float*>(smem + 2 * (size_t)K);  // [W][RT * 16] the warps' row sums
  // this warp's first chunk (warp), then every W-th; rows past N read row N - 1 (not stored)
  const U4* pw[RT][2];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) {
    pw[rt][0] = codes + (long long)weight_row(n0, rt, g, N) * kw + 4 * warp + t;
    pw[rt][1] = codes + (long long)weight_row(n0, rt, g + 8, N) * kw + 4 * warp + t;
  }

  // the first P chunks' codes go out before the wait for the kernel ahead and x's staging (their DRAM round trip
  // overlaps both: the codes are immutable); RING: into shared memory, read into the registers after the staging
  U4 buf[P][RT][2];
#pragma unroll
  for (int f = 0; f < P; ++f) {
    if (warp + f * W < chunks) {
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
#if RING
        copy_async16_256(RING_WORDS + ((f * RT + rt) * 2) * THREADS + tid, pw[rt][0] + f * 4 * W);
        copy_async16_256(RING_WORDS + ((f * RT + rt) * 2 + 1) * THREADS + tid, pw[rt][1] + f * 4 * W);
#else
        buf[f][rt][0] = ld_stream_256(pw[rt][0] + f * 4 * W);
        buf[f][rt][1] = ld_stream_256(pw[rt][1] + f * 4 * W);
#endif
      }
    }
  }
  // thread i < OUT_ROWS owns output row n0 + i: its weight row's scale (GATED: and its up row's) copied into shared
  // memory now (immutable; cp.async: no register waits for it before the sums), so that no program ends on a cold
  // DRAM round trip after its sums
  if (tid < OUT_ROWS) {
    float* ends = ENDS;
    const int own = min(n0 + tid, N - 1);
    copy_async4(ends + tid, scale + own);
#if GATED
    copy_async4(ends + OUT_ROWS + tid, scale + N + own);
#endif
  }
  grid_wait();  // x (and the residual) come from the kernels ahead
#if !GATED
  // the residual of the thread's row, in flight while x is staged
  const float rv = has_res && tid < OUT_ROWS && n0 + tid < N ? load_written_out_type(res + m * srm + n0 + tid) : 0.f;
#endif
  // x staged as the B operand's fp16 pairs (PRO 1: RMSNorm's result first; nvrtc_kernels' stage_x), the gain after
  // the warps' row sums
  stage_x<THREADS>(xs, reinterpret_cast<const U4*>(x + m * sxm), K, K >> 3, reinterpret_cast<const U4*>(nw),
                   reinterpret_cast<U4*>(smem + 2 * (size_t)K + W * RT * 16 * 4), red, eps);
#if !GATED
  if (tid < OUT_ROWS) ENDS[OUT_ROWS + tid] = rv;  // (no register held through the main loop)
#endif
#if RING
  copy_async_wait();  // this thread's ring words (and the scales: visible to the others after the barrier below)
#pragma unroll
  for (int f = 0; f < P; ++f) {
    if (warp + f * W < chunks) {
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        buf[f][rt][0] = RING_WORDS[((f * RT + rt) * 2) * THREADS + tid];
        buf[f][rt][1] = RING_WORDS[((f * RT + rt) * 2 + 1) * THREADS + tid];
      }
    }
  }
#endif
  __syncthreads();

  float acc[RT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) acc[rt][0] = acc[rt][1] = acc[rt][2] = acc[rt][3] = 0.f;

  for (int base = warp; base < chunks; base += P * W) {
#pragma unroll
    for (int f = 0; f < P; ++f) {
      const int c = base + f * W;
      if (c < chunks) {  // the same in every lane: the mma below runs in all of them
        // B: x in column 0 (lanes g == 0: x[64 c + 16 t, + 16)), zeros in the other columns
        U4 xa = {0u, 0u, 0u, 0u}, xb = {0u, 0u, 0u, 0u};
        if (g == 0) {
          xa = xs[2 * (4 * c + t)];
          xb = xs[2 * (4 * c + t) + 1];
        }
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
          STEP(acc[rt], buf[f][rt][0].x, buf[f][rt][1].x, xa.x, xa.y)
          STEP(acc[rt], buf[f][rt][0].y, buf[f][rt][1].y, xa.z, xa.w)
          STEP(acc[rt], buf[f][rt][0].z, buf[f][rt][1].z, xb.x, xb.y)
          STEP(acc[rt], buf[f][rt][0].w, buf[f][rt][1].w, xb.z, xb.w)
        }
        if (c + P * W < chunks) {  // the slot takes the chunk P steps ahead
#pragma unroll
          for (int rt = 0; rt < RT; ++rt) {
            buf[f][rt][0] = ld_stream_256(pw[rt][0] + (f + P) * 4 * W);
            buf[f][rt][1] = ld_stream_256(pw[rt][1] + (f + P) * 4 * W);
          }
        }
      }
    }
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
      pw[rt][0] += P * 4 * W;
      pw[rt][1] += P * 4 * W;
    }
  }

#if !RING
  copy_async_wait();  // the scales (long arrived), visible to the other threads after the barrier below
#endif

  // column 0 of each tile: lane (g, 0) holds rows g (c[0]) and g + 8 (c[2]); the warps summed in order
  if (t == 0) {
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
      red[warp * (RT * 16) + 16 * rt + g] = acc[rt][0];
      red[warp * (RT * 16) + 16 * rt + g + 8] = acc[rt][2];
    }
  }
  __syncthreads();
  const float* ends = ENDS;
  for (int i = tid; i < OUT_ROWS; i += THREADS) {  // (once: OUT_ROWS <= THREADS; a loop holds fewer registers)
    const int n = n0 + i;
    if (n < N) {
      float v = red[i];
#pragma unroll
      for (int w = 1; w < W; ++w) v += red[w * (RT * 16) + i];
      v = __fmul_rn(__fmul_rn(v, out_scale), ends[i]);
#if GATED
      // GATED: the up row's sum sits RT / 2 tiles on; gate and up rounded as stored, then gated as silu_mul gates
      float u = red[RT * 8 + i];
#pragma unroll
      for (int w = 1; w < W; ++w) u += red[w * (RT * 16) + RT * 8 + i];
      u = __fmul_rn(__fmul_rn(u, out_scale), ends[OUT_ROWS + i]);
      v = silu_times(rounded(v), rounded(u));
#else
      if (has_res) v = __fadd_rn(v, ends[OUT_ROWS + i]);
#endif
      out[m * som + n] = to_out_type(v);
    }
  }
}
"""

_KERNELS: dict[tuple[int, ...], NvrtcKernel] = {}


def ring_bytes(config: tuple[int, int, int, int, int]) -> int:
    """Shared-memory bytes of an ungated program's ring: the P chunks in flight of its W warps' lanes, 16 bytes of
    two rows of each of its RT tiles a lane a chunk (a 1 KiB warp chunk per tile)."""
    tiles, warps, depth = config[:3]
    return depth * tiles * 2 * 32 * warps * 16


def check_row_config(config: tuple[int, int, int, int, int]) -> None:
    """ValueError unless `config` is (RT in 1..8 row tiles, W in 1..16 warps, P in 1..4 chunks in flight, 0, 0) with
    a thread per output row (16 RT <= 32 W). A tiling whose shared memory (x, the ring: `ring_bytes`) the device
    cannot hold is refused at launch (`NvrtcKernel`: ValueError)."""
    tiles, warps, depth, *rest = config
    if not (1 <= tiles <= 8 and 1 <= warps <= 16 and 1 <= depth <= 4 and tiles <= 2 * warps) or any(rest):
        raise ValueError(f"bad INT8 row GEMV config {config}")


def row_kernel(config: tuple[int, int, int, int, int], bf16: bool, prologue: int, gated: bool) -> NvrtcKernel:
    """The kernel's build for this tiling, dtype (bf16, else fp16), prologue (PROLOGUE_CODES) and gated form (one per
    process, compiled on its first launch)."""
    key = (*config[:3], int(bf16), prologue, int(gated))
    if key not in _KERNELS:
        tiles, warps, depth = config[:3]
        defines = {"RT": tiles, "W": warps, "P": depth, "X_BF16": int(bf16), "OUT_BF16": int(bf16), "PRO": prologue,
                   "GATED": int(gated)}  # fmt: skip
        _KERNELS[key] = NvrtcKernel(CUDA_HELPERS + _SOURCE, "int8_row_mma", defines)
    return _KERNELS[key]


def int8_row_mma(
    x: torch.Tensor,
    weight: Int8Weight,
    residual: torch.Tensor | None,
    config: tuple[int, int, int, int, int],
    prologue: int = 0,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
) -> torch.Tensor:
    """f(x) [M, K] @ W[N, K]^T * row_absmax / 127 (+ residual [M, N]) -> [M, N] in the weight's dtype (bf16 or
    fp16; x in it too), f = `prologue` (prologues.PROLOGUES): the identity or RMSNorm with the gain `norm_weight`
    [K] (x's dtype) and `eps`, rounded to x's dtype as triton_kernels.rms_norm rounds it. `gated` (W = [gate | up],
    N even, no residual, an even number of row tiles in `config`): silu(gate) * up [M, N / 2] of that result instead,
    formed as triton_kernels.silu_mul forms it from the stored [gate | up] (GATED_CONFIGS: the tilings offered for
    it). ValueError for a bad shape, dtype, layout (K a multiple of CHUNK_VALUES), prologue (SiLU gating: none here)
    or config. x (or the gain) is copied once when its rows do not start 16-byte aligned."""
    check_row_config(config)
    m, kx = x.shape
    n, k = weight.shape
    if gated and (n % 2 or residual is not None or config[0] % 2):
        raise ValueError(f"a gated int8_row_mma takes an even N ({n}), no residual and an even row-tile count {config}")
    if weight.dtype not in (torch.bfloat16, torch.float16) or x.dtype != weight.dtype or kx != k or m < 1:
        raise ValueError(
            f"int8_row_mma takes [M, {k}] bf16/fp16 rows of the weight's dtype ({weight.dtype}), "
            f"got {tuple(x.shape)} {x.dtype}"
        )
    check_prologue(k, prologue, norm_weight)  # (every prologue code there is: none, RMSNorm)
    codes = weight.codes
    if k % CHUNK_VALUES or not codes.is_contiguous() or codes.data_ptr() % 16:
        raise ValueError(f"int8_row_mma needs contiguous 16-byte aligned codes with K % {CHUNK_VALUES} == 0")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1 or residual.dtype != weight.dtype):
        raise ValueError(f"residual must be a [{m}, {n}] {weight.dtype} tensor with a contiguous last dim")
    if x.stride(1) != 1 or x.data_ptr() % 16 or x.stride(0) % 8:
        x = x.contiguous().clone()  # a fresh allocation: aligned
    nw = x  # (not read without the RMSNorm prologue)
    if prologue == PROLOGUES["rmsnorm"]:
        assert norm_weight is not None  # (check_prologue)
        if norm_weight.dtype != weight.dtype:
            raise ValueError(f"the RMSNorm gain must be {weight.dtype}, got {norm_weight.dtype}")
        nw = norm_weight if norm_weight.data_ptr() % 16 == 0 else norm_weight.clone()
    bf16 = weight.dtype == torch.bfloat16
    n_out = n // 2 if gated else n
    out = torch.empty((m, n_out), dtype=weight.dtype, device=x.device)
    res = residual if residual is not None else out
    tiles, warps = config[0], config[1]
    rows_per_program = 8 * tiles if gated else 16 * tiles  # (GATED: tiles of gate and of up rows)
    # x in fp16, the warps' row sums (first: their sums of squares), RMSNorm's gain, the rows' scales and residuals,
    # ungated: the first chunks' ring
    shared = 2 * k + warps * tiles * 16 * 4 + (2 * k if prologue == PROLOGUES["rmsnorm"] else 0) + 8 * rows_per_program
    shared += 0 if gated else ring_bytes(config)
    ptr = ctypes.c_void_p
    args = [
        ptr(codes.data_ptr()), ptr(weight.col_scale.data_ptr()), ptr(x.data_ptr()), ptr(res.data_ptr()),
        ptr(out.data_ptr()), ptr(nw.data_ptr()), ctypes.c_int(n_out), ctypes.c_int(k), ctypes.c_longlong(x.stride(0)),
        ctypes.c_longlong(res.stride(0)), ctypes.c_longlong(out.stride(0)), ctypes.c_int(int(residual is not None)),
        ctypes.c_float(1.0 / X_SCALE if bf16 else 1.0), ctypes.c_float(eps),
    ]  # fmt: skip
    grid = (-(-n_out // rows_per_program), m, 1)
    row_kernel(config, bf16, prologue, gated).launch(x.device, grid, 32 * warps, shared, args)
    return out
