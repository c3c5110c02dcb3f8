"""The NF4 tile GEMV for one-row decode steps: out[M, N] = x[M, K] @ W[N, K]^T (+ residual), each row on its own,
on the matrix units, from a copy of the weight repacked at load time (`tile_layout`; the codes are bitsandbytes'
bytes, permuted, so every dequantized value is the same).

Layout. The weight is cut into tiles of 16 rows x one 64-value block (512 packed bytes); lane l = 4 g + t of a warp
reads its tile's bytes 16 l .. 16 l + 15 with one 16-byte load (a warp reads the whole tile: 512 contiguous bytes),
and those bytes are the A operand of the tile's four `mma.m16n8k16` steps as they stand: for step s, the four bytes
of word s are rows (g, g + 8) of the byte pairs 8 t + 2 s and 8 t + 2 s + 1 of the block (two values each, as
bitsandbytes packs them). The k order inside a block is permuted the same way for x, so a lane's x for a block is its
16 contiguous values 16 t .. 16 t + 15 (two 16-byte shared-memory loads). The absmax codes are repacked 64 bytes per
group of 4 tiles: lane 4 g + t's byte pair holds rows (g, g + 8) of the group's block t.

Dequantization: each packed byte is one shared-memory load of the NF4 pair table (quant_pair_table: the byte's two
levels as fp16x2, already the mma operand's register), the table 32 times over (one column per lane: no bank
conflict, 64 KiB), the byte put into the address by one byte permute (`__byte_perm`: byte << 8 | lane << 2), plus an
add of the table's base unless the table sits at a 64 KiB boundary of the shared window (ALIGNED). A word of 8 values
costs 4 permutes and 4 shared loads; its products and sums are one quarter of an `mma` (fp16 operands, fp32 sums).

Scales. B's 8 columns are used to keep four consecutive blocks apart: block j of a group of 4 multiplies x in column
2 j (the lanes of other columns read zeros), so after a group lane (g, t) holds block t's sums of rows g and g + 8 and
decodes only those two absmaxes (uint8 code -> nested code * second-level absmax + offset, in fp32 as the reference)
instead of every lane decoding every block's. A row's four lanes are summed by two shuffles at the end of a row tile.

Work. A program (KS x RP warps) owns a contiguous range of row tiles (balanced over a grid of as many programs as
the device holds at once); warp (k split s, row slot r) owns the groups of 4 blocks [s KG / KS, (s + 1) KG / KS) of
the program's row tiles r, r + RP, ..., streaming them with the next 1-2 groups' 16-byte loads in registers (the first
issued before the tables are built), and the k splits' partial sums are added in split order through shared memory:
the result does not depend on the grid or RP, and a row never depends on another row. Served by the tuner when
EngineConfig.nf4_tile_copy allows the copy (docs/decisions/0031).

Numerics: fp16 levels (relative error <= 2^-11), x in fp16 (bf16 x times 2^-8, as quant_stream; or prescaled by the
RMSNorm / SiLU kernel), products and sums in fp32 on the matrix units, then the block's fp32 absmax: within the bf16
rounding of bitsandbytes' dequantized weights. Compiled at run time (nvrtc_kernels); CUDA-graph safe. Importing
needs no GPU; `emulate` is the kernel's arithmetic order on CPU tensors (tests/unit)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from corolla.engine.kernels.nvrtc_kernels import CUDA_HELPERS, NvrtcKernel
from corolla.engine.quant.quant_weights import NF4_BLOCK_VALUES, NF4Weight

TILE_ROWS = 16
LANES = 32
X_SCALE = 2.0**-8  # bf16 x into fp16: times this (as quant_stream.X_SCALE), the output times its inverse
ZERO_CODE = 0x77  # a padding row's byte: NF4 level 7 (0.0) twice

# table modes: the table after the data (a permute and an add per lookup) or at a 64 KiB boundary of the shared
# window (one permute per lookup; one program per multiprocessor). Groups staged through shared memory by cp.async
# (up to 6 in flight per warp, no registers held) lost to registers on every shape: docs/decisions/0030.
REGISTERS, ALIGNED = 0, 1
MODES = (REGISTERS, ALIGNED)

# (k splits: warps per row tile, row tiles a program works on at once, groups of 4 tiles in flight per warp, mode,
# programs per multiprocessor the compiler is told to fit): threads per program 32 x splits x row tiles
NF4_TILE_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    (8, 4, 1, ALIGNED, 1),
    (16, 2, 1, ALIGNED, 1),
    (4, 8, 1, ALIGNED, 1),
    (8, 3, 2, ALIGNED, 1),
    (8, 2, 1, REGISTERS, 2),
    (16, 1, 1, REGISTERS, 2),
    (4, 4, 1, REGISTERS, 2),
)


@dataclass(frozen=True)
class NF4Tiles:
    """An NF4 weight repacked for the tile GEMV."""

    tiles: torch.Tensor  # [RT, KB, 32, 16] uint8: per tile, lane l's 16 bytes (see the module docstring)
    codes: torch.Tensor  # [RT, KB / 4, 8, 4, 2] uint8: per group of 4 tiles, lane 4 g + t's absmax codes of rows
    # (g, g + 8) of the group's block t (64 bytes a group)
    n: int  # output features (rows past n in the last tile are padding)
    k: int


def tile_layout(weight: NF4Weight) -> NF4Tiles:
    """`weight`'s codes and absmax codes permuted into tiles (rows padded to a multiple of 16 and blocks to a
    multiple of 4 with level-7 bytes and code 0: their x is zero, so they add nothing)."""
    n, k = weight.shape
    kb = k // NF4_BLOCK_VALUES
    kbp = -(-kb // 4) * 4
    rt = -(-n // TILE_ROWS)
    packed = weight.packed
    codes = weight.absmax_codes.reshape(n, kb)
    if rt * TILE_ROWS != n or kbp != kb:
        packed = torch.nn.functional.pad(packed, (0, (kbp - kb) * 32, 0, rt * TILE_ROWS - n), value=ZERO_CODE)
        codes = torch.nn.functional.pad(codes, (0, kbp - kb, 0, rt * TILE_ROWS - n), value=0)
    # packed [RT, h, g, KB, t, s, e]: row 16 rt + 8 h + g, byte 8 t + 2 s + e of block b -> [rt, b, g, t, s, e, h]
    tiles = packed.reshape(rt, 2, 8, kbp, 4, 4, 2).permute(0, 3, 2, 4, 5, 6, 1).contiguous()
    # codes [RT, h, g, KG, t]: row 16 rt + 8 h + g, block 4 G + t -> [rt, G, g, t, h] (lane 4 g + t's pair)
    pairs = codes.reshape(rt, 2, 8, kbp // 4, 4).permute(0, 3, 2, 4, 1).contiguous()
    return NF4Tiles(tiles.reshape(rt, kbp, LANES, 16), pairs, n, k)


def tiles_of(weight: NF4Weight) -> NF4Tiles:
    """The weight's tile layout, made on the first call and kept on the weight (`NF4Weight.tile_copy`: as many bytes
    again as its codes)."""
    if not isinstance(weight.tile_copy, NF4Tiles):
        weight.tile_copy = tile_layout(weight)
    return weight.tile_copy


def emulate(x: torch.Tensor, weight: NF4Weight, tiles: NF4Tiles) -> torch.Tensor:
    """The kernel's values on CPU (float64 sums): x [M, K] -> [M, N], reading the tiles through the fragment
    mapping the kernel uses (a check of the layout and of which lane's x meets which byte, not of rounding)."""
    n, k = tiles.n, tiles.k
    rt, kb = tiles.tiles.shape[:2]
    levels = weight.code.half().double()  # [16] the pair table's fp16 levels
    absmax = torch.nn.functional.pad(weight.block_absmax().double().reshape(n, k // 64), (0, kb - k // 64))
    xs = (x.float() * X_SCALE).half().double() if x.dtype == torch.bfloat16 else x.double()  # [M, K]
    xs = torch.nn.functional.pad(xs, (0, kb * 64 - k))  # padded blocks meet zeros
    out = torch.zeros(x.shape[0], rt * TILE_ROWS, dtype=torch.float64)
    q = tiles.tiles.long()  # [RT, KB, 32, 16]
    hi_lv, lo_lv = levels[q >> 4], levels[q & 15]  # [RT, KB, 32, 16] the byte's even / odd value
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        for s in range(4):
            for byte, (row, kofs) in enumerate(((g, 0), (g + 8, 0), (g, 2), (g + 8, 2))):
                kk = 16 * t + 4 * s + kofs  # the block position of the byte's even value
                col = torch.arange(kb) * 64 + kk  # [KB]
                v = (
                    hi_lv[:, :, lane, 4 * s + byte] * xs[:, None, col]
                    + lo_lv[:, :, lane, 4 * s + byte] * xs[:, None, col + 1]
                )  # [M, RT, KB]
                rows = torch.arange(rt) * TILE_ROWS + row  # [RT]
                scale = absmax[rows.clamp(max=n - 1)]  # [RT, KB]
                out[:, rows] += (v * scale).sum(-1)
    scale_out = 1 / X_SCALE if x.dtype == torch.bfloat16 else 1.0
    return (out[:, :n] * scale_out).to(x.dtype)


# the kernel, compiled after nvrtc_kernels.CUDA_HELPERS (the helpers the row GEMVs share)
_SOURCE = r"""
#define THREADS (KS * RP * 32)
#define XS_OFF 1056  // shared memory: [0, 1024) nested code table, [1024, 1056) zeros, then x, then the warps' sums

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

#define DOT(c, w, xa, xb)                                                                                      \
  {                                                                                                            \
    const u32 a0 = lds(LUT_ADDR(w, 0)), a1 = lds(LUT_ADDR(w, 1)), a2 = lds(LUT_ADDR(w, 2)),                  \
              a3 = lds(LUT_ADDR(w, 3));                                                                        \
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "            \
        "{%0,%1,%2,%3};"                                                                                       \
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                                       \
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(xa), "r"(xb));                                               \
  }

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
nf4_tile_gemv(const U4* __restrict__ wt, const u16* __restrict__ ct, const float* __restrict__ na,
              const float* __restrict__ nc, const u32* __restrict__ pairs, const u16* __restrict__ x,
              const u16* __restrict__ res, u16* __restrict__ out, int N, int K, int KBP, int RT,
              int blocks, long long sxm, long long srm, long long som, float offset, float out_scale,
              int data_bytes, int dyn_bytes) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3, ks = warp % KS, rp = warp / KS;
  const long long m = blockIdx.y;
  const int KB = K >> 6;  // the weight's own blocks per row (KBP: padded to whole groups of 4)
  const int rt0 = (int)((long long)blockIdx.x * RT / gridDim.x);
  const int rt1 = (int)((long long)(blockIdx.x + 1) * RT / gridDim.x);
  const int KG = KBP >> 2;
  const int lo = 4 * (ks * KG / KS), hi = 4 * ((ks + 1) * KG / KS);  // this warp's blocks of each row tile
  const int tg = (hi - lo) >> 2;                                       // its groups of 4 per row tile
  const int rows = rt0 + rp < rt1 ? (rt1 - rt0 - rp + RP - 1) / RP : 0;  // row tiles rt0 + rp, + RP, ...
  const int groups = rows * tg;

  // the first PFG groups' loads go out before anything else (their DRAM round trip overlaps the tables' build)
  const U4* pw = wt + ((long long)(rt0 + rp) * KBP + lo) * 32 + lane;
  const u32* pc = reinterpret_cast<const u32*>(ct) + ((long long)(rt0 + rp) * KG + (lo >> 2)) * 16;  // 64 B a group
  const long long wstep = ((long long)RP * KBP - (hi - lo)) * 32, cstep = ((long long)RP * KG - tg) * 16;
  int p_gi = 0;
  u32 sbase;
  asm("mov.u32 %0, smem;" : "=r"(sbase));
  U4 buf[PFG][4];
  u32 cbuf[PFG];
#pragma unroll
  for (int f = 0; f < PFG; ++f) {
    if (f < groups) {
#pragma unroll
      for (int q = 0; q < 4; ++q) buf[f][q] = ld_stream(pw + 32 * q);
      cbuf[f] = __ldg(reinterpret_cast<const u16*>(pc) + lane);
      pw += 128; pc += 16;
      if (++p_gi == tg) { p_gi = 0; pw += wstep; pc += cstep; }
    }
  }

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
    if (tid < 8) reinterpret_cast<u32*>(smem + 1024)[tid] = 0u;
    const U4* xg = reinterpret_cast<const U4*>(x + m * sxm);
    U4* xs = reinterpret_cast<U4*>(smem + XS_OFF);
    for (int i = tid; i < KBP * 8; i += THREADS) {
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

  float* red = reinterpret_cast<float*>(smem + XS_OFF + KBP * 128);  // [row tiles of this program][KS][16]
  // lanes of column 2 j (g = 2 j) read x for tile j of a group, every other lane reads zeros
  const u32 xzero = sbase + 1024, xlane = sbase + XS_OFF + t * 32;
  float acc0 = 0.f, acc1 = 0.f;  // rows g, g + 8: the sums of this lane's blocks (position t of each group)
  int c_gi = 0, c_rt = rt0 + rp;
  for (int base = 0; base < groups; base += PFG) {
#pragma unroll
    for (int f = 0; f < PFG; ++f) {
      if (base + f < groups) {
        // each tile's words are taken, then its slot reloaded with the same tile of group base + f + PFG
        const bool more = base + f + PFG < groups;
        const u32 code = cbuf[f];
        if (more) cbuf[f] = __ldg(reinterpret_cast<const u16*>(pc) + lane);
#define TILE_WORDS(j)                                                                                          \
  const U4 q = buf[f][j];                                                                                      \
  if (more) buf[f][j] = ld_stream(pw + 32 * (j));
#define AFTER_TILES                                                                                            \
  if (more) {                                                                                                  \
    pw += 128; pc += 16;                                                                                       \
    if (++p_gi == tg) { p_gi = 0; pw += wstep; pc += cstep; }                                                  \
  }
        const int b0 = lo + 4 * c_gi;
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          TILE_WORDS(j)
          const u32 xa0 = g == 2 * j ? xlane + (u32)((b0 + j) * 128) : xzero;
          const U4 xa = lds128(xa0), xb = lds128(xa0 + 16);
          DOT(c, q.x, xa.x, xa.y) DOT(c, q.y, xa.z, xa.w) DOT(c, q.z, xb.x, xb.y) DOT(c, q.w, xb.z, xb.w)
        }
        AFTER_TILES
        // this lane's block of the group (b0 + t), rows g and g + 8: decode the two absmaxes as the reference
        {
          const int bj = b0 + t;
          const int r0 = min(c_rt * 16 + g, N - 1), r1 = min(c_rt * 16 + g + 8, N - 1);
          const int i0 = min(r0 * KB + bj, blocks - 1), i1 = min(r1 * KB + bj, blocks - 1);
          const float* ncs = reinterpret_cast<const float*>(smem);
          const float s0 = __fadd_rn(__fmul_rn(ncs[code & 255u], __ldg(na + (i0 >> 8))), offset);
          const float s1 = __fadd_rn(__fmul_rn(ncs[code >> 8], __ldg(na + (i1 >> 8))), offset);
          acc0 = __fmaf_rn(c[0], s0, acc0);
          acc1 = __fmaf_rn(c[2], s1, acc1);
        }
        if (++c_gi == tg) {  // the row tile's end: a row's 4 lanes summed (the same order in each), then kept
          float v0 = acc0 + __shfl_xor_sync(0xffffffffu, acc0, 1);
          float v1 = acc1 + __shfl_xor_sync(0xffffffffu, acc1, 1);
          v0 += __shfl_xor_sync(0xffffffffu, v0, 2);
          v1 += __shfl_xor_sync(0xffffffffu, v1, 2);
          if (t == 0) {
            red[((c_rt - rt0) * KS + ks) * 16 + g] = v0;
            red[((c_rt - rt0) * KS + ks) * 16 + g + 8] = v1;
          }
          acc0 = 0.f; acc1 = 0.f;
          c_gi = 0;
          c_rt += RP;
        }
#undef TILE_WORDS
#undef AFTER_TILES
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < (rt1 - rt0) * 16; i += THREADS) {
    const int row = rt0 * 16 + i;
    if (row < N) {
      float v = 0.f;
      for (int k = 0; k < KS; ++k) v += red[((i >> 4) * KS + k) * 16 + (i & 15)];
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
    """ValueError unless `config` is a valid (k splits, row tiles at once, groups in flight, mode, launch-bound
    programs)."""
    ks, rp, depth, mode, min_blocks = config
    if not (1 <= ks and 1 <= rp and ks * rp <= 32 and 1 <= depth <= 4 and mode in MODES and 1 <= min_blocks <= 8):
        raise ValueError(f"bad NF4 tile GEMV config {config}")


def _kernel(config: tuple[int, int, int, int, int], x_bf16: bool, out_bf16: bool, has_res: bool) -> NvrtcKernel:
    key = (*config, int(x_bf16), int(out_bf16), int(has_res))
    if key not in _KERNELS:
        ks, rp, depth, mode, min_blocks = config
        defines = {"KS": ks, "RP": rp, "PFG": depth, "MODE": mode, "MIN_BLOCKS": min_blocks,
                   "X_BF16": int(x_bf16), "OUT_BF16": int(out_bf16), "HAS_RES": int(has_res)}  # fmt: skip
        _KERNELS[key] = NvrtcKernel(CUDA_HELPERS + _SOURCE, "nf4_tile_gemv", defines)
    return _KERNELS[key]


def shared_bytes(config: tuple[int, int, int, int, int], kbp: int, row_tiles_per_program: int) -> tuple[int, int]:
    """(data, dynamic) shared-memory bytes of a program: nested code table, zeros, x in fp16 and the warps' row
    sums (data), then the pair table (ALIGNED: at the next 64 KiB boundary of the shared window, whose start the
    kernel reads)."""
    ks, _, _, mode, _ = config
    data = -(-(1056 + kbp * 128 + row_tiles_per_program * ks * 16 * 4) // 16) * 16
    return data, data + _TABLE_BYTES + (65536 if mode == ALIGNED else 0)


def nf4_tile_gemv(
    x: torch.Tensor,
    weight: NF4Weight,
    tiles: NF4Tiles,
    residual: torch.Tensor | None,
    config: tuple[int, int, int, int, int],
    *,
    prescaled: bool = False,
) -> torch.Tensor:
    """x [M, K] @ W[N, K]^T (+ residual [M, N]) -> [M, N] in the weight's dtype (bf16 or fp16), W read from its
    `tiles` (tile_layout(weight)); ValueError for a bad shape, dtype or config, or one that does not fit the device.
    `prescaled` (bf16 weights): x is fp16 holding the bf16 input times X_SCALE (as quant_stream's prescaled x). x is
    copied once when its rows do not start 16-byte aligned."""
    check_tile_config(config)
    m, k = x.shape
    n, wk = weight.shape
    x_dtype = torch.float16 if prescaled else weight.dtype
    if wk != k or m < 1 or x.dtype != x_dtype or weight.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nf4_tile_gemv takes [M, {wk}] 16-bit {x_dtype} rows, got {tuple(x.shape)} {x.dtype}")
    if prescaled and weight.dtype != torch.bfloat16:
        raise ValueError("a prescaled fp16 x goes with bf16 weights (fp16 x is read as it is)")
    if (tiles.n, tiles.k) != (n, k):
        raise ValueError(f"tiles of a {tiles.n}x{tiles.k} weight given for a {n}x{k} one")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1 or residual.dtype != weight.dtype):
        raise ValueError(f"residual must be a [{m}, {n}] {weight.dtype} tensor with a contiguous last dim")
    if x.stride(1) != 1 or x.data_ptr() % 16 or x.stride(0) % 8:
        x = x.contiguous().clone()  # a fresh allocation: aligned
    ks, rp = config[0], config[1]
    rt, kbp = tiles.tiles.shape[:2]
    if ks > kbp // 4:
        raise ValueError(f"{ks} k splits of {kbp // 4} groups of 4 blocks per row: each split needs one")
    x_bf16 = x.dtype == torch.bfloat16
    has_res = residual is not None
    kernel = _kernel(config, x_bf16, weight.dtype == torch.bfloat16, has_res)
    dev = x.device
    grid_key = (config, x_bf16, weight.dtype, has_res, rt, kbp, dev.index)
    if grid_key not in _GRIDS:
        props = torch.cuda.get_device_properties(dev)
        sms = props.multi_processor_count
        data, dyn = shared_bytes(config, kbp, -(-rt // sms))  # sized for one program per multiprocessor or more
        optin = props.shared_memory_per_block_optin  # type: ignore[attr-defined]  # (PyTorch's stubs lack it)
        if dyn > optin:
            raise ValueError(f"NF4 tile GEMV config {config} needs {dyn} bytes of shared memory ({optin} allowed)")
        per_sm = kernel.blocks_per_sm(dev, 32 * ks * rp, dyn)
        if per_sm < 1:
            raise ValueError(f"NF4 tile GEMV config {config} does not fit a multiprocessor")
        _GRIDS[grid_key] = (min(rt, per_sm * sms), data, dyn)
    programs, data, dyn = _GRIDS[grid_key]
    out = torch.empty((m, n), dtype=weight.dtype, device=dev)
    res = residual if residual is not None else out
    scale = 1.0 / X_SCALE if weight.dtype == torch.bfloat16 else 1.0
    ptr = ctypes.c_void_p
    args = [
        ptr(tiles.tiles.data_ptr()), ptr(tiles.codes.data_ptr()), ptr(weight.nested_absmax.data_ptr()),
        ptr(weight.nested_code.data_ptr()), ptr(weight.pair_words16.data_ptr()), ptr(x.data_ptr()),
        ptr(res.data_ptr()), ptr(out.data_ptr()), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(kbp),
        ctypes.c_int(rt), ctypes.c_int(weight.absmax_codes.numel()), ctypes.c_longlong(x.stride(0)),
        ctypes.c_longlong(res.stride(0)), ctypes.c_longlong(out.stride(0)), ctypes.c_float(weight.nested_offset),
        ctypes.c_float(scale), ctypes.c_int(data), ctypes.c_int(dyn),
    ]  # fmt: skip
    kernel.launch(dev, (programs, m, 1), 32 * ks * rp, dyn, args)
    return out
