"""The NF4 register lookup: 4-bit codes to their levels with byte permutes (`prmt`) instead of memory lookups.

The 16 levels, as fp16 (or bf16: the program moves bytes, whatever they encode), are 32 bytes: their low bytes make
four 32-bit words L0..L3 (L0 holds the low bytes of levels 0-3, ...) and their high bytes four more, H0..H3
(`lut_words`). One `prmt.b32 d, a, b, sel` picks four bytes out of the eight of {b, a} by four 3-bit indices (the
low 16 bits of `sel`), so for four codes at once: `prmt(L0, L1, codes & 7)` gives the low bytes of their levels if
each code is < 8, `prmt(L2, L3, codes & 7)` if each is >= 8, and a third `prmt` with the selector `0x3210 + 4 *
bit3(code)` per byte merges the two by bit 3 of each code; the same for the high bytes; two more `prmt`s interleave
low and high bytes into two words of 16-bit pairs in element order (element 2j in the low half). One packed 32-bit word (4
bytes, 8 codes) costs 5 selector instructions + 2 x 8 permutes (`DECODE16_PROGRAM`), all in registers, instead of 8
table loads: the operand of the matrix units (quant_mma).

The program is an instruction sequence as data: `decode16_ptx` writes it as inline PTX and the tests run the same
list on CPU integers (the instructions' documented semantics, tests/helpers/kernel_emulation.py), so they check the
exact sequence the GPU runs. Levels are rounded once to the table's type (fp16: relative error <= 2^-11; bf16: <= 2^-8, the size of
the bf16 rounding of bitsandbytes' own dequantized weight)."""

from __future__ import annotations

import torch

# Operand names: "w" = the packed word (4 bytes: code 2j in the high nibble of byte j, 2j + 1 in the low one),
# "L0".."L3", "H0".."H3" = the table words, "e0".."e3" = fp16x2 words of elements (0, 1), (2, 3), (4, 5), (6, 7), the
# even element in the low half; anything else a scratch register; ints are immediates.
_SELECTORS: tuple[tuple[str, str, tuple[str | int, ...]], ...] = (
    ("and", "i", ("w", 0x77777777)),  # every code's 3-bit index (bit 3 cleared: no sign-replicate mode)
    ("shr", "j", ("i", 16)),  # indices of codes 4-7 (byte order: lo2, hi2, lo3, hi3) into the low 16 bits
    ("shr", "s", ("w", 1)),  # bit 3 of each code to bit 2 of its nibble
    ("andor", "m", ("s", 0x44444444, 0x32103210)),  # merge selectors: nibble k = (k mod 4) + 4 * bit3(code k)
    ("shr", "n", ("m", 16)),  # those of codes 4-7 into the low 16 bits (prmt reads only sel[15:0])
)


def _lookups(index: str, merge: str) -> tuple[tuple[str, str, tuple[str | int, ...]], ...]:
    # four codes (nibble order: lo0, hi0, lo1, hi1 = elements 1, 0, 3, 2): p = low bytes of their levels, q = high
    return (
        ("prmt", "a", ("L0", "L1", index)),
        ("prmt", "b", ("L2", "L3", index)),
        ("prmt", "p", ("a", "b", merge)),
        ("prmt", "a", ("H0", "H1", index)),
        ("prmt", "b", ("H2", "H3", index)),
        ("prmt", "q", ("a", "b", merge)),
    )


DECODE16_PROGRAM: tuple[tuple[str, str, tuple[str | int, ...]], ...] = (
    *_SELECTORS,
    *_lookups("i", "m"),  # codes 0-3
    ("prmt", "e0", ("p", "q", 0x4051)),  # elements 0 (low half), 1
    ("prmt", "e1", ("p", "q", 0x6273)),  # elements 2, 3
    *_lookups("j", "n"),  # codes 4-7
    ("prmt", "e2", ("p", "q", 0x4051)),
    ("prmt", "e3", ("p", "q", 0x6273)),
)
TABLE_OPERANDS = ("L0", "L1", "L2", "L3", "H0", "H1", "H2", "H3")
_SCRATCH = ("i", "j", "s", "m", "n", "a", "b", "p", "q")


def lut_words(code: torch.Tensor, dtype: torch.dtype = torch.float16) -> tuple[int, ...]:
    """[16] levels -> the 8 table words (L0..L3, H0..H3) of the levels in `dtype` (fp16 or bf16) as signed 32-bit
    ints (kernel arguments)."""
    if code.numel() != 16:
        raise ValueError(f"the NF4 register lookup takes 16 levels, got {code.numel()}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the NF4 register lookup holds fp16 or bf16 levels, not {dtype}")
    levels = code.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(levels).all()) or float(levels.abs().max()) > 65504.0:
        raise ValueError("NF4 levels must be finite and within fp16 range")
    bits = [int(b) & 0xFFFF for b in levels.to(dtype).view(torch.int16).tolist()]
    words = []
    for shift in (0, 8):  # low bytes, then high bytes
        for q in range(4):
            words.append(sum(((bits[4 * q + e] >> shift) & 0xFF) << (8 * e) for e in range(4)))
    return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in words)


def decode16_ptx() -> str:
    """DECODE16_PROGRAM as inline PTX for `tl.inline_asm_elementwise`: outputs $0..$7 (the 16-bit levels of the
    word's elements 0..7, 16-bit registers), inputs $8 (the word) and $9..$16 (the table words)."""
    operand = {"w": "$8"}
    operand.update({name: f"${9 + i}" for i, name in enumerate(TABLE_OPERANDS)})
    operand.update({name: f"%{name}" for name in (*_SCRATCH, "e0", "e1", "e2", "e3")})

    def ref(x: str | int) -> str:
        return f"0x{x:08x}" if isinstance(x, int) else operand[x]

    lines = ["{", ".reg .b32 " + ", ".join(f"%{n}" for n in (*_SCRATCH, "e0", "e1", "e2", "e3")) + ";"]
    for op, dst, src in DECODE16_PROGRAM:
        d = operand[dst]
        if op == "and":
            lines.append(f"and.b32 {d}, {ref(src[0])}, {ref(src[1])};")
        elif op == "shr":
            lines.append(f"shr.u32 {d}, {ref(src[0])}, {int(src[1])};")
        elif op == "andor":
            lines.append(f"lop3.b32 {d}, {ref(src[0])}, {ref(src[1])}, {ref(src[2])}, 0xEA;")
        elif op == "prmt":
            lines.append(f"prmt.b32 {d}, {ref(src[0])}, {ref(src[1])}, {ref(src[2])};")
        else:
            raise ValueError(f"unknown decode op {op!r}")
    for e in range(4):  # the halves of each word: the even element is the low half
        lines.append(f"mov.b32 {{${2 * e}, ${2 * e + 1}}}, %e{e};")
    lines.append("}")
    return "\n".join(lines)


DECODE16_CONSTRAINTS = ",".join(["=h"] * 8 + ["r"] * 9)

# The folded table (quant_mma's folded path): the 16 levels "c0".."c15" (fp32) times one block's absmax "s" (fp32),
# each product rounded once to the 16-bit type (bitsandbytes' dequantized value, bit for bit: it multiplies the same
# fp32 level and absmax and rounds to nearest), packed as the 8 table words "L0".."L3", "H0".."H3" that
# DECODE16_PROGRAM reads: the lookup then yields the dequantized weights themselves. 16 mul + 8 cvt + 8 prmt.
SCALED_TABLE_PROGRAM: tuple[tuple[str, str, tuple[str | int, ...]], ...] = (
    *(("mul", f"v{i}", (f"c{i}", "s")) for i in range(16)),
    *(("cvt2", f"p{i}", (f"v{2 * i + 1}", f"v{2 * i}")) for i in range(8)),  # level 2i in the low half
    *(("prmt", f"L{q}", (f"p{2 * q}", f"p{2 * q + 1}", 0x6420)) for q in range(4)),  # low bytes of levels 4q..4q+3
    *(("prmt", f"H{q}", (f"p{2 * q}", f"p{2 * q + 1}", 0x7531)) for q in range(4)),  # their high bytes
)
SCALED_TABLE_CONSTRAINTS = ",".join(["=r"] * 8 + ["r"] * 17)


def scaled_table_ptx(dtype: torch.dtype) -> str:
    """SCALED_TABLE_PROGRAM as inline PTX: outputs $0..$7 (L0..L3, H0..H3), inputs $8 (the absmax) and $9..$24 (the
    levels), all 32-bit registers; `dtype` (bf16 or fp16) picks the rounding conversion."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the folded table holds fp16 or bf16 products, not {dtype}")
    cvt = "cvt.rn.bf16x2.f32" if dtype == torch.bfloat16 else "cvt.rn.f16x2.f32"
    operand = {name: f"${i}" for i, name in enumerate(TABLE_OPERANDS)}
    operand["s"] = "$8"
    operand.update({f"c{i}": f"${9 + i}" for i in range(16)})
    operand.update({f"v{i}": f"%v{i}" for i in range(16)})
    operand.update({f"p{i}": f"%p{i}" for i in range(8)})
    lines = ["{", ".reg .b32 %v<16>, %p<8>;"]
    for op, dst, src in SCALED_TABLE_PROGRAM:
        d = operand[dst]
        if op == "mul":
            lines.append(f"mul.rn.f32 {d}, {operand[str(src[0])]}, {operand[str(src[1])]};")
        elif op == "cvt2":  # d = {high: src[0], low: src[1]}
            lines.append(f"{cvt} {d}, {operand[str(src[0])]}, {operand[str(src[1])]};")
        elif op == "prmt":
            lines.append(f"prmt.b32 {d}, {operand[str(src[0])]}, {operand[str(src[1])]}, 0x{int(src[2]):08x};")
        else:
            raise ValueError(f"unknown table op {op!r}")
    lines.append("}")
    return "\n".join(lines)
