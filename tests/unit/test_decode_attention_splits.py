"""The decode attention's split count (`DecodeOps.num_splits`): about two programs per multiprocessor, at most
`attention_splits_max`, and at most LARGE_GROUP_SPLITS for groups of more than LARGE_GROUP query heads per kv head
(Falcon-7B: 71 on one), whose partial sums one program reads back split after split (docs/decisions/0078); and the
splits by the rows' pages (`DecodeOps.attention_splits`, decision 0262): every grid that splits has its arrival
counters and stays within LONG_ROW_PROGRAMS, on any card, cap and head layout."""

from __future__ import annotations

import torch

from corolla.engine.kernels.attention_counters import ATTENTION_COUNTERS
from corolla.engine.ops.decode_ops import LARGE_GROUP, LARGE_GROUP_SPLITS, LONG_ROW_PROGRAMS, DecodeOps


def test_large_groups_take_fewer_splits() -> None:
    ops = DecodeOps(torch.device("cpu"), 64, use_triton=False)
    ops.num_sms = 132  # an H200
    assert ops.num_splits(1, 8, 4) == 16  # Llama-3-8B: the cap
    assert ops.num_splits(8, 32, 1) == 2  # BLOOM-7b1 at 8 rows: two programs per multiprocessor
    assert ops.num_splits(1, 1, 71) == LARGE_GROUP_SPLITS == 8  # Falcon-7B
    assert ops.num_splits(1, 8, LARGE_GROUP) == 16
    assert ops.num_splits(64, 1, 71) == 5


def test_rows_split_by_their_own_pages() -> None:
    # (grid splits, pages a split takes) for Llama-3-8B's 8 kv heads of 4 query heads, 64-token pages, 132 SMs
    ops = DecodeOps(torch.device("cpu"), 128, use_triton=False)
    ops.num_sms = 132
    assert ops.attention_splits(1, 8, 4, 64) == (16, 1)  # one row: a page a split, 16 at most (as before)
    assert ops.attention_splits(8, 8, 4, 64) == (8, 1)  # a 512-token row takes 8 splits
    # 64 rows: a row of <= 512 tokens takes one split (as the batch's one split before), a 4,096-token row 8
    assert ops.attention_splits(64, 8, 4, 64) == (8, 8)
    # the grid stays within LONG_ROW_PROGRAMS: fewer splits offered to more rows, none past 2,048 (row, kv head) pairs
    assert ops.attention_splits(128, 8, 4, 64) == (4, 16)
    assert ops.attention_splits(256, 8, 4, 64) == (2, 32)
    assert ops.attention_splits(512, 8, 4, 64)[0] == 1
    for rows in (1, 8, 64, 100, 256, 300, 1024):
        splits, _ = ops.attention_splits(rows, 8, 4, 64)
        assert splits == 1 or rows * 8 <= ATTENTION_COUNTERS  # every split grid has its arrival counters
    assert ops.attention_splits(64, 1, 71, 64)[0] <= LARGE_GROUP_SPLITS  # Falcon-7B's cap holds


def test_every_split_grid_fits_the_counters_on_any_card() -> None:
    # the kernel counts a split row's programs in one int32 per (row, kv head) of the device's ATTENTION_COUNTERS
    # (more pairs are refused: a decode step would fail) and the decision's grids stay within LONG_ROW_PROGRAMS: for
    # cards of 16 to 170 multiprocessors, every cap an operator may set (`attention_splits_max`), Falcon's large
    # groups and 1 to 64 kv heads, at every row count a merged step may have
    for sms in (16, 108, 132, 170):
        for cap in (0, 1, 8, 16, 64):
            ops = DecodeOps(torch.device("cpu"), 128, use_triton=False, attention_splits_max=cap)
            ops.num_sms = sms
            for kv_heads in (1, 8, 64):
                for group in (1, 4, 71):
                    for rows in range(1, 600):
                        splits, pages = ops.attention_splits(rows, kv_heads, group, 64)
                        assert splits >= 1 and pages >= 1
                        if splits > 1:
                            assert rows * kv_heads <= ATTENTION_COUNTERS, (sms, cap, kv_heads, group, rows)
                            assert rows * kv_heads * splits <= LONG_ROW_PROGRAMS, (sms, cap, kv_heads, group, rows)
                            assert splits <= max(1, cap) and (group <= LARGE_GROUP or splits <= LARGE_GROUP_SPLITS)
