"""The NF4 register lookup's instruction sequence (engine/quant/quant_prmt.py) on CPU: `emulate_decode16` runs the exact
program the GPU kernels inline as PTX (prmt/lop3/shr semantics as PTX documents them) and must give every code's
level (fp16-rounded) for random words and random tables, including the edge codes 0, 7, 8 and 15; the table words,
the PTX text and the refusals. The PTX itself runs only on a GPU (tests/gpu/test_quant_mma.py): Triton's CPU
interpreter does not execute inline assembly."""

from __future__ import annotations

import random

import pytest
import torch
from tests.helpers.kernel_emulation import emulate_decode16, emulate_scaled_table

from benchmarks.common.quantize import NF4_LEVELS, quantize_nf4
from corolla.engine.quant import quant_prmt


def _expected(word: int, levels: list[float]) -> list[float]:
    # byte j holds element 2j (high nibble) and 2j + 1 (low nibble)
    out = []
    for j in range(4):
        byte = (word >> (8 * j)) & 0xFF
        out += [levels[byte >> 4], levels[byte & 15]]
    return out


@pytest.mark.parametrize("table", ["nf4", "random", "negatives_and_zeros"])
def test_emulated_program_looks_up_every_code(table: str) -> None:
    rng = random.Random(hash(table) & 0xFFFF)
    if table == "nf4":
        code = torch.tensor(NF4_LEVELS)
    elif table == "random":
        code = torch.sort(torch.randn(16, generator=torch.Generator().manual_seed(5)) * 3).values
    else:  # signs and zeros in both halves of the table (bit 3 of the code chooses the half)
        code = torch.tensor([-0.0, -2.5, 0.0, 7.0, -1e-3, 3e4, -3e4, 0.5] * 2) * torch.tensor([1.0] * 8 + [-1.0] * 8)
    words = quant_prmt.lut_words(code)
    levels = code.to(torch.float16).float().tolist()
    edge = [0x00000000, 0xFFFFFFFF, 0x78877887, 0x0F0F0F0F, 0xF0F0F0F0, 0x80808080, 0x07070707, 0x8F7F08F0]
    for word in edge + [rng.getrandbits(32) for _ in range(1500)]:
        got = emulate_decode16(word, words)
        want = _expected(word, levels)
        # compare bit patterns (signed zeros included)
        assert [torch.tensor(v).half().view(torch.int16).item() for v in got] == [
            torch.tensor(v).half().view(torch.int16).item() for v in want
        ], hex(word)


def test_table_words_hold_the_fp16_levels() -> None:
    code = torch.tensor(NF4_LEVELS)
    words = quant_prmt.lut_words(code)
    assert len(words) == 8 and all(-(2**31) <= w < 2**31 for w in words)
    bits = [b & 0xFFFF for b in code.half().view(torch.int16).tolist()]
    for entry in range(16):
        low = (words[entry // 4] >> (8 * (entry % 4))) & 0xFF
        high = (words[4 + entry // 4] >> (8 * (entry % 4))) & 0xFF
        assert (high << 8 | low) == bits[entry]
    # an NF4 weight carries the words of its own table in its compute dtype (16-bit dtypes only)
    assert quantize_nf4(torch.randn(8, 128), dtype=torch.float16).lut_words == words
    weight = quantize_nf4(torch.randn(8, 128), dtype=torch.bfloat16)
    assert weight.lut_words == quant_prmt.lut_words(code, torch.bfloat16) != words
    assert quantize_nf4(torch.randn(8, 128), dtype=torch.float32).lut_words == ()


def test_bad_tables_are_refused() -> None:
    with pytest.raises(ValueError, match="16 levels"):
        quant_prmt.lut_words(torch.zeros(15))
    with pytest.raises(ValueError, match="fp16 range"):
        quant_prmt.lut_words(torch.tensor([1e5] + [0.0] * 15))
    with pytest.raises(ValueError, match="fp16 range"):
        quant_prmt.lut_words(torch.tensor([float("nan")] + [0.0] * 15))
    with pytest.raises(ValueError, match="fp16 or bf16"):
        quant_prmt.lut_words(torch.zeros(16), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("table", ["nf4", "random"])
def test_fp16_program_gives_every_level_in_element_order(table: str, dtype: torch.dtype) -> None:
    # the matrix-unit kernel's decode (quant_mma): the same lookups, 16-bit pairs in element order, no conversions;
    # the table's type (the weight's compute dtype) is the levels' type
    code = torch.tensor(NF4_LEVELS) if table == "nf4" else torch.sort(torch.randn(16) * 3).values
    words = quant_prmt.lut_words(code, dtype)
    levels = code.to(dtype).float().tolist()
    rng = random.Random(11)
    for word in [0x00000000, 0xFFFFFFFF, 0x78877887, 0x8F7F08F0] + [rng.getrandbits(32) for _ in range(1500)]:
        got = emulate_decode16(word, words, dtype)
        assert [torch.tensor(v).to(dtype).view(torch.int16).item() for v in got] == [
            torch.tensor(v).to(dtype).view(torch.int16).item() for v in _expected(word, levels)
        ], hex(word)
    ptx = quant_prmt.decode16_ptx()
    ops = [op for op, _, _ in quant_prmt.DECODE16_PROGRAM]
    assert ptx.count("prmt.b32") == ops.count("prmt") == 16 and "cvt" not in ptx  # 21 instructions, no conversion
    assert len(ops) == 21 and quant_prmt.DECODE16_CONSTRAINTS.count("=h") == 8
    for operand in range(17):  # every fp16 output written, the word and every table word read
        assert f"${operand}" in ptx


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("table", ["nf4", "random"])
def test_folded_table_looks_up_bitsandbytes_dequantized_values(table: str, dtype: torch.dtype) -> None:
    # quant_mma's folded path: the table of level x absmax (fp32, rounded once), read by the same lookup, gives
    # bitsandbytes' dequantized weight bit for bit: NF4Weight.dequantize of a weight with that block absmax
    gen = torch.Generator().manual_seed(13)
    code = torch.tensor(NF4_LEVELS) if table == "nf4" else torch.sort(torch.randn(16, generator=gen) * 3).values
    weight = quantize_nf4(torch.randn(4, 64, generator=gen) * 0.05, dtype=dtype)
    assert weight.levels == tuple(weight.code.tolist())  # the kernel's level arguments: the fp32 values
    absmaxes = weight.block_absmax().tolist() + [1.0, 3.0e-3, 7.5, 1.0e-6]
    rng = random.Random(17)
    for absmax in absmaxes:
        words = emulate_scaled_table(code.tolist(), absmax, dtype)
        levels = (code * torch.tensor(absmax, dtype=torch.float32)).to(dtype).float().tolist()
        for word in [0x00000000, 0xFFFFFFFF, 0x78877887] + [rng.getrandbits(32) for _ in range(200)]:
            got = emulate_decode16(word, words, dtype)
            assert [torch.tensor(v).to(dtype).view(torch.int16).item() for v in got] == [
                torch.tensor(v).to(dtype).view(torch.int16).item() for v in _expected(word, levels)
            ], (absmax, hex(word))
    ptx = quant_prmt.scaled_table_ptx(dtype)
    assert ptx.count("mul.rn.f32") == 16 and ptx.count("cvt.rn.") == 8 and ptx.count("prmt.b32") == 8
    assert ("bf16x2" in ptx) == (dtype == torch.bfloat16)
    assert quant_prmt.SCALED_TABLE_CONSTRAINTS.count("=r") == 8
    for operand in range(25):  # every table word written, the absmax and every level read
        assert f"${operand}" in ptx
    with pytest.raises(ValueError, match="fp16 or bf16"):
        quant_prmt.scaled_table_ptx(torch.float32)
