"""The NF4 pair table: one shared-memory load decodes one packed byte (two 4-bit codes) into both fp16 levels.

bitsandbytes' byte j of a packed word holds code 2j in its high nibble and code 2j + 1 in its low one, so the byte is
an index into a 256-entry table of fp16x2 words (`pair_words16`: level(b >> 4) in the low half, level(b & 15) in
the high half, the even element low as in x's fp16x2 words). The streaming GEMV (quant_stream) copies the table into
shared memory once per program, 32 times over with entry e of lane l at word 32 e + l (32 KiB), so lane l always
reads bank l: a warp's 32 loads never conflict whatever the codes. One byte then costs a shift, a mask-and-or (its
address: byte << 7 | lane << 2) and one load, 12 instructions per word of 8 values with 4 of them shared loads,
against the register lookup's 21 integer instructions (16 byte permutes on the half-rate pipe: quant_prmt,
docs/decisions/0015). The products and sums are those of the register lookup's dot program it replaced, in the same
order and roundings (fp16x2 products, 4 terms per half, the halves added in fp32): the same bits (docs/decisions/0021).

`init_ptx` / `dot_ptx` write the programs as inline PTX for Triton (`tl.inline_asm_elementwise`: PTX declares the
table in the kernel's static shared memory); `emulate_dot` is the dot's CPU twin. Importing needs no GPU."""

from __future__ import annotations

import struct

import torch

TABLE_NAME = "corolla_nf4_pairs"  # the kernel-scope .shared array (one per kernel that inits it)
ENTRIES = 256
LANES = 32
TABLE_BYTES = ENTRIES * LANES * 4  # 32 KiB of static shared memory per program


def pair_words16(code: torch.Tensor) -> torch.Tensor:
    """[16] levels -> [256] int32 fp16x2 words: entry b holds fp16(level(b >> 4)) in its low half and
    fp16(level(b & 15)) in its high half (ValueError unless 16 finite levels fp16 holds)."""
    if code.numel() != 16:
        raise ValueError(f"the NF4 pair table takes 16 levels, got {code.numel()}")
    levels = code.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(levels).all()) or float(levels.abs().max()) > 65504.0:
        raise ValueError("NF4 levels must be finite and within fp16 range")
    bits = levels.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF  # [16]
    words = (bits[:, None] | (bits[None, :] << 16)).reshape(ENTRIES)  # [256]: row = high nibble = even element
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def init_ptx(warps: int) -> str:
    """Inline PTX that declares the table in shared memory and fills it from the [256] int32 words at $1 (16-byte
    aligned; $0 an unused output): warp w copies entry groups w, w + warps, ... of 4, each lane its own column,
    then the program waits at a barrier. Must run exactly once per thread (a [32 warps] tensor of one element per
    thread), before any `dot_ptx`."""
    if warps < 1 or ENTRIES % (4 * warps):
        raise ValueError(f"the pair table is copied by 1 to 64 warps dividing 64, got {warps}")
    lines = [
        f".shared .align 16 .b32 {TABLE_NAME}[{ENTRIES * LANES}];",
        "{",
        ".reg .b32 %t, %lane, %warp, %s, %v0, %v1, %v2, %v3; .reg .b64 %g, %off;",
        "mov.u32 %t, %tid.x; and.b32 %lane, %t, 31; shr.u32 %warp, %t, 5;",
        # %s: this lane's column of the warp's first group (word 32 * 4 warp + lane); %g: the group's 16 bytes
        f"mov.u32 %s, {TABLE_NAME}; shl.b32 %t, %warp, 9; add.u32 %s, %s, %t; shl.b32 %t, %lane, 2; "
        "add.u32 %s, %s, %t;",
        "mul.wide.u32 %off, %warp, 16; add.u64 %g, $1, %off;",
    ]
    for i in range(ENTRIES // (4 * warps)):
        lines.append(f"ld.global.nc.v4.u32 {{%v0, %v1, %v2, %v3}}, [%g + {i * warps * 16}];")
        for k in range(4):
            lines.append(f"st.shared.u32 [%s + {i * warps * 512 + k * 128}], %v{k};")
    lines += ["bar.sync 0;", "mov.u32 $0, 0;", "}"]
    return "\n".join(lines)


INIT_CONSTRAINTS = "=r,l"

# one packed word ($1) against x as 4 fp16x2 words ($2..$5): byte j's address (byte << 7 | lane << 2, plus the
# table's base) is a shift and a mask-and-or, its entry one shared load; then 4 fp16x2 products summed per half
_SHIFTS = ("shl.b32 %a0, $1, 7;", "shr.u32 %a1, $1, 1;", "shr.u32 %a2, $1, 9;", "shr.u32 %a3, $1, 17;")


def dot_ptx() -> str:
    """The dot program as inline PTX: output $0 (the fp32 sum), inputs $1 (the word) and $2..$5 (x)."""
    lines = [
        "{",
        ".reg .b32 %l, %b, %a0, %a1, %a2, %a3, %p0, %p1, %p2, %p3, %h; .reg .b16 %hlo, %hhi; .reg .f32 %flo, %fhi;",
        f"mov.u32 %l, %laneid; shl.b32 %l, %l, 2; mov.u32 %b, {TABLE_NAME};",
        *_SHIFTS,
    ]
    for j in range(4):
        lines.append(f"lop3.b32 %a{j}, %a{j}, 0x7f80, %l, 0xEA; add.u32 %a{j}, %a{j}, %b;")  # (a & m) | lane
        lines.append(f"ld.shared.b32 %p{j}, [%a{j}];")
    lines += [
        "mul.rn.f16x2 %h, %p0, $2;",
        "fma.rn.f16x2 %h, %p1, $3, %h;",
        "fma.rn.f16x2 %h, %p2, $4, %h;",
        "fma.rn.f16x2 %h, %p3, $5, %h;",
        "mov.b32 {%hlo, %hhi}, %h; cvt.f32.f16 %flo, %hlo; cvt.f32.f16 %fhi, %hhi; add.rn.f32 $0, %flo, %fhi;",
        "}",
    ]
    return "\n".join(lines)


DOT_CONSTRAINTS = "=r,r,r,r,r,r"


def _f16(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]


def _round16(value: float) -> float:
    return struct.unpack("<e", struct.pack("<e", value))[0]  # once, to nearest even


def emulate_dot(word: int, xs: tuple[int, ...], table: torch.Tensor) -> float:
    """`dot_ptx` on CPU numbers: one packed word, x as 4 fp16x2 words, `pair_words16`'s table -> the fp32 sum."""
    if len(xs) != 4:
        raise ValueError(f"the dot program takes 4 fp16x2 x words, got {len(xs)}")
    entries = [int(table[(word >> (8 * j)) & 0xFF]) for j in range(4)]
    lo = hi = 0.0
    for j, (entry, x) in enumerate(zip(entries, xs, strict=True)):
        lo = _round16(_f16(entry) * _f16(x) + (lo if j else 0.0))
        hi = _round16(_f16(entry >> 16) * _f16(x >> 16) + (hi if j else 0.0))
    return struct.unpack("<f", struct.pack("<f", lo + hi))[0]
