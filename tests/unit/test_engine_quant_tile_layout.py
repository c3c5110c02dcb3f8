"""The NF4 tile GEMV's reading of bitsandbytes' bytes (engine/quant/quant_tile_gemv.py) on CPU: the kernel's data
movement (which lane loads which bytes of rows g and g + 8, which B lanes hold which x, each column's block and
absmax, each warp's range of units and the row's slots added in warp order) emulated through the PTX fragment
layout of `mma.m16n8k16` gives x @ the weight for ragged shapes (rows padded to a tile, blocks short of a unit, more
warps than units), bf16 and fp16; the ALIGNED table's room in a program's shared memory. The kernel itself runs in
tests/gpu/test_quant_tile_gemv.py."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.kernel_emulation import emulate_expert_group, emulate_tile_gemv, program_row_tiles, warp_units

from benchmarks.common.quantize import quantize_nf4
from corolla.engine.quant.quant_tile_gemv import (
    ALIGNED,
    GROUP_ROWS,
    NF4_TILE_CONFIGS,
    RELEASED_PROGRAMS_SHARE,
    WINDOW_RESERVED_BYTES,
    expert_groups,
    grid_programs,
    shared_bytes,
)


def _fp16_level_reference(weight) -> torch.Tensor:
    n, k = weight.shape
    codes = torch.stack(((weight.packed >> 4).long(), (weight.packed & 15).long()), dim=-1).reshape(n, k)
    return (weight.code.half().double()[codes].reshape(-1, 64) * weight.block_absmax().double()[:, None]).reshape(n, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("shape", "warps", "programs"),
    # a partial tile and unit; whole ones; idle warps; more warps than units, empty ranges among the others
    [((40, 384), 3, 2), ((32, 512), 4, 1), ((16, 192), 8, 1), ((40, 1216), 32, 2)],
)
def test_emulated_kernel_reads_the_weight(dtype, shape, warps, programs) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    weight = quantize_nf4((torch.randn(n, k, generator=gen) * 0.05).to(dtype))
    x = torch.randn(2, k, generator=gen).to(dtype)
    got = emulate_tile_gemv(x, weight, warps, programs).double()
    xs = (x.float() * 2.0**-8).half().double() * 2.0**8 if dtype == torch.bfloat16 else x.double()
    want = xs @ _fp16_level_reference(weight).t()
    assert float((got - want).norm() / want.norm()) < 1e-2  # one rounding to the output dtype


@pytest.mark.parametrize(("warps", "programs"), [(3, 2), (8, 3), (32, 2)])
def test_emulated_gated_form_pairs_each_gate_row_with_its_up_row(warps, programs) -> None:
    n, k = 96, 384  # [gate | up] of 48 rows: 3 row tiles a half, split over 2 or 3 programs
    gen = torch.Generator().manual_seed(7)
    weight = quantize_nf4((torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16))
    x = torch.randn(2, k, generator=gen).to(torch.bfloat16)
    got = emulate_tile_gemv(x, weight, warps, programs, gated=True).double()
    xs = (x.float() * 2.0**-8).half().double() * 2.0**8
    gate_up = xs @ _fp16_level_reference(weight).t()
    want = torch.nn.functional.silu(gate_up[:, : n // 2]) * gate_up[:, n // 2 :]
    assert got.shape == (2, n // 2)
    assert float((got - want).norm() / want.norm()) < 1e-2


def test_work_ranges_cover_every_unit_once() -> None:
    for row_tiles, programs in ((1792, 132), (3, 5), (256, 264)):
        firsts = [program_row_tiles(row_tiles, programs, p) for p in range(programs)]
        assert firsts[0][0] == 0 and firsts[-1][1] == row_tiles
        assert all(a[1] == b[0] for a, b in zip(firsts, firsts[1:], strict=False))
    for units, warps in ((224, 32), (3, 8), (48, 16)):
        ranges = [warp_units(units, warps, w) for w in range(warps)]
        assert sum(end - first for first, end in ranges) == units
        assert max(end - first for first, end in ranges) - min(end - first for first, end in ranges) <= 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_emulated_grouped_form_reads_each_row_as_the_one_row_form(dtype, rows) -> None:
    # the experts' GROUPED build: up to 4 rows of one weight, each in its own columns of every load's mma steps
    n, k = 40, 1216  # a partial tile; 19 blocks: the last unit short by one block
    gen = torch.Generator().manual_seed(rows)
    weight = quantize_nf4((torch.randn(n, k, generator=gen) * 0.05).to(dtype))
    x = torch.randn(rows, k, generator=gen).to(dtype)
    got = emulate_tile_gemv(x, weight, 5, 2, grouped=True).double()
    xs = (x.float() * 2.0**-8).half().double() * 2.0**8 if dtype == torch.bfloat16 else x.double()
    want = xs @ _fp16_level_reference(weight).t()
    assert float((got - want).norm() / want.norm()) < 1e-2
    assert torch.equal(got, emulate_tile_gemv(x, weight, 5, 2).double())  # the same sums, row by row


def test_emulated_grouped_gated_form() -> None:
    n, k = 96, 384
    gen = torch.Generator().manual_seed(3)
    weight = quantize_nf4((torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16))
    x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    got = emulate_tile_gemv(x, weight, 3, 2, gated=True, grouped=True)
    assert torch.equal(got, emulate_tile_gemv(x, weight, 3, 2, gated=True))


@pytest.mark.parametrize(("rows", "num_weights", "seed"), [(16, 8, 0), (16, 8, 1), (3, 8, 2), (42, 8, 3), (70, 5, 4)])
def test_expert_groups_cover_every_row_once(rows, num_weights, seed) -> None:
    # the warps' grouping (lane masks) against its definition: per chunk of 32 rows, each key's rows (ids outside
    # [0, E) one key) in groups of GROUP_ROWS in row order, heads in row order; every row served exactly once
    gen = torch.Generator().manual_seed(seed)
    routes = torch.randint(-2, num_weights + 2, (rows,), generator=gen).tolist()
    if seed == 0:
        routes = [3] * 9 + [5] * 7  # one key of 9 rows: three groups (4, 4, 1)
    bound = expert_groups(rows, num_weights)
    groups = [emulate_expert_group(routes, num_weights, s) for s in range(bound + 2)]
    want = []
    for c0 in range(0, rows, 32):
        keys = [e if 0 <= e < num_weights else num_weights for e in routes[c0 : c0 + 32]]
        for a, e in enumerate(keys):
            before = [b for b in range(a) if keys[b] == e]
            if len(before) % GROUP_ROWS == 0:
                want.append([c0 + b for b in range(a, len(keys)) if keys[b] == e][:GROUP_ROWS])
    assert [g for g in groups if g] == want
    assert all(not g for g in groups[len(want) :])  # past the last group: nothing to do
    assert len(want) <= bound
    assert sorted(r for g in want for r in g) == list(range(rows))
    if seed == 0:
        assert [len(g) for g in want] == [4, 4, 1, 4, 3]


def test_expert_groups_bound_is_reached() -> None:
    # 16 rows over 8 experts and the ids outside (one key): 9 keys of one row, 7 rows more, one group per 4 of them
    routes = [0] * 8 + list(range(1, 8)) + [8]  # expert 0 chosen 8 times (2 groups), 1-7 once, one id outside
    assert sum(1 for s in range(12) if emulate_expert_group(routes, 8, s)) == expert_groups(16, 8) == 10


TABLE_BYTES = 256 * 256  # the pair table the kernel places at a 64 KiB boundary of the shared window (ALIGNED)
H200_OPTIN_BYTES = 227 * 1024  # the most dynamic shared memory a program may opt in to on sm_90


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("k", [4096, 14336])
@pytest.mark.parametrize("row_tiles", [1, 2, 8])
def test_aligned_table_fits_where_the_kernel_places_it(grouped: bool, k: int, row_tiles: int) -> None:
    # the kernel puts the table at the first 64 KiB boundary of the window after its data (the window starting at
    # its dynamic shared memory's address, `sbase`) and traps unless the table ends inside the dynamic bytes; the
    # one-row form has room for any start below 64 KiB, the grouped one for a start up to the reserved 1 KiB
    config = next(c for c in NF4_TILE_CONFIGS if c[2] == ALIGNED)
    data, dyn = shared_bytes(config, k, row_tiles, grouped=grouped)
    starts = (0, 16, WINDOW_RESERVED_BYTES) if grouped else (0, 16, WINDOW_RESERVED_BYTES, 65535)
    for sbase in starts:
        table = -(-(sbase + data) // 65536) * 65536  # window address of the table
        assert table - sbase >= data and table - sbase + TABLE_BYTES <= dyn, (sbase, data, dyn)
    if grouped and k == 14336 and row_tiles <= 2:  # Mixtral's w_down: four rows' x fit beside the table on an H200
        assert dyn <= H200_OPTIN_BYTES < data + TABLE_BYTES + 65536


def test_a_released_gemv_leaves_room_beside_the_kernel_ahead() -> None:
    # w_o's GEMV released at the attention's start (docs/decisions/0289): on 132 multiprocessors (an H100, an H200)
    # its 256 row tiles go to 112 programs, not one a multiprocessor; unreleased, as many programs as fit
    assert grid_programs(256, 132, 1, released=True) == 112 == int(132 * RELEASED_PROGRAMS_SHARE)
    assert grid_programs(256, 132, 1) == 132 and grid_programs(256, 132, 2) == 256 and grid_programs(896, 132, 2) == 264
    assert grid_programs(256, 132, 2, released=True) == 112  # the share of one program a multiprocessor
    assert grid_programs(40, 132, 1, released=True) == grid_programs(40, 132, 1) == 40  # never more than a tile each
    assert grid_programs(8, 1, 1, released=True) == 1  # a card of one multiprocessor still runs one
    # every program's row tiles fit the shared memory sized for the grid (`_launch`: the tiles of a program of the
    # grid at one program a multiprocessor)
    for tiles in (1, 111, 112, 113, 256, 896):
        for released in (False, True):
            sized = -(-tiles // grid_programs(tiles, 132, 1, released=released))
            for per_sm in (1, 2):
                programs = grid_programs(tiles, 132, per_sm, released=released)
                assert -(-tiles // programs) <= sized, (tiles, released, per_sm)
