"""The NF4 one-row GEMV on the matrix units: out[M, N] = x[M, K] @ W[N, K]^T (+ residual), each row on its own,
reading bitsandbytes' packed bytes and absmax codes in place (no repacked copy).

Tiles. The weight is read in units of 16 rows x 256 values (4 blocks of 64: 128 bytes of each row, one cache line).
Lane l = 4 g + t of a warp loads, of rows g and g + 8 of the unit, the 16 bytes 16 t .. 16 t + 15 and 64 + 16 t ..
64 + 16 t + 15 (four 16-byte loads: each instruction reads 64 contiguous bytes of 8 rows), and those bytes are the A
operand of 16 `mma.m16n8k16` steps as they stand: the k order inside an mma step is free as long as x (B) follows it,
so step (u, w, p) of lane t takes bytes 2p and 2p + 1 of word w of its u-th load of rows g and g + 8, i.e. values
256 G + 128 u + 32 t + 8 w + 4 p + [0, 4), and x's B fragment is those 4 values (one 8-byte shared load per step
pair: a lane's x for a unit is 2 x 64 contiguous bytes).

Dequantization: each packed byte is one shared-memory load of the NF4 pair table (quant_pair_table: the byte's two
levels as fp16x2, already the mma operand's register), the table 32 times over (one column per lane: no bank
conflict, 64 KiB), the byte put into the address by one byte permute (`__byte_perm`: byte << 8 | lane << 2), plus an
add of the table's base unless the table sits at a 64 KiB boundary of the shared window (ALIGNED). A word of 8 values
costs 4 permutes and 4 shared loads; its products and sums are one quarter of an `mma` (fp16 operands, fp32 sums).

Scales. B's 8 columns keep the unit's 4 blocks apart: lane t's load u is block 2 u + t / 2 of the unit, and the lanes
of column 2 j (g = 2 j) read x for block j, every other lane reads zeros; so after a unit lane (g, t) holds block t's
sums of rows g and g + 8 and decodes only those two absmaxes (uint8 code -> nested code * second-level absmax +
offset, in fp32 as the reference).

Work. A program owns a contiguous range of 16-row tiles (balanced over a grid of as many programs as the device
holds at once); its units (row tile, group of 4 blocks), row-tile major, are cut into one contiguous equal range per
warp (every warp busy, at most one unit apart), which streams them with the next DEPTH units' 16-byte loads in
registers (the first issued before the tables are built). A warp's partial sum of a row tile goes to its own
shared-memory slot; the row's slots are added in warp order (K order) at the end: no atomics, the result depends
on the shape, config and device only, and a row never depends on another row.

Numerics: fp16 levels (relative error <= 2^-11), x in fp16 (bf16 x times 2^-8, as the RMSNorm / SiLU kernels write
it prescaled, or converted here), products and sums in fp32 on the matrix units, then the block's fp32 absmax: within
the bf16 rounding of bitsandbytes' dequantized weights. Compiled at run time (nvrtc_kernels); CUDA-graph safe.
Importing needs no GPU; `emulate` is the kernel's data movement on CPU tensors (tests/unit)."""

from __future__ import annotations

import ctypes

import torch

from corolla.engine.kernels.nvrtc_kernels import CUDA_HELPERS, NvrtcKernel
from corolla.engine.quant.quant_weights import NF4_BLOCK_VALUES, NF4Weight

TILE_ROWS = 16
UNIT_VALUES = 4 * NF4_BLOCK_VALUES  # a unit's values per row (4 blocks, 128 packed bytes)
X_SCALE = 2.0**-8  # bf16 x into fp16: times this, the output times its inverse (RMSNorm / SiLU write x so prescaled)

# table modes: the table after the data (a permute and an add per lookup) or at a 64 KiB boundary of the shared
# window (one permute per lookup; one program per multiprocessor). Units staged through shared memory by cp.async
# lost to registers on every shape (docs/decisions/0031).
REGISTERS, ALIGNED = 0, 1
MODES = (REGISTERS, ALIGNED)

# (warps per program, units in flight per warp, table mode, programs per multiprocessor the compiler is told to fit,
# 0): threads per program 32 x warps. On an H200 (docs/decisions/0060) 16 warps with 2 units in flight won all four
# Llama-3-8B projections and 3 units came within 5%; the best two-programs tiling is kept for cards where a 128 KiB
# window does not fit; 32 warps with 1 unit (64 registers, spills) and 8 warps were 5-22% slower and are not offered.
NF4_TILE_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    (16, 2, ALIGNED, 1, 0),
    (16, 3, ALIGNED, 1, 0),
    (8, 2, REGISTERS, 2, 0),
)


def warp_units(units: int, warps: int, warp: int) -> tuple[int, int]:
    """The contiguous range [first, end) of a program's `units` (row tile, group) units that warp `warp` of
    `warps` streams (as the kernel cuts them)."""
    return warp * units // warps, (warp + 1) * units // warps


def program_row_tiles(row_tiles: int, programs: int, program: int) -> tuple[int, int]:
    """The contiguous range [first, end) of the weight's 16-row tiles that program `program` of `programs` owns."""
    return program * row_tiles // programs, (program + 1) * row_tiles // programs


def emulate(x: torch.Tensor, weight: NF4Weight, warps: int, programs: int) -> torch.Tensor:
    """The kernel's data movement on CPU (float64 sums): x [M, K] -> [M, N]. Per program and warp the kernel's
    units; per unit, each mma step's A fragment built from the bytes lane (g, t) loads (rows g and g + 8, loads u at
    bytes 128 G + 64 u + 16 t) and its B fragment from the x addresses the kernel's lanes read (zeros outside the
    block's column), multiplied by the PTX fragment layout of m16n8k16; lane (g, t)'s column 2 t scaled by its
    block's absmax; each warp's partial sum of a row tile in its slot, the slots added in warp order (a check of
    the indexing and of the work's coverage, not of rounding)."""
    n, k = weight.shape
    kb = k // NF4_BLOCK_VALUES
    kg = -(-kb // 4)
    rts = -(-n // TILE_ROWS)
    m = x.shape[0]
    pair_lo = weight.code.half().double()  # the pair table: byte b -> (level(b >> 4) low, level(b & 15) high)
    absmax = weight.block_absmax().double().reshape(n, kb)
    xs = (x.float() * X_SCALE).half().double() if x.dtype == torch.bfloat16 else x.double()  # [M, K] as staged
    xs = torch.nn.functional.pad(xs, (0, kg * UNIT_VALUES - k))  # zeros past K
    packed = weight.packed.long()
    g = torch.arange(8)
    out = torch.zeros(m, rts * TILE_ROWS, dtype=torch.float64)
    for prog in range(programs):
        rt0, rt1 = program_row_tiles(rts, programs, prog)
        units = (rt1 - rt0) * kg
        # [row tile, warp, M, row]: NaN where no warp writes (the kernel's shared memory holds stale values there)
        slots = torch.full((rt1 - rt0, warps, m, TILE_ROWS), float("nan"), dtype=torch.float64)
        for wp in range(warps):
            first, end = warp_units(units, warps, wp)
            for unit in range(first, end):
                rt, gi = rt0 + unit // kg, unit % kg
                rg = (rt * TILE_ROWS + g).clamp(max=n - 1)  # [8] rows g and g + 8 (padding rows read the last)
                rh = (rt * TILE_ROWS + g + 8).clamp(max=n - 1)
                if unit == first or unit % kg == 0:  # the warp's first unit of a row tile: its slot starts at 0
                    slots[rt - rt0, wp] = 0.0
                c = torch.zeros(m, TILE_ROWS, 8, dtype=torch.float64)  # the mma accumulator C [M, 16, 8]
                for u in range(2):
                    for w in range(4):
                        for p in range(2):
                            a = torch.zeros(TILE_ROWS, 16, dtype=torch.float64)  # A [16 rows, 16 k slots]
                            b = torch.zeros(m, 16, 8, dtype=torch.float64)  # B [M, 16 k slots, 8 columns]
                            for t in range(4):
                                blk = 4 * gi + 2 * u + t // 2
                                off = 128 * gi + 64 * u + 16 * t if blk < kb else 0
                                for j, kofs in ((0, 0), (1, 8)):  # byte 2 p + j -> k slots 2 t + kofs, + 1
                                    bg = packed[rg, off + 4 * w + 2 * p + j]  # [8] row g's byte
                                    bh = packed[rh, off + 4 * w + 2 * p + j]
                                    a[g, 2 * t + kofs], a[g, 2 * t + kofs + 1] = pair_lo[bg >> 4], pair_lo[bg & 15]
                                    a[g + 8, 2 * t + kofs] = pair_lo[bh >> 4]
                                    a[g + 8, 2 * t + kofs + 1] = pair_lo[bh & 15]
                                col = 4 * u + 2 * (t // 2)  # the one B column whose lanes read x (others zeros)
                                k0 = UNIT_VALUES * gi + 128 * u + 32 * t + 8 * w + 4 * p
                                b[:, 2 * t, col], b[:, 2 * t + 1, col] = xs[:, k0], xs[:, k0 + 1]
                                b[:, 2 * t + 8, col], b[:, 2 * t + 9, col] = xs[:, k0 + 2], xs[:, k0 + 3]
                            c += torch.einsum("rk,mkc->mrc", a, b)
                for t in range(4):  # lane (g, t): column 2 t, rows g and g + 8, times block 4 G + t's absmax
                    bj = min(4 * gi + t, kb - 1)
                    scale = torch.cat((absmax[rg, bj], absmax[rh, bj]))  # [16]
                    slots[rt - rt0, wp] += c[:, :, 2 * t] * scale
        for rt in range(rt1 - rt0):  # the row's slots in warp order, only the warps whose range meets the tile
            for wp in range(warps):
                first, end = warp_units(units, warps, wp)
                if first < end and first < (rt + 1) * kg and end > rt * kg:
                    out[:, (rt0 + rt) * TILE_ROWS : (rt0 + rt + 1) * TILE_ROWS] += slots[rt, wp]
    scale_out = 1 / X_SCALE if x.dtype == torch.bfloat16 else 1.0
    return (out[:, :n] * scale_out).to(x.dtype)


# the kernel, compiled after nvrtc_kernels.CUDA_HELPERS (the helpers the row GEMVs share)
_SOURCE = r"""
typedef unsigned char u8;

#define THREADS (WARPS * 32)
#define ZERO_OFF 1024  // shared memory: [0, 1024) nested code table, [1024, 1088) zeros, then x, then the warps' sums
#define XS_OFF 1088

extern __shared__ __align__(16) unsigned char smem[];

// a shared-memory word at window address `addr` (volatile: never above the barrier after the table's build)
static __device__ __forceinline__ u32 lds(u32 addr) {
  u32 v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

static __device__ __forceinline__ U4 lds128(u32 addr) {
  U4 v;
  asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// byte j of a packed word -> the table word's address: MODE 1, the table at a 64 KiB boundary of the shared window,
// so one byte permute puts the byte into the lane's base address (base | byte << 8 | lane << 2); else the permute
// makes the offset and an add the address
#if MODE == 1
#define LUT_ADDR(w, j) __byte_perm(lanebase, (w), 0x3240 + 16 * (j))
#else
#define LUT_ADDR(w, j) (tabbase + __byte_perm(lane4, (w), 0x1140 + 16 * (j)))
#endif

// one mma step: bytes 2p, 2p + 1 of word wg (row g) and wh (row g + 8) against x's words xa, xb
#define DOT(c, wg, wh, p, xa, xb)                                                                              \
  {                                                                                                            \
    const u32 a0 = lds(LUT_ADDR(wg, 2 * (p))), a1 = lds(LUT_ADDR(wh, 2 * (p))),                              \
              a2 = lds(LUT_ADDR(wg, 2 * (p) + 1)), a3 = lds(LUT_ADDR(wh, 2 * (p) + 1));                      \
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "            \
        "{%0,%1,%2,%3};"                                                                                       \
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                                       \
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(xa), "r"(xb));                                               \
  }

// load u of rows g, g + 8 (16 bytes each) against x at xaddr (64 bytes: words 0-3, two steps each)
#define WORD_DOTS(c, wg, wh, xaddr)                                                                            \
  {                                                                                                            \
    const U4 xv = lds128(xaddr);                                                                               \
    DOT(c, wg, wh, 0, xv.x, xv.y) DOT(c, wg, wh, 1, xv.z, xv.w)                                                \
  }
#define LOAD_DOTS(c, qg, qh, xaddr)                                                                            \
  WORD_DOTS(c, qg.x, qh.x, xaddr) WORD_DOTS(c, qg.y, qh.y, (xaddr) + 16)                                       \
  WORD_DOTS(c, qg.z, qh.z, (xaddr) + 32) WORD_DOTS(c, qg.w, qh.w, (xaddr) + 48)

// a unit's place: row tile, group of 4 blocks
struct Cursor {
  int rt, G;
};

static __device__ __forceinline__ void cursor_next(Cursor& c, int KG) {
  if (++c.G == KG) { c.G = 0; ++c.rt; }
}

// the unit's four 16-byte loads and its two absmax codes (code of row g low byte, row g + 8 high byte)
static __device__ __forceinline__ void unit_loads(const Cursor& c, const u8* wq, const u8* ac, int g, int t, int N,
                                                  int KB, u32 rowb, U4* q, u32& code) {
  const int r0 = min(c.rt * 16 + g, N - 1), r1 = min(c.rt * 16 + g + 8, N - 1);  // rows g, g + 8 (clamped)
  const int b0 = 4 * c.G + (t >> 1), b1 = b0 + 2;  // the blocks of loads 0 and 1 (a missing block: the row's start)
  const u32 o0 = b0 < KB ? 128 * c.G + 16 * t : 0, o1 = b1 < KB ? 128 * c.G + 64 + 16 * t : 0;
  const u8* rg = wq + (size_t)((u32)r0 * rowb);
  const u8* rh = wq + (size_t)((u32)r1 * rowb);
  q[0] = ld_stream(reinterpret_cast<const U4*>(rg + o0)); q[1] = ld_stream(reinterpret_cast<const U4*>(rh + o0));
  q[2] = ld_stream(reinterpret_cast<const U4*>(rg + o1)); q[3] = ld_stream(reinterpret_cast<const U4*>(rh + o1));
  const int bj = min(4 * c.G + t, KB - 1);
  code = (u32)__ldg(ac + (size_t)((u32)r0 * (u32)KB + bj)) | ((u32)__ldg(ac + (size_t)((u32)r1 * (u32)KB + bj)) << 8);
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
nf4_tile_gemv(const u8* __restrict__ wq, const u8* __restrict__ ac, const float* __restrict__ na,
              const float* __restrict__ nc, const u32* __restrict__ pairs, const u16* __restrict__ x,
              const u16* __restrict__ res, u16* __restrict__ out, int N, int K, int RT,
              long long sxm, long long srm, long long som, float offset, float out_scale,
              int data_bytes, int dyn_bytes) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const long long m = blockIdx.y;
  const int KB = K >> 6, KG = (KB + 3) >> 2;
  const u32 rowb = (u32)K >> 1;
  const int rt0 = (int)((long long)blockIdx.x * RT / gridDim.x);
  const int rt1 = (int)((long long)(blockIdx.x + 1) * RT / gridDim.x);
  const int units = (rt1 - rt0) * KG;
  const int ua = (int)((long long)warp * units / WARPS), ub = (int)((long long)(warp + 1) * units / WARPS);
  const int count = ub - ua;

  // the first DEPTH units' loads go out before anything else (their DRAM round trip overlaps the tables' build)
  Cursor pc;
  pc.rt = rt0 + ua / KG; pc.G = ua % KG;
  U4 buf[DEPTH][4];
  u32 cbuf[DEPTH];
#pragma unroll
  for (int f = 0; f < DEPTH; ++f) {
    if (f < count) {
      unit_loads(pc, wq, ac, g, t, N, KB, rowb, buf[f], cbuf[f]);
      cursor_next(pc, KG);
    }
  }

  u32 sbase;
  asm("mov.u32 %0, smem;" : "=r"(sbase));
#if MODE == 1
  const u32 tab = (sbase + (u32)data_bytes + 0xffffu) & ~0xffffu;  // window address of the table
  if (tab - sbase + 65536u > (u32)dyn_bytes) __trap();
  const u32 lanebase = tab | ((u32)lane << 2);
#else
  const u32 tab = sbase + (u32)data_bytes;
  const u32 tabbase = tab, lane4 = (u32)lane << 2;
#endif
  {
    // the pair table (entry e's word for lane l at e * 256 + l * 4), nested code table, zeros, x in fp16
    u32* tw = reinterpret_cast<u32*>(smem + (tab - sbase));
    for (int i = tid; i < 256 * 32; i += THREADS) tw[(i >> 5) * 64 + (i & 31)] = __ldg(pairs + (i >> 5));
    float* ncs = reinterpret_cast<float*>(smem);
    for (int i = tid; i < 256; i += THREADS) ncs[i] = __ldg(nc + i);
    if (tid < 16) reinterpret_cast<u32*>(smem + ZERO_OFF)[tid] = 0u;
    const U4* xg = reinterpret_cast<const U4*>(x + m * sxm);
    U4* xs = reinterpret_cast<U4*>(smem + XS_OFF);
    for (int i = tid; i < KG * 32; i += THREADS) {
      U4 v = {0u, 0u, 0u, 0u};
      if (i < (K >> 3)) {
        v = ld_nc(xg + i);
#if X_BF16
        v.x = bf16x2_to_f16x2(v.x); v.y = bf16x2_to_f16x2(v.y); v.z = bf16x2_to_f16x2(v.z); v.w = bf16x2_to_f16x2(v.w);
#endif
      }
      xs[i] = v;
    }
  }
  __syncthreads();

  float* red = reinterpret_cast<float*>(smem + XS_OFF + KG * 512);  // [row tiles of this program][WARPS][16]
  const float* ncs = reinterpret_cast<const float*>(smem);
  // B lanes of column 4 u + 2 (t / 2) read x for load u (block 2 u + t / 2 of the unit), every other lane zeros
  const u32 xzero = sbase + ZERO_OFF, xlane = sbase + XS_OFF + 64 * t;
  const bool xon0 = g == 2 * (t >> 1), xon1 = g == 4 + 2 * (t >> 1);
  float acc0 = 0.f, acc1 = 0.f;  // rows g, g + 8: the sums of this lane's blocks (position t of each unit)
  Cursor cc;
  cc.rt = rt0 + ua / KG; cc.G = ua % KG;
  for (int base = 0; base < count; base += DEPTH) {
#pragma unroll
    for (int f = 0; f < DEPTH; ++f) {
      if (base + f < count) {
        // the slot's words are taken, then it is reloaded with unit base + f + DEPTH
        U4 q[4];
        q[0] = buf[f][0]; q[1] = buf[f][1]; q[2] = buf[f][2]; q[3] = buf[f][3];
        const u32 code = cbuf[f];
        if (base + f + DEPTH < count) {
          unit_loads(pc, wq, ac, g, t, N, KB, rowb, buf[f], cbuf[f]);
          cursor_next(pc, KG);
        }
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        const u32 xu = xlane + (u32)cc.G * 512u;
        const u32 xa0 = xon0 ? xu : xzero, xa1 = xon1 ? xu + 256u : xzero;
        LOAD_DOTS(c, q[0], q[1], xa0)
        LOAD_DOTS(c, q[2], q[3], xa1)
        // this lane's block of the unit (4 G + t), rows g and g + 8: decode the two absmaxes as the reference
        {
          const int bj = min(4 * cc.G + t, KB - 1);
          const int r0 = min(cc.rt * 16 + g, N - 1), r1 = min(cc.rt * 16 + g + 8, N - 1);
          const u32 i0 = (u32)r0 * (u32)KB + bj, i1 = (u32)r1 * (u32)KB + bj;
          const float s0 = __fadd_rn(__fmul_rn(ncs[code & 255u], __ldg(na + (i0 >> 8))), offset);
          const float s1 = __fadd_rn(__fmul_rn(ncs[code >> 8], __ldg(na + (i1 >> 8))), offset);
          acc0 = __fmaf_rn(c[0], s0, acc0);
          acc1 = __fmaf_rn(c[2], s1, acc1);
        }
        if (cc.G + 1 == KG || base + f + 1 == count) {  // the row tile's end (or the warp's): its rows kept
          float v0 = acc0 + __shfl_xor_sync(0xffffffffu, acc0, 1);
          float v1 = acc1 + __shfl_xor_sync(0xffffffffu, acc1, 1);
          v0 += __shfl_xor_sync(0xffffffffu, v0, 2);
          v1 += __shfl_xor_sync(0xffffffffu, v1, 2);
          if (t == 0) {
            red[((cc.rt - rt0) * WARPS + warp) * 16 + g] = v0;
            red[((cc.rt - rt0) * WARPS + warp) * 16 + g + 8] = v1;
          }
          acc0 = 0.f; acc1 = 0.f;
        }
        cursor_next(cc, KG);
      }
    }
  }
  __syncthreads();
  // a row's slots in warp order (its K order): only the warps whose (non-empty) unit range meets the row tile wrote
  // one; the others' slots hold whatever the shared memory held before
  for (int i = tid; i < (rt1 - rt0) * 16; i += THREADS) {
    const int row = rt0 * 16 + i, rtl = i >> 4;
    if (row < N) {
      float v = 0.f;
      for (int w = 0; w < WARPS; ++w) {
        const int wa = (int)((long long)w * units / WARPS), wb = (int)((long long)(w + 1) * units / WARPS);
        if (wa < wb && wa < (rtl + 1) * KG && wb > rtl * KG) v += red[(rtl * WARPS + w) * 16 + (i & 15)];
      }
      v *= out_scale;
#if HAS_RES
      v += load_out_type(res + m * srm + row);
#endif
      out[m * som + row] = to_out_type(v);
    }
  }
}
"""

_KERNELS: dict[tuple[int, ...], NvrtcKernel] = {}
_GRIDS: dict[tuple, tuple[int, int, int]] = {}
_TABLE_BYTES = 256 * 256  # 256 entries x (32 lanes' words + 32 unused): the byte lands in the address's second byte


def check_tile_config(config: tuple[int, int, int, int, int]) -> None:
    """ValueError unless `config` is a valid (warps, units in flight, mode, launch-bound programs, 0)."""
    warps, depth, mode, min_blocks, zero = config
    if not (1 <= warps <= 32 and 1 <= depth <= 4 and mode in MODES and 1 <= min_blocks <= 8 and zero == 0):
        raise ValueError(f"bad NF4 tile GEMV config {config}")


def _kernel(config: tuple[int, int, int, int, int], x_bf16: bool, out_bf16: bool, has_res: bool) -> NvrtcKernel:
    key = (*config, int(x_bf16), int(out_bf16), int(has_res))
    if key not in _KERNELS:
        warps, depth, mode, min_blocks, _ = config
        defines = {"WARPS": warps, "DEPTH": depth, "MODE": mode, "MIN_BLOCKS": min_blocks,
                   "X_BF16": int(x_bf16), "OUT_BF16": int(out_bf16), "HAS_RES": int(has_res)}  # fmt: skip
        _KERNELS[key] = NvrtcKernel(CUDA_HELPERS + _SOURCE, "nf4_tile_gemv", defines)
    return _KERNELS[key]


def shared_bytes(config: tuple[int, int, int, int, int], k: int, row_tiles_per_program: int) -> tuple[int, int]:
    """(data, dynamic) shared-memory bytes of a program: nested code table, zeros, x in fp16 (whole units) and the
    warps' row-tile sums (data), then the pair table (ALIGNED: at the next 64 KiB boundary of the shared window,
    whose start the kernel reads)."""
    warps, _, mode, _, _ = config
    kg = -(-k // UNIT_VALUES)
    data = -(-(1088 + kg * 512 + row_tiles_per_program * warps * 16 * 4) // 16) * 16
    return data, data + _TABLE_BYTES + (65536 if mode == ALIGNED else 0)


def nf4_tile_gemv(
    x: torch.Tensor,
    weight: NF4Weight,
    residual: torch.Tensor | None,
    config: tuple[int, int, int, int, int],
    *,
    prescaled: bool = False,
) -> torch.Tensor:
    """x [M, K] @ W[N, K]^T (+ residual [M, N]) -> [M, N] in the weight's dtype (bf16 or fp16), W read from its
    packed bytes; ValueError for a bad shape, dtype or config, or one that does not fit the device. `prescaled`
    (bf16 weights): x is fp16 holding the bf16 input times X_SCALE (as the RMSNorm / SiLU kernels write it). x is
    copied once when its rows do not start 16-byte aligned."""
    check_tile_config(config)
    m, k = x.shape
    n, wk = weight.shape
    x_dtype = torch.float16 if prescaled else weight.dtype
    if wk != k or m < 1 or x.dtype != x_dtype or weight.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nf4_tile_gemv takes [M, {wk}] 16-bit {x_dtype} rows, got {tuple(x.shape)} {x.dtype}")
    if prescaled and weight.dtype != torch.bfloat16:
        raise ValueError("a prescaled fp16 x goes with bf16 weights (fp16 x is read as it is)")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1 or residual.dtype != weight.dtype):
        raise ValueError(f"residual must be a [{m}, {n}] {weight.dtype} tensor with a contiguous last dim")
    packed = weight.packed
    if packed.stride() != (k // 2, 1) or packed.data_ptr() % 16:
        raise ValueError("nf4_tile_gemv reads contiguous packed rows that start 16-byte aligned")
    if x.stride(1) != 1 or x.data_ptr() % 16 or x.stride(0) % 8:
        x = x.contiguous().clone()  # a fresh allocation: aligned
    warps = config[0]
    rt = -(-n // TILE_ROWS)
    x_bf16 = x.dtype == torch.bfloat16
    has_res = residual is not None
    kernel = _kernel(config, x_bf16, weight.dtype == torch.bfloat16, has_res)
    dev = x.device
    grid_key = (config, x_bf16, weight.dtype, has_res, rt, k, dev.index)
    if grid_key not in _GRIDS:
        props = torch.cuda.get_device_properties(dev)
        sms = props.multi_processor_count
        data, dyn = shared_bytes(config, k, -(-rt // sms))  # sized for one program per multiprocessor or more
        optin = props.shared_memory_per_block_optin  # type: ignore[attr-defined]  # (PyTorch's stubs lack it)
        if dyn > optin:
            raise ValueError(f"NF4 tile GEMV config {config} needs {dyn} bytes of shared memory ({optin} allowed)")
        per_sm = kernel.blocks_per_sm(dev, 32 * warps, dyn)
        if per_sm < 1:
            raise ValueError(f"NF4 tile GEMV config {config} does not fit a multiprocessor")
        _GRIDS[grid_key] = (min(rt, per_sm * sms), data, dyn)
    programs, data, dyn = _GRIDS[grid_key]
    out = torch.empty((m, n), dtype=weight.dtype, device=dev)
    res = residual if residual is not None else out
    scale = 1.0 / X_SCALE if weight.dtype == torch.bfloat16 else 1.0
    ptr = ctypes.c_void_p
    args = [
        ptr(packed.data_ptr()), ptr(weight.absmax_codes.data_ptr()), ptr(weight.nested_absmax.data_ptr()),
        ptr(weight.nested_code.data_ptr()), ptr(weight.pair_words16.data_ptr()), ptr(x.data_ptr()),
        ptr(res.data_ptr()), ptr(out.data_ptr()), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(rt),
        ctypes.c_longlong(x.stride(0)), ctypes.c_longlong(res.stride(0)), ctypes.c_longlong(out.stride(0)),
        ctypes.c_float(weight.nested_offset), ctypes.c_float(scale), ctypes.c_int(data), ctypes.c_int(dyn),
    ]  # fmt: skip
    kernel.launch(dev, (programs, m, 1), 32 * warps, dyn, args)
    return out
