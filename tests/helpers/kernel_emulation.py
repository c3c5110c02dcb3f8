"""CPU twins of GPU kernels, for the unit tests: the NF4 tile GEMV's data movement
(engine/quant/quant_tile_gemv.py) through the PTX fragment layout of `mma.m16n8k16` and its experts' grouping of
assignment rows, and the NF4 register lookup's instruction sequences (engine/quant/quant_prmt.py's DECODE16_PROGRAM
and SCALED_TABLE_PROGRAM) on CPU integers."""

from __future__ import annotations

import struct

import torch

from corolla.engine.quant import quant_prmt
from corolla.engine.quant.quant_tile_gemv import GROUP_ROWS, TILE_ROWS, UNIT_VALUES, X_SCALE
from corolla.engine.quant.quant_weights import NF4_BLOCK_VALUES, NF4Weight

MASK32 = 0xFFFFFFFF


def warp_units(units: int, warps: int, warp: int) -> tuple[int, int]:
    """The contiguous range [first, end) of a program's `units` (row tile, group) units that warp `warp` of
    `warps` streams (as the kernel cuts them)."""
    return warp * units // warps, (warp + 1) * units // warps


def program_row_tiles(row_tiles: int, programs: int, program: int) -> tuple[int, int]:
    """The contiguous range [first, end) of the weight's 16-row tiles that program `program` of `programs` owns."""
    return program * row_tiles // programs, (program + 1) * row_tiles // programs


def emulate_tile_gemv(
    x: torch.Tensor, weight: NF4Weight, warps: int, programs: int, gated: bool = False, grouped: bool = False
) -> torch.Tensor:
    """The kernel's data movement on CPU (float64 sums): x [M, K] -> [M, N] (`gated`: silu(gate) * up [M, N / 2] of
    the gated form's sums, the programs' row tiles those of the gate half and then their up tiles, not rounded as
    stored). Per program and warp the kernel's
    units; per unit, each mma step's A fragment built from the bytes lane (g, t) loads (rows g and g + 8, loads u at
    bytes 128 G + 64 u + 16 t) and its B fragment from the x the kernel's lanes hold (a lane of column 4 v + 2 (t /
    2) the x of load v, in both loads' steps; zeros elsewhere), multiplied by the PTX fragment layout of m16n8k16
    into each load's own sums; lane (g, t)'s column 2 t of load t / 2's sums scaled by its block's absmax; each
    warp's partial sum of a row tile in its slot, the slots added in warp order (a check of the indexing and of the
    work's coverage, not of rounding). `grouped` (the experts' GROUPED form, x [R <= GROUP_ROWS, K]: R rows of one
    weight): every load's steps use all 8 columns, column 4 h + q holding row q's x at the k slots of the lanes t
    with t / 2 = h (lane (col, t) gives it for both loads); lane (g, t)'s columns 2 t, 2 t + 1 of load u's sums are
    rows 2 (t % 2), + 1 against block 2 u + t / 2, scaled by that block's absmax."""
    n, k = weight.shape
    kb = k // NF4_BLOCK_VALUES
    kg = -(-kb // 4)
    rts = -(-n // TILE_ROWS)
    m = x.shape[0]
    assert not grouped or m <= GROUP_ROWS
    pair_lo = weight.code.half().double()  # the pair table: byte b -> (level(b >> 4) low, level(b & 15) high)
    absmax = weight.block_absmax().double().reshape(n, kb)
    xs = (x.float() * X_SCALE).half().double() if x.dtype == torch.bfloat16 else x.double()  # [M, K] as staged
    xs = torch.nn.functional.pad(xs, (0, kg * UNIT_VALUES - k))  # zeros past K
    packed = weight.packed.long()
    g = torch.arange(8)
    out = torch.zeros(m, rts * TILE_ROWS, dtype=torch.float64)
    for prog in range(programs):
        rt0, rt1 = program_row_tiles(rts // 2 if gated else rts, programs, prog)
        tiles = [*range(rt0, rt1), *(range(rt0 + rts // 2, rt1 + rts // 2) if gated else ())]  # by local tile
        units = len(tiles) * kg
        # [local tile, warp, M, row]: NaN where no warp writes (the kernel's shared memory holds stale values there)
        slots = torch.full((len(tiles), warps, m, TILE_ROWS), float("nan"), dtype=torch.float64)
        for wp in range(warps):
            first, end = warp_units(units, warps, wp)
            for unit in range(first, end):
                lt, gi = unit // kg, unit % kg
                rt = tiles[lt]
                rg = (rt * TILE_ROWS + g).clamp(max=n - 1)  # [8] rows g and g + 8 (padding rows read the last)
                rh = (rt * TILE_ROWS + g + 8).clamp(max=n - 1)
                if unit == first or unit % kg == 0:  # the warp's first unit of a row tile: its slot starts at 0
                    slots[lt, wp] = 0.0
                # the mma sums of load 0 and of load 1, C [M, 16, 8] each
                c = torch.zeros(2, m, TILE_ROWS, 8, dtype=torch.float64)
                for u in range(2):
                    for w in range(4):
                        for p in range(2):
                            a = torch.zeros(TILE_ROWS, 16, dtype=torch.float64)  # A [16 rows, 16 k slots]
                            b = torch.zeros(m, 16, 8, dtype=torch.float64)  # B [M, 16 k slots, 8 columns]
                            gb = torch.zeros(16, 8, dtype=torch.float64)  # (grouped) B: columns 4 h + row
                            for t in range(4):
                                blk = 4 * gi + 2 * u + t // 2
                                off = 128 * gi + 64 * u + 16 * t if blk < kb else 0
                                for j, kofs in ((0, 0), (1, 8)):  # byte 2 p + j -> k slots 2 t + kofs, + 1
                                    bg = packed[rg, off + 4 * w + 2 * p + j]  # [8] row g's byte
                                    bh = packed[rh, off + 4 * w + 2 * p + j]
                                    a[g, 2 * t + kofs], a[g, 2 * t + kofs + 1] = pair_lo[bg >> 4], pair_lo[bg & 15]
                                    a[g + 8, 2 * t + kofs] = pair_lo[bh >> 4]
                                    a[g + 8, 2 * t + kofs + 1] = pair_lo[bh & 15]
                                if grouped:  # lanes (col, t) with col / 4 = t / 2: row col % 4's x of this load
                                    k0 = UNIT_VALUES * gi + 128 * u + 32 * t + 8 * w + 4 * p
                                    for q in range(m):
                                        col = 4 * (t // 2) + q
                                        gb[2 * t, col], gb[2 * t + 1, col] = xs[q, k0], xs[q, k0 + 1]
                                        gb[2 * t + 8, col], gb[2 * t + 9, col] = xs[q, k0 + 2], xs[q, k0 + 3]
                                    continue
                                # lane (col, t) gives B's column col: x of the one load it reads (col = 4 v + 2 (t /
                                # 2)), the same for both loads' steps; zeros where it reads none
                                for v in range(2):
                                    col = 4 * v + 2 * (t // 2)
                                    k0 = UNIT_VALUES * gi + 128 * v + 32 * t + 8 * w + 4 * p
                                    b[:, 2 * t, col], b[:, 2 * t + 1, col] = xs[:, k0], xs[:, k0 + 1]
                                    b[:, 2 * t + 8, col], b[:, 2 * t + 9, col] = xs[:, k0 + 2], xs[:, k0 + 3]
                            c[u] += a @ gb if grouped else torch.einsum("rk,mkc->mrc", a, b)
                if grouped:  # lane (g, t), load u: columns 2 t + j = row 2 (t % 2) + j, block 4 G + 2 u + t / 2
                    for t in range(4):
                        for u in range(2):
                            bj = min(4 * gi + 2 * u + t // 2, kb - 1)
                            scale = torch.cat((absmax[rg, bj], absmax[rh, bj]))  # [16]
                            for j in range(2):
                                if 2 * (t % 2) + j < m:
                                    slots[lt, wp, 2 * (t % 2) + j] += c[u, 0, :, 2 * t + j] * scale
                    continue
                for t in range(4):  # lane (g, t): column 2 t of load t / 2's sums, rows g and g + 8, times block
                    bj = min(4 * gi + t, kb - 1)  # 4 G + t's absmax (the other load's columns are never read)
                    scale = torch.cat((absmax[rg, bj], absmax[rh, bj]))  # [16]
                    slots[lt, wp] += c[t // 2, :, :, 2 * t] * scale
        for lt, rt in enumerate(tiles):  # the row's slots in warp order, only the warps whose range meets the tile
            for wp in range(warps):
                first, end = warp_units(units, warps, wp)
                if first < end and first < (lt + 1) * kg and end > lt * kg:
                    out[:, rt * TILE_ROWS : (rt + 1) * TILE_ROWS] += slots[lt, wp]
    out = out[:, :n] * (1 / X_SCALE if x.dtype == torch.bfloat16 else 1.0)
    if gated:
        out = torch.nn.functional.silu(out[:, : n // 2]) * out[:, n // 2 :]
    return out.to(x.dtype)


def emulate_expert_group(routes: list[int], num_weights: int, program_row: int) -> list[int]:
    """The assignment rows that program row `program_row` of the GROUPED experts' GEMV serves, by the warp's own
    steps on 32-bit lane masks (`__match_any_sync`, `__ballot_sync`, `__popc`, `__ffs`, `__shfl_sync`): per chunk of
    32 rows, lane a's key (its id, or E for an id outside [0, E); no key past the rows), `same` the lanes of its key,
    a head where the lanes of its key below it are a multiple of GROUP_ROWS, its members the next GROUP_ROWS - 1 set
    bits of `same` above it; the lane whose head is number `program_row` (counting the chunks before) gives its
    group. [] past the last group."""
    rows = len(routes)
    seen = 0
    for c0 in range(0, rows, 32):
        keys = [(e if 0 <= e < num_weights else num_weights) if c0 + a < rows else None for a, e in
                enumerate(routes[c0 : c0 + 32] + [0] * (32 - len(routes[c0 : c0 + 32])))]  # fmt: skip
        valid = sum(1 << a for a in range(32) if keys[a] is not None)  # ballot(a < A)
        same = [sum(1 << b for b in range(32) if keys[b] == keys[a]) & valid for a in range(32)]  # match_any & valid
        lower = [(1 << a) - 1 for a in range(32)]
        head = [keys[a] is not None and bin(same[a] & lower[a]).count("1") % GROUP_ROWS == 0 for a in range(32)]
        heads = sum(1 << a for a in range(32) if head[a])
        hit = sum(1 << a for a in range(32) if head[a] and seen + bin(heads & lower[a]).count("1") == program_row)
        if hit:
            src = (hit & -hit).bit_length() - 1  # __ffs(hit) - 1
            nxt = same[src] & ~((1 << (src + 1)) - 1) & MASK32  # same & higher
            members = [c0 + src]
            for _ in range(GROUP_ROWS - 1):
                if nxt:
                    members.append(c0 + (nxt & -nxt).bit_length() - 1)
                nxt &= nxt - 1
            return members
        seen += bin(heads).count("1")
    return []


def _prmt(a: int, b: int, sel: int) -> int:
    # PTX prmt.b32 default mode: byte i of d = byte (sel nibble i & 7) of the 8 bytes {b, a}, or that byte's sign
    # bit replicated when the nibble's bit 3 is set; only sel[15:0] is read
    src = ((b & MASK32) << 32) | (a & MASK32)
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _f16_to_f32(half_bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", half_bits & 0xFFFF))[0]


def emulate_decode16(word: int, table: tuple[int, ...], dtype: torch.dtype = torch.float16) -> list[float]:
    """Runs DECODE16_PROGRAM on one packed word and the table words: the 8 levels in element order, read from the
    16-bit halves of its 4 output words as `dtype` (fp16 or bf16, the table's type; the CPU twin of
    `quant_prmt.decode16_ptx`)."""
    regs = _run(quant_prmt.DECODE16_PROGRAM, word, table)
    halves = [(regs[f"e{t // 2}"] >> (16 * (t % 2))) & 0xFFFF for t in range(8)]
    if dtype == torch.float16:
        return [_f16_to_f32(h) for h in halves]
    signed = torch.tensor([h - (1 << 16) if h >= 1 << 15 else h for h in halves], dtype=torch.int16)
    return signed.view(dtype).float().tolist()


def emulate_scaled_table(levels: list[float], absmax: float, dtype: torch.dtype) -> tuple[int, ...]:
    """Runs SCALED_TABLE_PROGRAM on the fp32 levels and one block's fp32 absmax: the 8 table words (L0..L3, H0..H3)
    as unsigned 32-bit ints (mul.rn.f32 as fp32 multiplication, cvt.rn.{bf16,f16}x2.f32 as round-to-nearest-even
    conversion of each product, `dtype`'s bits in the low half for the second operand; the CPU twin of
    `quant_prmt.scaled_table_ptx`)."""
    vals: dict[str, torch.Tensor] = {f"c{i}": torch.tensor(v, dtype=torch.float32) for i, v in enumerate(levels)}
    vals["s"] = torch.tensor(absmax, dtype=torch.float32)
    regs: dict[str, int] = {}
    for op, dst, src in quant_prmt.SCALED_TABLE_PROGRAM:
        if op == "mul":
            vals[dst] = vals[str(src[0])] * vals[str(src[1])]  # fp32, round to nearest
        elif op == "cvt2":  # high half = src[0], low half = src[1]
            hi, lo = (int(vals[str(v)].to(dtype).view(torch.int16).item()) & 0xFFFF for v in src[:2])
            regs[dst] = hi << 16 | lo
        elif op == "prmt":
            regs[dst] = _prmt(regs[str(src[0])], regs[str(src[1])], int(src[2]))
        else:
            raise ValueError(f"unknown table op {op!r}")
    return tuple(regs[name] for name in quant_prmt.TABLE_OPERANDS)


def _run(
    program: tuple[tuple[str, str, tuple[str | int, ...]], ...], word: int, table: tuple[int, ...]
) -> dict[str, int]:
    # the instructions' documented semantics on CPU integers: the registers after the program
    regs: dict[str, int] = {"w": word & MASK32}
    regs.update({name: value & MASK32 for name, value in zip(quant_prmt.TABLE_OPERANDS, table, strict=True)})

    def val(x: str | int) -> int:
        return x if isinstance(x, int) else regs[x]

    for op, dst, src in program:
        if op == "and":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "shr":
            regs[dst] = (val(src[0]) & MASK32) >> val(src[1])
        elif op == "andor":
            regs[dst] = (val(src[0]) & val(src[1])) | val(src[2])
        elif op == "prmt":
            regs[dst] = _prmt(val(src[0]), val(src[1]), val(src[2]))
        else:
            raise ValueError(f"unknown decode op {op!r}")
    return regs
