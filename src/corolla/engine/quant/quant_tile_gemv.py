"""The NF4 one-row GEMV on the matrix units: out[M, N] = x[M, K] @ W[N, K]^T (+ residual), each row on its own,
reading bitsandbytes' packed bytes and absmax codes in place (no repacked copy).

Tiles. The weight is read in units of 16 rows x 256 values (4 blocks of 64: 128 bytes of each row, one cache line).
Lane l = 4 g + t of a warp loads, of rows g and g + 8 of the unit, the 16 bytes 16 t .. 16 t + 15 and 64 + 16 t ..
64 + 16 t + 15 (four 16-byte loads: each instruction reads 64 contiguous bytes of 8 rows), and those bytes are the A
operand of 16 `mma.m16n8k16` steps as they stand: the k order inside an mma step is free as long as x (B) follows it,
so step (u, w, p) of lane t takes bytes 2p and 2p + 1 of word w of its u-th load of rows g and g + 8, i.e. values
256 G + 128 u + 32 t + 8 w + 4 p + [0, 4), and x's B fragment is those 4 values.

Dequantization: each packed byte is one shared-memory load of the NF4 pair table (quant_pair_table: the byte's two
levels as fp16x2, already the mma operand's register), the table 32 times over (one column per lane: no bank
conflict, 64 KiB), the byte put into the address by one byte permute (`__byte_perm`: byte << 8 | lane << 2), plus an
add of the table's base unless the table sits at a 64 KiB boundary of the shared window (ALIGNED). A word of 8 values
costs 4 permutes and 4 shared loads; its products and sums are one quarter of an `mma` (fp16 operands, fp32 sums).

Scales. B's 8 columns keep the unit's 4 blocks apart: lane t's load u is block 2 u + t / 2 of the unit, and the lanes
of column 4 u + 2 (t / 2) (g = 4 u + 2 (t / 2)) read x for it. A lane reads x for at most one load, so it reads those
64 bytes once per unit (four 16-byte shared loads; the lanes of no column keep zeros) and gives them to both loads'
steps; each load sums into its own accumulators, whose columns of the other load are never read (the same bits as
zeros there). After a unit lane (g, t) holds block t's sums of rows g and g + 8 (column 2 t of load t / 2) and
decodes only those two absmaxes (uint8 code -> nested code * second-level absmax + offset, in fp32 as the
reference).

Work. A program owns a contiguous range of 16-row tiles (balanced over a grid of as many programs as the device
holds at once); its units (row tile, group of 4 blocks), row-tile major, are cut into one contiguous equal range per
warp (every warp busy, at most one unit apart), which streams them with the next DEPTH units' 16-byte loads in
registers (the first issued before the tables are built): DEPTH + 1 register slots, unit j decoded from slot j mod
(DEPTH + 1) after the load of unit j + DEPTH went into the slot unit j - 1 left (no register copies). The pair
table's loads all go out before its first store (one L2 round trip); where a thread stages more than one word of
x (w_down's K), its words' loads go out X_BATCH at a time (`x_batch_for`). A warp's partial sum of a row tile goes
to its own shared-memory slot; the row's slots are added in warp order (K order) at the end: no atomics, the result
depends on the shape, config and device only, and a row never depends on another row.

The RMSNorm prologue (PROLOGUE_CODES; before w_qkv and w_gate_up where the tuner chose it): each program stages x and
the gain as they are, sums x's squares (each thread its words in order, the warp by a fixed butterfly, the warps in
order: every program forms the same 1/rms), normalizes x in place as triton_kernels.rms_norm rounds it, then converts
it as a plain x (nvrtc_kernels' stage_x, int8_row_mma's staging too): the step launches no norm kernel (bit-equal
to the norm kernel + this GEMV at Llama-3-8B's shapes on an H200, docs/decisions/0043).

The experts form (EXPERTS, `nf4_tile_gemv_experts`): a layer's E NF4 weights of one shape; program row a reads its
weight's index from the routes after the wait (written by the router ahead), its addresses from the [4, E] table, and
x row a / xdiv (engine.moe.moe_nf4_tile: the routed experts at a few tokens). With GROUPED (steps of several
tokens), up to GROUP_ROWS (4) assignment rows of one weight per program row: after the wait each warp reads the
routes and finds its program row's group (`expert_groups`); each mma step of a load then uses all 8 columns of B,
column 4 h + q the group's row q against block h of the load (the one-row form uses one column per block), each
lane reads x of both loads (load 1's after load 0's steps, into the same registers) and decodes the absmaxes of its
two blocks: the weight's bytes are read once for the group, each row's bits those of the one-row form (a column's
sums do not depend on the others; each row's blocks are summed and added as the one-row form adds them).

The gated form (`gated`, W = [gate | up], N a multiple of 32): the programs split the gate half's row tiles and
each takes the same tiles of the up half after its own, so a program holds both sums of each of its rows and writes
silu(gate) * up [M, N / 2] itself (gate and up rounded as stored, then gated as triton_kernels.silu_mul gates them):
no SiLU kernel before w_down, which reads half the bytes. Where the tuner chose it (quant_choices.tune_gated).

Numerics: fp16 levels (relative error <= 2^-11), x in fp16 (bf16 x times 2^-8, as the RMSNorm / SiLU kernels write
it prescaled, or converted here), products and sums in fp32 on the matrix units, then the block's fp32 absmax: within
the bf16 rounding of bitsandbytes' dequantized weights. Compiled at run time (nvrtc_kernels); CUDA-graph safe.
Importing needs no GPU; tests/helpers/kernel_emulation.py runs the kernel's data movement on CPU tensors."""

from __future__ import annotations

import ctypes

import torch

from corolla.engine.kernels.nvrtc_kernels import CUDA_HELPERS, NvrtcKernel
from corolla.engine.quant.prologues import PROLOGUES
from corolla.engine.quant.quant_weights import NF4_BLOCK_VALUES, NF4Weight

TILE_ROWS = 16
UNIT_VALUES = 4 * NF4_BLOCK_VALUES  # a unit's values per row (4 blocks, 128 packed bytes)
X_SCALE = 2.0**-8  # bf16 x into fp16: times this, the output times its inverse (RMSNorm / SiLU write x so prescaled)
# the prologues the kernel runs: none and RMSNorm in its x staging
RMSNORM = PROLOGUES["rmsnorm"]
PROLOGUE_CODES = (PROLOGUES["none"], RMSNORM)

# table modes: the table after the data (a permute and an add per lookup) or at a 64 KiB boundary of the shared
# window (one permute per lookup; one program per multiprocessor). Units staged through shared memory by cp.async
# lost to registers on every shape (docs/decisions/0031).
REGISTERS, ALIGNED = 0, 1
MODES = (REGISTERS, ALIGNED)
# the shared window's bytes before a program's dynamic shared memory (1 KiB reserved on sm_80 and later, reported
# as the kernel's static shared memory): ALIGNED places the table at the first 64 KiB boundary after the data
WINDOW_RESERVED_BYTES = 1024
GROUP_ROWS = 4  # the experts' grouped form: up to this many assignment rows of one weight per program row
X_BATCH = 4  # x's words a thread loads at once where it stages more than one (x_batch_for)

# (warps per program, units in flight per warp, table mode, programs per multiprocessor the compiler is told to fit,
# 0): threads per program 32 x warps. On an H200 (docs/decisions/0060, 0043) 16 warps with 2 units in flight won all
# four Llama-3-8B projections; the best two-programs tiling is kept for cards where a 128 KiB window does not fit.
# Not offered (0043: 4-18% slower on every shape): 16 warps x 3 units, 12 x 3, 8 x 3, 8 x 4; 32 warps x 1 unit and
# 24 x 2 spill.
NF4_TILE_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = ((16, 2, ALIGNED, 1, 0), (8, 2, REGISTERS, 2, 0))


# the kernel, compiled after nvrtc_kernels.CUDA_HELPERS (the helpers the row GEMVs share)
_SOURCE = r"""
typedef unsigned char u8;

#define THREADS (WARPS * 32)
#define SLOTS (DEPTH + 1)  // register slots of units: DEPTH in flight while one is decoded
#define XS_OFF 1024  // shared memory: [0, 1024) nested code table, then x, then the warps' sums
// GROUPED places the warps' sums after the group's GROUP x with no room for the RMSNorm prologue's gain (the
// experts form runs no prologue): a build with both would overlap them
static_assert(!(GROUPED && PRO), "the grouped experts form runs no RMSNorm prologue");

extern __shared__ __align__(16) unsigned char smem[];

// a shared-memory word at window address `addr` (volatile: never above the barrier after the table's build)
static __device__ __forceinline__ u32 lds(u32 addr) {
  u32 v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

// 16 bytes of shared memory into v where `on` (else v keeps its value: the lanes that read no x keep zeros)
static __device__ __forceinline__ void lds128_if(U4& v, u32 addr, u32 on) {
  asm volatile("{.reg .pred p; setp.ne.u32 p, %4, 0; @p ld.shared.v4.b32 {%0,%1,%2,%3}, [%5];}"
               : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w) : "r"(on), "r"(addr));
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

// load u of rows g, g + 8 (16 bytes each, words w = 0..3, two steps each) against the lane's x words xv[w]
#define LOAD_DOTS(c, qg, qh, xv)                                                                               \
  DOT(c, qg.x, qh.x, 0, xv[0].x, xv[0].y) DOT(c, qg.x, qh.x, 1, xv[0].z, xv[0].w)                              \
  DOT(c, qg.y, qh.y, 0, xv[1].x, xv[1].y) DOT(c, qg.y, qh.y, 1, xv[1].z, xv[1].w)                              \
  DOT(c, qg.z, qh.z, 0, xv[2].x, xv[2].y) DOT(c, qg.z, qh.z, 1, xv[2].z, xv[2].w)                              \
  DOT(c, qg.w, qh.w, 0, xv[3].x, xv[3].y) DOT(c, qg.w, qh.w, 1, xv[3].z, xv[3].w)

// a unit's place (row tile, group of 4 blocks) and its rows' offsets (rows g and g + 8, clamped to N - 1: bytes
// from the weight's start and absmax indices of the row's first block), kept from one unit to the next
struct Cursor {
  int lt, G;  // the program's row tile (0, 1, ...: Tiles) and group
  u32 b0, b1, a0, a1;
};

// a program's row tiles: span tiles from rt0, and (GATED) the same tiles of the up half (up tiles on) after them
struct Tiles {
  int rt0, span, up;
};

static __device__ __forceinline__ int weight_tile(const Tiles& p, int lt) {
  return lt < p.span ? p.rt0 + lt : p.up + p.rt0 + lt - p.span;
}

static __device__ __forceinline__ void cursor_rows(Cursor& c, const Tiles& p, int g, int N, int KB, u32 rowb) {
  const int rt = weight_tile(p, c.lt);
  const u32 r0 = (u32)min(rt * 16 + g, N - 1), r1 = (u32)min(rt * 16 + g + 8, N - 1);
  c.b0 = r0 * rowb; c.b1 = r1 * rowb; c.a0 = r0 * (u32)KB; c.a1 = r1 * (u32)KB;
}

static __device__ __forceinline__ void cursor_start(Cursor& c, const Tiles& p, int unit, int KG, int g, int N, int KB,
                                                    u32 rowb) {
  c.lt = unit / KG; c.G = unit % KG;
  cursor_rows(c, p, g, N, KB, rowb);
}

static __device__ __forceinline__ void cursor_next(Cursor& c, const Tiles& p, int KG, int g, int N, int KB,
                                                   u32 rowb) {
  if (++c.G == KG) { c.G = 0; ++c.lt; cursor_rows(c, p, g, N, KB, rowb); }
}

// the unit's four 16-byte loads and its two absmax codes (code of row g low byte, row g + 8 high byte)
static __device__ __forceinline__ void unit_loads(const Cursor& c, const u8* wq, const u8* ac, int t, int KB,
                                                  U4* q, u32& code) {
  const int b0 = 4 * c.G + (t >> 1);  // the block of load 0 (load 1: + 2; a missing block reads the row's start)
  const u32 o0 = b0 < KB ? 128 * c.G + 16 * t : 0, o1 = b0 + 2 < KB ? 128 * c.G + 64 + 16 * t : 0;
  q[0] = ld_stream(reinterpret_cast<const U4*>(wq + c.b0 + o0));
  q[1] = ld_stream(reinterpret_cast<const U4*>(wq + c.b1 + o0));
  q[2] = ld_stream(reinterpret_cast<const U4*>(wq + c.b0 + o1));
  q[3] = ld_stream(reinterpret_cast<const U4*>(wq + c.b1 + o1));
#if GROUPED
  // (GROUPED: the lane's blocks of both loads, 4 G + t / 2 and 4 G + 2 + t / 2: rows g, g + 8 of each, bytes 0-3)
  const u32 bj0 = (u32)min(4 * c.G + (t >> 1), KB - 1), bj1 = (u32)min(4 * c.G + 2 + (t >> 1), KB - 1);
  code = (u32)__ldg(ac + (c.a0 + bj0)) | ((u32)__ldg(ac + (c.a1 + bj0)) << 8) |
         ((u32)__ldg(ac + (c.a0 + bj1)) << 16) | ((u32)__ldg(ac + (c.a1 + bj1)) << 24);
#else
  const u32 bj = (u32)min(4 * c.G + t, KB - 1);
  code = (u32)__ldg(ac + (c.a0 + bj)) | ((u32)__ldg(ac + (c.a1 + bj)) << 8);
#endif
}

// row r of the program's row tile lt: its warps' slots in warp order (its K order), only the warps whose (non-empty)
// unit range meets the tile (the others' slots hold whatever the shared memory held before)
static __device__ __forceinline__ float row_sum(const float* red, int lt, int r, int units, int KG) {
  float v = 0.f;
  for (int w = 0; w < WARPS; ++w) {
    const int wa = (int)((long long)w * units / WARPS), wb = (int)((long long)(w + 1) * units / WARPS);
    if (wa < wb && wa < (lt + 1) * KG && wb > lt * KG) v += red[(lt * WARPS + w) * 16 + r];
  }
  return v;
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
nf4_tile_gemv(const u8* __restrict__ wq, const u8* __restrict__ ac, const float* __restrict__ na,
              const float* __restrict__ nc, const u32* __restrict__ pairs, const u16* __restrict__ x,
              const u16* __restrict__ res, u16* __restrict__ out, const u16* __restrict__ nw, int N, int K, int RT,
              long long sxm, long long srm, long long som, float offset, float out_scale, float eps,
              int data_bytes, int dyn_bytes, const long long* __restrict__ experts,
              const float* __restrict__ offsets, const long long* __restrict__ routes, int E, int xdiv, int A) {
  grid_release();  // the next kernel's programs may start (they wait for this one's output: nvrtc_kernels)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
#if GROUPED
  // the group of assignment rows of program row blockIdx.y (read after the wait): m and mq[1..3] (-1: none)
  long long m = -1;
  int mq[GROUP] = {-1, -1, -1, -1};
#else
  const long long m = blockIdx.y;  // the output row (EXPERTS: the assignment; its x row is m / xdiv)
#endif
  const int KB = K >> 6, KG = (KB + 3) >> 2;
  const u32 rowb = (u32)K >> 1;
  // the programs split the row tiles (GATED: those of the gate half; a program takes the same tiles of the up half)
  const int RTS = GATED ? RT / 2 : RT;
  const int rt0 = (int)((long long)blockIdx.x * RTS / gridDim.x);
  const int rt1 = (int)((long long)(blockIdx.x + 1) * RTS / gridDim.x);
  const Tiles tiles = {rt0, rt1 - rt0, RT / 2};
  const int ntiles = (rt1 - rt0) * (1 + GATED);
  const int units = ntiles * KG;
  const int ua = (int)((long long)warp * units / WARPS), ub = (int)((long long)(warp + 1) * units / WARPS);
  const int count = ub - ua;

  // the first DEPTH units' loads go out before anything else (their DRAM round trip overlaps the tables' build;
  // EXPERTS: after the wait, once the row's expert is known)
  Cursor pc;
  cursor_start(pc, tiles, ua, KG, g, N, KB, rowb);
  U4 buf[SLOTS][4];
  u32 cbuf[SLOTS];
#define FIRST_LOADS                                                                                            \
  _Pragma("unroll") for (int f = 0; f < DEPTH; ++f) {                                                          \
    if (f < count) {                                                                                           \
      unit_loads(pc, wq, ac, t, KB, buf[f], cbuf[f]);                                                          \
      cursor_next(pc, tiles, KG, g, N, KB, rowb);                                                              \
    }                                                                                                          \
  }
#if !EXPERTS
  FIRST_LOADS
#endif

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
  // the warps' row sums [row tiles of this program][WARPS][16] (GROUPED: of the group's GROUP rows, one after the
  // other), after x (and with PRO 1 the gain; GROUPED: the group's GROUP x, one after the other)
  float* red = reinterpret_cast<float*>(smem + XS_OFF + KG * 512 * (GROUPED ? GROUP : 1 + PRO));
  {
    // the pair table (entry e's word for lane l at e * 256 + l * 4: every load issued before the first store, one
    // L2 round trip) and the nested code table: the weight's constants, built while the kernels ahead finish
    u32* tw = reinterpret_cast<u32*>(smem + (tab - sbase));
    constexpr int PER = (256 * 32 + THREADS - 1) / THREADS;
    u32 pw[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = tid + j * THREADS;
      pw[j] = i < 256 * 32 ? __ldg(pairs + (i >> 5)) : 0u;
    }
    float* ncs = reinterpret_cast<float*>(smem);
    for (int i = tid; i < 256; i += THREADS) ncs[i] = __ldg(nc + i);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = tid + j * THREADS;
      if (i < 256 * 32) tw[(i >> 5) * 64 + (i & 31)] = pw[j];
    }
  }
  grid_wait();  // x (and the residual) come from the kernels ahead; the weight and its tables above are immutable
#if GROUPED
  // the group of program row blockIdx.y (the routes are the router's, ahead): the A assignment rows in chunks of
  // 32, in each the rows of one expert grouped GROUP by GROUP in row order (every id outside [0, E) counts as one
  // more expert); group s is the s-th row that is the 1st, (GROUP + 1)-th, ... of its expert in its chunk, with the
  // next GROUP - 1 rows of that expert (those there are). Every warp finds it alone (no barrier). Rows past the last
  // group: nothing to do.
  {
    const u32 lower = (1u << lane) - 1u, higher = lane == 31 ? 0u : ~0u << (lane + 1);
    int seen = 0;  // the groups of the chunks before
    for (int c0 = 0; c0 < A && m < 0; c0 += 32) {
      const int a = c0 + lane;
      long long e = -1;  // (a row past A: never in `same`)
      if (a < A) {
        e = load_written_i64(routes + a);
        if (e < 0 || e >= E) e = E;  // every id outside [0, E): one key
      }
      const u32 same = __match_any_sync(0xffffffffu, e) & __ballot_sync(0xffffffffu, a < A);
      const bool head = a < A && __popc(same & lower) % GROUP == 0;
      const u32 heads = __ballot_sync(0xffffffffu, head);
      const u32 hit = __ballot_sync(0xffffffffu, head && seen + __popc(heads & lower) == (int)blockIdx.y);
      u32 next = same & higher;  // this key's rows after this lane's: its group's members are the first GROUP - 1
      int member[GROUP - 1];
#pragma unroll
      for (int j = 0; j < GROUP - 1; ++j) {
        member[j] = next ? c0 + __ffs(next) - 1 : -1;
        next &= next - 1u;
      }
      if (hit) {
        const int src = __ffs(hit) - 1;
        m = c0 + src;
#pragma unroll
        for (int j = 0; j < GROUP - 1; ++j) mq[j + 1] = __shfl_sync(0xffffffffu, member[j], src);
      }
      seen += __popc(heads);
    }
  }
  if (m < 0) return;
  mq[0] = (int)m;
#endif
#if EXPERTS
  // the row's expert (GROUPED: the group's; written by the router ahead): its codes, absmax codes, second-level absmaxes
  // and offset from the [4, E] address table (the nested code table, read above, is every expert's); an id outside
  // [0, E) gives zero rows
  {
    const long long e = load_written_i64(routes + m);
    if (e < 0 || e >= E) {
      if (blockIdx.x == 0)
        for (int i = tid; i < (GATED ? N / 2 : N); i += THREADS) {
          out[m * som + i] = to_out_type(0.f);
#if GROUPED
#pragma unroll
          for (int q = 1; q < GROUP; ++q)
            if (mq[q] >= 0) out[mq[q] * som + i] = to_out_type(0.f);
#endif
        }
      return;
    }
    wq = reinterpret_cast<const u8*>(experts[e]);
    ac = reinterpret_cast<const u8*>(experts[E + e]);
    na = reinterpret_cast<const float*>(experts[2 * E + e]);
    offset = __ldg(offsets + e);
  }
  FIRST_LOADS
#endif
  // x as the mma's fp16 operand, whole units (PRO 1: RMSNorm's result first, the gain after x; nvrtc_kernels'
  // stage_x); the warps' row sums are written after the barrier below
  const u16* xrow = x + (EXPERTS ? m / xdiv : m) * sxm;  // (EXPERTS: the row's token)
  stage_x<THREADS, X_BATCH>(reinterpret_cast<U4*>(smem + XS_OFF), reinterpret_cast<const U4*>(xrow), K, KG * 32,
                   reinterpret_cast<const U4*>(nw), reinterpret_cast<U4*>(smem + XS_OFF + KG * 512), red, eps);
#if GROUPED
#pragma unroll
  for (int q = 1; q < GROUP; ++q)  // the group's other x after the first, in order
    if (mq[q] >= 0)
      stage_x<THREADS, X_BATCH>(reinterpret_cast<U4*>(smem + XS_OFF + q * KG * 512),
                       reinterpret_cast<const U4*>(x + mq[q] / xdiv * sxm), K, KG * 32,
                       reinterpret_cast<const U4*>(nw), nullptr, red, eps);
#endif
  __syncthreads();

  const float* ncs = reinterpret_cast<const float*>(smem);
  // B: lane (g, t) gives column g. The lanes of column 4 u + 2 (t / 2) read x for load u (block 2 u + t / 2 of the
  // unit): a lane reads x for at most one load, so it loads that load's 64 bytes once per unit and gives them to
  // both loads' steps; each load has its own sums (c0, c1), whose other load's columns are never read. Every other
  // lane keeps zeros.
  // GROUPED: every load's steps use all 8 columns, column 4 h + q the group's row q against block h of the load
  // (its lanes t with t / 2 = h): lane (g, t) with g / 4 = t / 2 reads row g % 4's x of both loads (load 1's
  // after load 0's steps, into the same registers); C's column 2 t, 2 t + 1 of load u are then rows 2 (t % 2),
  // + 1 against block 2 u + t / 2: each lane decodes those two blocks' absmaxes of rows g and g + 8 and sums
  // each (load, row) apart (a column's sums do not depend on the others: a row's bits are the one-row form's)
#if GROUPED
  u32 present = 0u;  // bit q: the group has row q
#pragma unroll
  for (int q = 0; q < GROUP; ++q) present |= mq[q] >= 0 ? 1u << q : 0u;
  const u32 xon = (g >> 2) == (t >> 1) ? (present >> (g & 3)) & 1u : 0u;
  const u32 xlane = sbase + XS_OFF + 64 * t + (u32)(g & 3) * (u32)KG * 512u;
  // [load u][C register r]: rows 2 (t % 2) + (r & 1) of the group, weight rows g (r < 2) and g + 8
  float gacc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#else
  const bool xon0 = g == 2 * (t >> 1), xon1 = g == 4 + 2 * (t >> 1);
  const u32 xon = (xon0 || xon1) ? 1u : 0u;
  const u32 xlane = sbase + XS_OFF + 64 * t + (xon1 ? 256u : 0u);
#endif
  U4 xv[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) xv[w] = U4{0u, 0u, 0u, 0u};
#if !GROUPED
  float acc0 = 0.f, acc1 = 0.f;  // rows g, g + 8: the sums of this lane's blocks (position t of each unit)
#endif
  Cursor cc;
  cursor_start(cc, tiles, ua, KG, g, N, KB, rowb);
  // unit j decodes slot j % SLOTS while units j + 1 .. j + DEPTH are in flight; the load of unit j + DEPTH goes
  // into the slot unit j - 1 left (no register copies)
  for (int base = 0; base < count; base += SLOTS) {
#pragma unroll
    for (int f = 0; f < SLOTS; ++f) {
      if (base + f < count) {
        if (base + f + DEPTH < count) {
          unit_loads(pc, wq, ac, t, KB, buf[(f + DEPTH) % SLOTS], cbuf[(f + DEPTH) % SLOTS]);
          cursor_next(pc, tiles, KG, g, N, KB, rowb);
        }
        const u32 xu = xlane + (u32)cc.G * 512u;
#if GROUPED
        // load 0's steps on x of load 0, then load 1's on x of load 1 (the same registers)
        float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int w = 0; w < 4; ++w) lds128_if(xv[w], xu + 16 * w, xon);
        LOAD_DOTS(c0, buf[f][0], buf[f][1], xv)
#pragma unroll
        for (int w = 0; w < 4; ++w) lds128_if(xv[w], xu + 256 + 16 * w, xon);
        LOAD_DOTS(c1, buf[f][2], buf[f][3], xv)
        // this lane's blocks of the unit (load u: 4 G + 2 u + t / 2), rows g and g + 8: decode the four absmaxes
        // as the reference; each (load, C register) summed apart, as the one-row form sums each block
        {
          const u32 code = cbuf[f];
          const u32 bj0 = (u32)min(4 * cc.G + (t >> 1), KB - 1), bj1 = (u32)min(4 * cc.G + 2 + (t >> 1), KB - 1);
          const float s00 = __fadd_rn(__fmul_rn(ncs[code & 255u], __ldg(na + ((cc.a0 + bj0) >> 8))), offset);
          const float s01 = __fadd_rn(__fmul_rn(ncs[(code >> 8) & 255u], __ldg(na + ((cc.a1 + bj0) >> 8))), offset);
          const float s10 = __fadd_rn(__fmul_rn(ncs[(code >> 16) & 255u], __ldg(na + ((cc.a0 + bj1) >> 8))), offset);
          const float s11 = __fadd_rn(__fmul_rn(ncs[code >> 24], __ldg(na + ((cc.a1 + bj1) >> 8))), offset);
          gacc[0][0] = __fmaf_rn(c0[0], s00, gacc[0][0]);
          gacc[0][1] = __fmaf_rn(c0[1], s00, gacc[0][1]);
          gacc[0][2] = __fmaf_rn(c0[2], s01, gacc[0][2]);
          gacc[0][3] = __fmaf_rn(c0[3], s01, gacc[0][3]);
          gacc[1][0] = __fmaf_rn(c1[0], s10, gacc[1][0]);
          gacc[1][1] = __fmaf_rn(c1[1], s10, gacc[1][1]);
          gacc[1][2] = __fmaf_rn(c1[2], s11, gacc[1][2]);
          gacc[1][3] = __fmaf_rn(c1[3], s11, gacc[1][3]);
        }
        if (cc.G + 1 == KG || base + f + 1 == count) {  // the row tile's end (or the warp's): its rows kept
          // a row's four blocks as the one-row form adds them: (b0 + b1) + (b2 + b3); lanes t and t ^ 2 hold
          // the same rows, blocks t / 2 (load 0) and 2 + t / 2 (load 1)
          float* slot = red + (cc.lt * WARPS + warp) * 16;
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const float v = (gacc[0][r] + __shfl_xor_sync(0xffffffffu, gacc[0][r], 2)) +
                            (gacc[1][r] + __shfl_xor_sync(0xffffffffu, gacc[1][r], 2));
            // lanes t < 2: group row 2 t + (r & 1), weight row g (r < 2) or g + 8
            if (t < 2) slot[(2 * t + (r & 1)) * ntiles * WARPS * 16 + g + (r >> 1) * 8] = v;
            gacc[0][r] = 0.f;
            gacc[1][r] = 0.f;
          }
        }
#else
#pragma unroll
        for (int w = 0; w < 4; ++w) lds128_if(xv[w], xu + 16 * w, xon);
        float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
        LOAD_DOTS(c0, buf[f][0], buf[f][1], xv)
        LOAD_DOTS(c1, buf[f][2], buf[f][3], xv)
        // this lane's block of the unit (4 G + t: column 2 t of load t / 2), rows g and g + 8: decode the two
        // absmaxes as the reference
        {
          const u32 code = cbuf[f];
          const u32 bj = (u32)min(4 * cc.G + t, KB - 1);
          const u32 i0 = cc.a0 + bj, i1 = cc.a1 + bj;
          const float s0 = __fadd_rn(__fmul_rn(ncs[code & 255u], __ldg(na + (i0 >> 8))), offset);
          const float s1 = __fadd_rn(__fmul_rn(ncs[code >> 8], __ldg(na + (i1 >> 8))), offset);
          acc0 = __fmaf_rn(t < 2 ? c0[0] : c1[0], s0, acc0);
          acc1 = __fmaf_rn(t < 2 ? c0[2] : c1[2], s1, acc1);
        }
        if (cc.G + 1 == KG || base + f + 1 == count) {  // the row tile's end (or the warp's): its rows kept
          float v0 = acc0 + __shfl_xor_sync(0xffffffffu, acc0, 1);
          float v1 = acc1 + __shfl_xor_sync(0xffffffffu, acc1, 1);
          v0 += __shfl_xor_sync(0xffffffffu, v0, 2);
          v1 += __shfl_xor_sync(0xffffffffu, v1, 2);
          if (t == 0) {
            red[(cc.lt * WARPS + warp) * 16 + g] = v0;
            red[(cc.lt * WARPS + warp) * 16 + g + 8] = v1;
          }
          acc0 = 0.f; acc1 = 0.f;
        }
#endif
        cursor_next(cc, tiles, KG, g, N, KB, rowb);
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < (rt1 - rt0) * 16; i += THREADS) {
    const int row = rt0 * 16 + i, rtl = i >> 4;
    if (row < (GATED ? N / 2 : N)) {
#pragma unroll
      for (int q = 0; q < (GROUPED ? GROUP : 1); ++q) {  // (GROUPED: each row of the group from its own sums)
        const float* rq = red + q * ntiles * WARPS * 16;
#if GROUPED
        const long long row_m = mq[q];
        if (row_m < 0) continue;
#else
        const long long row_m = m;
#endif
        float v = row_sum(rq, rtl, i & 15, units, KG);
        v *= out_scale;
#if GATED
        // the up row's sum: the same row of the program's up tiles; gate and up rounded as the GEMV stores them,
        // then gated as silu_mul gates them
        v = silu_times(rounded(v), rounded(row_sum(rq, rtl + (rt1 - rt0), i & 15, units, KG) * out_scale));
#elif HAS_RES
        v += load_out_type(res + row_m * srm + row);
#endif
        out[row_m * som + row] = to_out_type(v);
      }
    }
  }
}
"""

_KERNELS: dict[tuple[int, ...], NvrtcKernel] = {}
_GRIDS: dict[tuple, tuple[int, int, int]] = {}
# a GEMV the attention releases at its start (`released`) runs on this share of the multiprocessors: its programs
# then all enter and build their tables while the attention still holds the others, instead of the last ones
# entering as it ends (112 of 132: a 1-row NF4 step 0.6-1.4% faster on an H100 and an H200, docs/decisions/0289)
RELEASED_PROGRAMS_SHARE = 0.85
_TABLE_BYTES = 256 * 256  # 256 entries x (32 lanes' words + 32 unused): the byte lands in the address's second byte


def grid_programs(row_tiles: int, sms: int, per_sm: int, *, released: bool = False) -> int:
    """The programs splitting `row_tiles` row tiles on `sms` multiprocessors that hold `per_sm` programs each: as
    many as fit, at most one a tile; `released` (the kernel ahead lets this one start at its own start): at most
    RELEASED_PROGRAMS_SHARE of one a multiprocessor, so that every program finds room beside the kernel ahead."""
    most = per_sm * sms if not released else max(1, int(sms * RELEASED_PROGRAMS_SHARE))
    return min(row_tiles, most)


def check_tile_config(config: tuple[int, int, int, int, int]) -> None:
    """ValueError unless `config` is a valid (warps, units in flight, mode, launch-bound programs, 0)."""
    warps, depth, mode, min_blocks, zero = config
    if not (1 <= warps <= 32 and 1 <= depth <= 4 and mode in MODES and 1 <= min_blocks <= 8 and zero == 0):
        raise ValueError(f"bad NF4 tile GEMV config {config}")


def x_batch_for(config: tuple[int, int, int, int, int], k: int) -> int:
    """x's 16-byte words a thread of `config` loads at once when it stages K = `k` values (stage_x's BATCH):
    X_BATCH where a thread has more than one word (w_down's K = 14336: one L2 round trip after the wait, not four),
    else 1 (one word a thread: the build without the batch, which compiles to faster code at K = 4096 on an H200,
    docs/decisions/0112)."""
    return X_BATCH if k // 8 > 32 * config[0] else 1


def tile_kernel(
    config: tuple[int, int, int, int, int],
    x_bf16: bool,
    out_bf16: bool,
    has_res: bool,
    prologue: int,
    gated: bool,
    experts: bool = False,
    grouped: bool = False,
    x_batch: int = 1,
) -> NvrtcKernel:
    """The kernel's build for these dtypes (bf16, else fp16), residual, prologue (PROLOGUE_CODES), gated and experts
    forms and x's words a thread loads at once (`x_batch`, `x_batch_for`) (one per process, compiled on its first
    launch; `grouped` with a prologue is refused when it compiles)."""
    key = (*config, int(x_bf16), int(out_bf16), int(has_res), prologue, int(gated), int(experts), int(grouped), x_batch)
    if key not in _KERNELS:
        warps, depth, mode, min_blocks, _ = config
        defines = {"WARPS": warps, "DEPTH": depth, "MODE": mode, "MIN_BLOCKS": min_blocks, "X_BF16": int(x_bf16),
                   "OUT_BF16": int(out_bf16), "HAS_RES": int(has_res), "PRO": prologue, "GATED": int(gated),
                   "EXPERTS": int(experts), "GROUPED": int(grouped), "GROUP": GROUP_ROWS,
                   "X_BATCH": x_batch}  # fmt: skip
        _KERNELS[key] = NvrtcKernel(CUDA_HELPERS + _SOURCE, "nf4_tile_gemv", defines)
    return _KERNELS[key]


def shared_bytes(
    config: tuple[int, int, int, int, int],
    k: int,
    row_tiles_per_program: int,
    prologue: int = 0,
    *,
    grouped: bool = False,
) -> tuple[int, int]:
    """(data, dynamic) shared-memory bytes of a program: nested code table, x in fp16 (whole units; with the
    RMSNorm prologue the gain beside it; `grouped`: the group's GROUP_ROWS x) and the warps' row-tile sums
    (`grouped`: of every row of the group) (data), then the pair table (ALIGNED: at the next 64 KiB boundary of the
    shared window, whose start the kernel reads: room for any start below 64 KiB; `grouped`, whose x of 4 rows at
    K 14336 would not fit so, for a start within WINDOW_RESERVED_BYTES, the kernel's; it traps where the table
    does not fit)."""
    warps, _, mode, _, _ = config
    kg = -(-k // UNIT_VALUES)
    rows = GROUP_ROWS if grouped else 1
    xs = kg * 512 * (rows + (prologue == RMSNORM))
    data = -(-(1024 + xs + rows * row_tiles_per_program * warps * 16 * 4) // 16) * 16
    if mode != ALIGNED:
        return data, data + _TABLE_BYTES
    if grouped:
        return data, -(-(WINDOW_RESERVED_BYTES + data) // 65536) * 65536 + _TABLE_BYTES
    return data, data + _TABLE_BYTES + 65536


def nf4_tile_gemv(
    x: torch.Tensor,
    weight: NF4Weight,
    residual: torch.Tensor | None,
    config: tuple[int, int, int, int, int],
    *,
    prescaled: bool = False,
    prologue: int = 0,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
    released: bool = False,
) -> torch.Tensor:
    """f(x) [M, K] @ W[N, K]^T (+ residual [M, N]) -> [M, N] in the weight's dtype (bf16 or fp16), W read from its
    packed bytes; f = `prologue` (PROLOGUE_CODES): the identity, or RMSNorm with gain `norm_weight` [K] and `eps`
    (rounded as triton_kernels.rms_norm rounds it). ValueError for a bad shape, dtype, prologue or config, or one
    that does not fit the device. `prescaled` (bf16 weights, no prologue): x is fp16 holding the bf16 input times
    X_SCALE (as the RMSNorm / SiLU kernels write it). `gated` (W = [gate | up], N a multiple of 32, no residual):
    silu(gate) * up [M, N / 2] instead, gate and up rounded as stored and gated as triton_kernels.silu_mul gates
    them (a program's up rows are its gate rows' own). `released`: the kernel ahead lets this one start at that
    kernel's start (the decode attention before w_o): at most RELEASED_PROGRAMS_SHARE of the multiprocessors' programs.
    x is copied once when its rows do not start 16-byte aligned."""
    check_tile_config(config)
    m, k = x.shape
    n, wk = weight.shape
    if prologue not in PROLOGUE_CODES or (prologue and prescaled):
        raise ValueError(f"nf4_tile_gemv runs no prologue {prologue} (prescaled: {prescaled})")
    if prologue and (
        norm_weight is None
        or norm_weight.shape != (k,)
        or norm_weight.stride(0) != 1
        or norm_weight.dtype != weight.dtype
        or norm_weight.data_ptr() % 16
    ):
        raise ValueError(f"the RMSNorm prologue needs a contiguous [{k}] {weight.dtype} gain starting 16-byte aligned")
    x_dtype = torch.float16 if prescaled else weight.dtype
    if wk != k or m < 1 or x.dtype != x_dtype or weight.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nf4_tile_gemv takes [M, {wk}] 16-bit {x_dtype} rows, got {tuple(x.shape)} {x.dtype}")
    if prescaled and weight.dtype != torch.bfloat16:
        raise ValueError("a prescaled fp16 x goes with bf16 weights (fp16 x is read as it is)")
    if gated and (n % (2 * TILE_ROWS) or residual is not None):
        raise ValueError(f"a gated nf4_tile_gemv takes N a multiple of {2 * TILE_ROWS} ({n}) and no residual")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1 or residual.dtype != weight.dtype):
        raise ValueError(f"residual must be a [{m}, {n}] {weight.dtype} tensor with a contiguous last dim")
    packed = weight.packed
    if packed.stride() != (k // 2, 1) or packed.data_ptr() % 16:
        raise ValueError("nf4_tile_gemv reads contiguous packed rows that start 16-byte aligned")
    if x.stride(1) != 1 or x.data_ptr() % 16 or x.stride(0) % 8:
        x = x.contiguous().clone()  # a fresh allocation: aligned
    out = torch.empty((m, n // 2 if gated else n), dtype=weight.dtype, device=x.device)
    res = residual if residual is not None else out
    gain = norm_weight if norm_weight is not None and prologue else out  # (not read without the prologue)
    kernel = tile_kernel(config, x.dtype == torch.bfloat16, weight.dtype == torch.bfloat16, residual is not None,
                     prologue, gated, x_batch=x_batch_for(config, k))  # fmt: skip
    ptr = ctypes.c_void_p
    weights = [ptr(packed.data_ptr()), ptr(weight.absmax_codes.data_ptr()), ptr(weight.nested_absmax.data_ptr())]
    no_experts = [ptr(0), ptr(0), ptr(0), ctypes.c_int(0), ctypes.c_int(1), ctypes.c_int(0)]
    _launch(kernel, config, x, weight, weights, res, out, gain, eps, weight.nested_offset, no_experts, prologue, gated,
            released=released)  # fmt: skip
    return out


def expert_groups(rows: int, num_weights: int) -> int:
    """The program rows of `nf4_tile_gemv_experts(grouped=True)` for `rows` assignment rows over `num_weights`
    weights: at most this many groups (per chunk of 32 rows, each key's rows grouped GROUP_ROWS by GROUP_ROWS in
    order, the ids outside [0, E) one more key: a key of c rows makes 1 + (c - 1) // GROUP_ROWS groups, so n rows
    over keys <= K = min(E + 1, n) make at most K + (n - K) // GROUP_ROWS)."""
    chunks = [min(32, rows - c) for c in range(0, rows, 32)]
    return sum(min(num_weights + 1, n) + (n - min(num_weights + 1, n)) // GROUP_ROWS for n in chunks)


def nf4_tile_gemv_experts(
    x: torch.Tensor,
    first: NF4Weight,
    addresses: torch.Tensor,
    offsets: torch.Tensor,
    routes: torch.Tensor,
    rows_per_x: int,
    config: tuple[int, int, int, int, int],
    *,
    gated: bool = False,
    grouped: bool = False,
) -> torch.Tensor:
    """The GEMV for a group of E NF4 weights of one shape (a layer's experts): output row a [A = routes.numel()] is
    x[a // rows_per_x] [K] @ W_e^T with e = routes[a] (int64 on the device, read by the kernel after the kernels ahead:
    no host sync, CUDA-graph safe), or zeros for e outside [0, E); `gated` as `nf4_tile_gemv`. `grouped`: up to
    GROUP_ROWS rows of one weight share a program row (`expert_groups`: that weight's bytes read once for them; for
    routes that repeat a weight: its fixed cost is a loss where they cannot, docs/decisions/0061, 0103). Each
    row's bits are those of `nf4_tile_gemv` on its own either way. W_e is found through
    `addresses` ([4, E] int64 on the device: packed codes, absmax codes, second-level absmaxes, (nested code table))
    and `offsets` ([E] fp32 absmax offsets); `first` gives every weight's shape, dtype, levels and nested code table
    (the caller checks that all E share them and that each one's codes are contiguous from 16-byte boundaries).
    -> [A, N] (gated: [A, N / 2]) in the weights' dtype. ValueError for a bad shape, dtype or config."""
    check_tile_config(config)
    n, k = first.shape
    e = addresses.shape[1] if addresses.ndim == 2 else 0
    if addresses.shape != (4, e) or addresses.dtype != torch.int64 or offsets.shape != (e,) or e < 1:
        raise ValueError(f"need a [4, E] int64 address table and [E] offsets, got {tuple(addresses.shape)}")
    a = routes.numel()
    if routes.dtype != torch.int64 or not routes.is_contiguous() or rows_per_x < 1 or x.shape[0] * rows_per_x < a:
        raise ValueError(f"routes must be contiguous int64 for {x.shape[0]} x {rows_per_x} rows, got {routes.shape}")
    if x.ndim != 2 or x.shape[1] != k or x.dtype != first.dtype or first.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nf4_tile_gemv_experts takes [R, {k}] 16-bit {first.dtype} rows, got {tuple(x.shape)}")
    if gated and n % (2 * TILE_ROWS):
        raise ValueError(f"a gated nf4_tile_gemv_experts takes N a multiple of {2 * TILE_ROWS} ({n})")
    if x.stride(1) != 1 or x.data_ptr() % 16 or x.stride(0) % 8:
        x = x.contiguous().clone()  # a fresh allocation: aligned
    out = torch.empty((a, n // 2 if gated else n), dtype=first.dtype, device=x.device)
    kernel = tile_kernel(
        config, x.dtype == torch.bfloat16, first.dtype == torch.bfloat16, False, 0, gated, True, grouped,
        x_batch_for(config, k),
    )  # fmt: skip
    ptr = ctypes.c_void_p
    experts = [ptr(addresses.data_ptr()), ptr(offsets.data_ptr()), ptr(routes.data_ptr()), ctypes.c_int(e),
               ctypes.c_int(rows_per_x), ctypes.c_int(a)]  # fmt: skip
    _launch(kernel, config, x, first, [ptr(0), ptr(0), ptr(0)], out, out, out, 0.0, 0.0, experts, 0, gated,
            expert_groups(a, e) if grouped else 0)  # fmt: skip
    return out


def _launch(
    kernel: NvrtcKernel,
    config: tuple[int, int, int, int, int],
    x: torch.Tensor,
    weight: NF4Weight,
    weights: list,
    res: torch.Tensor,
    out: torch.Tensor,
    gain: torch.Tensor,
    eps: float,
    offset: float,
    experts: list,
    prologue: int,
    gated: bool,
    groups: int = 0,
    *,
    released: bool = False,
) -> None:
    # one program row per output row (`groups` > 0, GROUPED: per group of rows, that many): `weights` (codes, absmax
    # codes, second-level absmaxes; null with EXPERTS: read from the address table `experts` holds) and `experts`
    # (address table, offsets, routes, E, rows per x row, rows)
    warps = config[0]
    n, k = weight.shape
    rt = -(-n // TILE_ROWS)
    dev = x.device
    split = rt // 2 if gated else rt  # the row tiles the programs split (gated: a program takes their up tiles too)
    # (the kernel: its config, dtypes, residual, prologue, gated, experts)
    grid_key = (id(kernel), rt, k, dev.index, released)
    if grid_key not in _GRIDS:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        # sized for the row tiles of a program of the grid at one program a multiprocessor (or more)
        data, dyn = shared_bytes(
            config, k, -(-split // grid_programs(split, sms, 1, released=released)) * (2 if gated else 1), prologue,
            grouped=bool(kernel.defines["GROUPED"]),
        )  # fmt: skip
        per_sm = kernel.blocks_per_sm(dev, 32 * warps, dyn)  # (ValueError past the device's shared memory)
        if per_sm < 1:
            raise ValueError(f"NF4 tile GEMV config {config} does not fit a multiprocessor")
        _GRIDS[grid_key] = (grid_programs(split, sms, per_sm, released=released), data, dyn)
    programs, data, dyn = _GRIDS[grid_key]
    scale = 1.0 / X_SCALE if weight.dtype == torch.bfloat16 else 1.0
    ptr = ctypes.c_void_p
    args = [
        *weights, ptr(weight.nested_code.data_ptr()), ptr(weight.pair_words16.data_ptr()), ptr(x.data_ptr()),
        ptr(res.data_ptr()), ptr(out.data_ptr()), ptr(gain.data_ptr()),
        ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(rt),
        ctypes.c_longlong(x.stride(0)), ctypes.c_longlong(res.stride(0)), ctypes.c_longlong(out.stride(0)),
        ctypes.c_float(offset), ctypes.c_float(scale), ctypes.c_float(eps), ctypes.c_int(data), ctypes.c_int(dyn),
        *experts,
    ]  # fmt: skip
    kernel.launch(dev, (programs, groups or out.shape[0], 1), 32 * warps, dyn, args)
