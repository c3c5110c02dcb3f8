"""The INT8 row GEMV for one-row decode steps: out[M, N] = x[M, K] @ W[N, K]^T * row_absmax / 127 (+ residual), LLM.int8's
codes read in place, each output row on the CUDA cores of one program, every x row on its own.

Why a hand-written kernel: at one row the Triton kernels were bound by their instructions, not by the bytes (sm_90
SASS compiled on CPU, Triton 3.9): the tl.dot block kernel spends ~314 warp instructions per 4 KiB of codes (a trip
through shared memory, the conversion to bf16, the matrix instruction that wastes 15/16 of its work), about 0.3 per
byte, while the H200 must retire 16 bytes per cycle per multiprocessor to reach its copy bandwidth: at 4 issues a
cycle that allows 0.25. The Triton byte GEMV converts each code with I2F, whose rate (16 a cycle per multiprocessor)
is that same 16 bytes a cycle, and shuffles x through shared memory behind three barriers a step.

Here a code word (4 int8) costs one XOR (to 4 unsigned bytes biased by 128), then per value one byte permute that
puts the byte under the exponent of 2^23 (an exact fp32 2^23 + 128 + code), one subtraction and one FMA with x in
fp32: about 3.3 instructions per byte per lane (0.1 per byte per warp instruction), and no I2F.

Work. A program of W warps owns R consecutive output rows of one x row (grid [ceil(N / R), M]); the K axis is cut
into chunks of 512 values (32 lanes x 16 codes, one 16-byte load per lane and row), chunk c going to warp c mod W, so
the W warps split K and their loads of a short K (W chunks: Llama-3-8B's K = 4096 is 8 chunks) all go out at once.
Each warp keeps the next P chunks' codes in flight (registers) while it multiplies the current one. A lane sums its
16 products per chunk in k order into one fp32 accumulator per row; the 32 lanes are summed by a fixed butterfly of
shuffles, the W warps' sums in warp order through shared memory, then the row's scale (row absmax / 127, fp32) and
the residual are applied and the value rounded once to the output dtype.

Batch invariance and determinism: a row's value depends only on its own x row (programs never mix x rows; the order
of every sum is fixed by K, R and W alone). Rows past N in the last program read row N - 1 and store nothing; a
lane past K (K a multiple of 16, not of 512) reads zeros. Numerics: exact codes, fp32 products and sums, as the
Triton kernels (within the rounding of the dequantized weight). Compiled at run time (nvrtc_kernels); CUDA-graph
safe. Importing needs no GPU."""

from __future__ import annotations

import ctypes

import torch

from corolla.engine.kernels.nvrtc_kernels import NvrtcKernel
from corolla.engine.quant.quant_weights import Int8Weight

CHUNK_VALUES = 512  # 32 lanes x 16 codes: one 16-byte load per lane per row
SEGMENT_VALUES = 16  # one lane's codes of a chunk; K must be a multiple of this

# (R rows a program, W warps a program splitting K, P chunks in flight per warp, 0, 0): timed per weight shape by
# the tuner (quant_choices) against the Triton kernels; the trailing zeros keep the tuner's 5-int configs
INT8_ROW_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    (4, 8, 2, 0, 0),
    (8, 4, 2, 0, 0),
    (2, 8, 2, 0, 0),
    (4, 4, 2, 0, 0),
    (8, 8, 1, 0, 0),
)

_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
struct alignas(16) U4 { u32 x, y, z, w; };

#define THREADS (W * 32)

// 16 codes of a weight row: streamed once, kept out of L1
static __device__ __forceinline__ U4 ld_stream(const U4* p) {
  U4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// 8 values of x: read by every program, cached
static __device__ __forceinline__ U4 ld_x(const U4* p) {
  U4 v;
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// a word of two 16-bit x values -> (even, odd) in fp32
static __device__ __forceinline__ void x_pair(u32 v, float& lo, float& hi) {
#if X_BF16
  lo = __uint_as_float(v << 16);
  hi = __uint_as_float(v & 0xffff0000u);
#else
  asm("{ .reg .b16 a, b; mov.b32 {a, b}, %2; cvt.f32.f16 %0, a; cvt.f32.f16 %1, b; }"
      : "=f"(lo), "=f"(hi) : "r"(v));
#endif
}

// code byte i of a biased word (codes + 128 as unsigned bytes) -> the exact code in fp32: the byte under the exponent
// of 2^23 (one permute: bytes [b, 0, 0, 0x4B]) is 2^23 + 128 + code
#define CODE(v, i) __fsub_rn(__uint_as_float(__byte_perm((v), 0x4B000000u, 0x7540 + (i))), 8388736.0f)

// acc += the 4 codes of word w (biased here) times xf[0..3], in k order
#define DOT4(acc, w, xf)                                                                                       \
  {                                                                                                            \
    const u32 b = (w) ^ 0x80808080u;                                                                           \
    acc = __fmaf_rn(CODE(b, 0), (xf)[0], acc);                                                                 \
    acc = __fmaf_rn(CODE(b, 1), (xf)[1], acc);                                                                 \
    acc = __fmaf_rn(CODE(b, 2), (xf)[2], acc);                                                                 \
    acc = __fmaf_rn(CODE(b, 3), (xf)[3], acc);                                                                 \
  }

static __device__ __forceinline__ float load_out_type(const u16* p) {
#if OUT_BF16
  return __uint_as_float(((u32)*p) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*p));
  return f;
#endif
}

static __device__ __forceinline__ u16 to_out_type(float v) {
  u16 h;
#if OUT_BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
#endif
  return h;
}

extern "C" __global__ void __launch_bounds__(THREADS)
int8_row_gemv(const U4* __restrict__ codes, const float* __restrict__ scale, const u16* __restrict__ x,
              const u16* __restrict__ res, u16* __restrict__ out, int N, int K, long long sxm, long long srm,
              long long som, int has_res) {
  __shared__ float red[W][R];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = blockIdx.x * R;
  const long long m = blockIdx.y;
  const int chunks = (K + 511) >> 9;
  const int kw = K >> 4;  // 16-byte words per weight row
  const U4* xrow = reinterpret_cast<const U4*>(x + m * sxm);  // 8 values a word

  // this lane's word of row r in chunk c: codes[(n0 + r) * kw + 32 c + lane] (rows past N read row N - 1)
  long long rbase[R];
#pragma unroll
  for (int r = 0; r < R; ++r) rbase[r] = (long long)min(n0 + r, N - 1) * kw + lane;

  U4 buf[P][R];
#pragma unroll
  for (int f = 0; f < P; ++f) {
    const int c = warp + f * W;
    const bool ok = c < chunks && 32 * c + lane < kw;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      U4 v = {0u, 0u, 0u, 0u};
      if (ok) v = ld_stream(codes + rbase[r] + 32 * c);
      buf[f][r] = v;
    }
  }

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;

  for (int base = warp; base < chunks; base += P * W) {
#pragma unroll
    for (int f = 0; f < P; ++f) {
      const int c = base + f * W;
      if (c < chunks) {
        const int seg = 32 * c + lane;  // this lane's 16-value segment of the row
        U4 cur[R];
#pragma unroll
        for (int r = 0; r < R; ++r) cur[r] = buf[f][r];
        // the slot takes the chunk P steps ahead
        const int cn = c + P * W;
        const bool more = cn < chunks && 32 * cn + lane < kw;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          U4 v = {0u, 0u, 0u, 0u};
          if (more) v = ld_stream(codes + rbase[r] + 32 * cn);
          buf[f][r] = v;
        }
        if (seg < kw) {
          const U4 xa = ld_x(xrow + 2 * seg), xb = ld_x(xrow + 2 * seg + 1);
          float xf[16];
          x_pair(xa.x, xf[0], xf[1]); x_pair(xa.y, xf[2], xf[3]); x_pair(xa.z, xf[4], xf[5]);
          x_pair(xa.w, xf[6], xf[7]); x_pair(xb.x, xf[8], xf[9]); x_pair(xb.y, xf[10], xf[11]);
          x_pair(xb.z, xf[12], xf[13]); x_pair(xb.w, xf[14], xf[15]);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            DOT4(acc[r], cur[r].x, xf) DOT4(acc[r], cur[r].y, xf + 4) DOT4(acc[r], cur[r].z, xf + 8)
            DOT4(acc[r], cur[r].w, xf + 12)
          }
        }
      }
    }
  }

  // the warp's 32 lanes in a fixed butterfly, then the warps in order
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float v = acc[r];
    v += __shfl_xor_sync(0xffffffffu, v, 16);
    v += __shfl_xor_sync(0xffffffffu, v, 8);
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    if (lane == 0) red[warp][r] = v;
  }
  __syncthreads();
  if (threadIdx.x < R) {
    const int r = threadIdx.x, n = n0 + r;
    if (n < N) {
      float v = red[0][r];
#pragma unroll
      for (int w = 1; w < W; ++w) v += red[w][r];
      v = __fmul_rn(v, __ldg(scale + n));
      if (has_res) v = __fadd_rn(v, load_out_type(res + m * srm + n));
      out[m * som + n] = to_out_type(v);
    }
  }
}
"""

_KERNELS: dict[tuple[int, ...], NvrtcKernel] = {}


def check_row_config(config: tuple[int, int, int, int, int]) -> None:
    """ValueError unless `config` is (R in 1..16 rows, W in 1..16 warps, P in 1..4 chunks in flight, 0, 0)."""
    rows, warps, depth, *rest = config
    if not (1 <= rows <= 16 and 1 <= warps <= 16 and 1 <= depth <= 4) or any(rest):
        raise ValueError(f"bad INT8 row GEMV config {config}")


def _kernel(config: tuple[int, int, int, int, int], x_bf16: bool, out_bf16: bool) -> NvrtcKernel:
    key = (*config[:3], int(x_bf16), int(out_bf16))
    if key not in _KERNELS:
        rows, warps, depth = config[:3]
        defines = {"R": rows, "W": warps, "P": depth, "X_BF16": int(x_bf16), "OUT_BF16": int(out_bf16)}
        _KERNELS[key] = NvrtcKernel(_SOURCE, "int8_row_gemv", defines)
    return _KERNELS[key]


def int8_row_gemv(
    x: torch.Tensor, weight: Int8Weight, residual: torch.Tensor | None, config: tuple[int, int, int, int, int]
) -> torch.Tensor:
    """x [M, K] @ W[N, K]^T * row_absmax / 127 (+ residual [M, N]) -> [M, N] in the weight's dtype (bf16 or fp16;
    x in it too); ValueError for a bad shape, dtype, layout or config. x is copied once when its rows do not start
    16-byte aligned."""
    check_row_config(config)
    m, k = x.shape
    n, wk = weight.shape
    if weight.dtype not in (torch.bfloat16, torch.float16) or x.dtype != weight.dtype or wk != k or m < 1:
        raise ValueError(
            f"int8_row_gemv takes [M, {wk}] bf16/fp16 rows of the weight's dtype ({weight.dtype}), "
            f"got {tuple(x.shape)} {x.dtype}"
        )
    codes = weight.codes
    if k % SEGMENT_VALUES or not codes.is_contiguous() or codes.data_ptr() % 16:
        raise ValueError(f"int8_row_gemv needs contiguous 16-byte aligned codes with K % {SEGMENT_VALUES} == 0")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1 or residual.dtype != weight.dtype):
        raise ValueError(f"residual must be a [{m}, {n}] {weight.dtype} tensor with a contiguous last dim")
    if x.stride(1) != 1 or x.data_ptr() % 16 or x.stride(0) % 8:
        x = x.contiguous().clone()  # a fresh allocation: aligned
    bf16 = weight.dtype == torch.bfloat16
    kernel = _kernel(config, bf16, bf16)
    out = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    res = residual if residual is not None else out
    rows, warps = config[0], config[1]
    ptr = ctypes.c_void_p
    args = [
        ptr(codes.data_ptr()), ptr(weight.col_scale.data_ptr()), ptr(x.data_ptr()), ptr(res.data_ptr()),
        ptr(out.data_ptr()), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_longlong(x.stride(0)),
        ctypes.c_longlong(res.stride(0)), ctypes.c_longlong(out.stride(0)), ctypes.c_int(int(residual is not None)),
    ]  # fmt: skip
    kernel.launch(x.device, (-(-n // rows), m, 1), 32 * warps, 0, args)
    return out
