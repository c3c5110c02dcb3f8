"""The NF4 pair table (engine/quant/quant_pair_table.py) on CPU: every byte's entry holds both of its codes' fp16 levels in
the halves the dot pairs with x; the emulated dot reads one-hot x's levels back exactly and random x within fp16
rounding of a float64 sum (before the register lookup's dot program was deleted, its emulation gave the same bits on
400 random words and two tables); the PTX text copies every entry to every lane; the refusals. The PTX runs only on
a GPU (tests/gpu/test_quant_stream.py)."""

from __future__ import annotations

import random
import re

import pytest
import torch

from corolla.engine.quant import quant_pair_table
from corolla.engine.quant.quant_weights import NF4_LEVELS


def _x16(values: list[float]) -> tuple[int, ...]:
    bits = [b & 0xFFFF for b in torch.tensor(values).half().view(torch.int16).tolist()]
    return tuple(bits[2 * i] | bits[2 * i + 1] << 16 for i in range(4))


def _expected(word: int, levels: list[float]) -> list[float]:
    # byte j holds element 2j (high nibble) and 2j + 1 (low nibble)
    out = []
    for j in range(4):
        byte = (word >> (8 * j)) & 0xFF
        out += [levels[byte >> 4], levels[byte & 15]]
    return out


@pytest.mark.parametrize("table", ["nf4", "random"])
def test_entries_and_dots_pair_every_value_with_its_element(table: str) -> None:
    # every byte's entry holds its two levels in the halves x pairs with; one-hot x reads each element's level back
    # exactly, and random x matches a float64 sum within fp16 rounding
    code = torch.tensor(NF4_LEVELS) if table == "nf4" else torch.randn(16, generator=torch.Generator().manual_seed(3))
    pairs = quant_pair_table.pair_words16(code)
    levels = code.to(torch.float16)
    for b in range(256):  # low half: the high nibble's level (the even element); high half: the low nibble's
        word = int(pairs[b]) & 0xFFFFFFFF
        halves = torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16).view(torch.float16)
        assert torch.equal(halves, torch.stack((levels[b >> 4], levels[b & 15]))), b
    rng = random.Random(11)
    for word in [0, 0xFFFFFFFF, 0x8F7F08F0] + [rng.getrandbits(32) for _ in range(300)]:
        want = _expected(word, levels.float().tolist())
        for e in range(8):
            onehot = [0.0] * 8
            onehot[e] = 1.0
            assert quant_pair_table.emulate_dot(word, _x16(onehot), pairs) == want[e], (hex(word), e)
        xs = torch.tensor([rng.uniform(-4, 4) for _ in range(8)]).half().float().tolist()  # values fp16 holds
        exact = sum(w * x for w, x in zip(want, xs, strict=True))
        bound = sum(abs(w * x) for w, x in zip(want, xs, strict=True)) * 4 * 2.0**-11  # 4 fp16 roundings per half
        assert abs(quant_pair_table.emulate_dot(word, _x16(xs), pairs) - exact) <= bound + 1e-12


@pytest.mark.parametrize("warps", [4, 8])
def test_init_copies_every_entry_to_every_lane(warps: int) -> None:
    ptx = quant_pair_table.init_ptx(warps)
    loads = [int(v) for v in re.findall(r"ld\.global\.nc\.v4\.u32 \{[^}]*\}, \[%g \+ (\d+)\]", ptx)]
    stores = [int(v) for v in re.findall(r"st\.shared\.u32 \[%s \+ (\d+)\]", ptx)]
    assert len(loads) * 4 * warps == quant_pair_table.ENTRIES and len(stores) == 4 * len(loads)
    # warp w's i-th load reads entries 4 (w + warps i) .. + 3; store k of it goes to word 32 (4 (w + warps i) + k)
    for w in range(warps):
        entries = sorted((w * 16 + off) // 4 + k for off in loads for k in range(4))  # [group first entries + k]
        words = sorted((w * 512 + off) // 4 for off in stores)  # lane 0's words
        assert words == [32 * e for e in entries]
    covered = sorted((w * 16 + off) // 4 + k for w in range(warps) for off in loads for k in range(4))
    assert covered == list(range(quant_pair_table.ENTRIES))
    assert ptx.count("bar.sync 0;") == 1 and quant_pair_table.TABLE_NAME in ptx.splitlines()[0]
    with pytest.raises(ValueError, match="warps"):
        quant_pair_table.init_ptx(3)


def test_dot_ptx_reads_four_entries_and_refusals() -> None:
    ptx = quant_pair_table.dot_ptx()
    assert ptx.count("ld.shared.b32") == 4 and ptx.count("fma.rn.f16x2") == 3 and ptx.count("cvt.f32.f16") == 2
    assert "prmt" not in ptx and all(f"${i}" in ptx for i in range(6))
    with pytest.raises(ValueError, match="16 levels"):
        quant_pair_table.pair_words16(torch.zeros(8))
    with pytest.raises(ValueError, match="fp16 range"):
        quant_pair_table.pair_words16(torch.full((16,), 1e6))
    with pytest.raises(ValueError, match="x words"):
        quant_pair_table.emulate_dot(0, (0, 0, 0), quant_pair_table.pair_words16(torch.tensor(NF4_LEVELS)))
