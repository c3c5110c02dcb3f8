"""The decode attention's split count (`DecodeOps.num_splits`): about two programs per multiprocessor, at most
`attention_splits_max`, and at most LARGE_GROUP_SPLITS for groups of more than LARGE_GROUP query heads per kv head
(Falcon-7B: 71 on one), whose partial sums one program reads back split after split (docs/decisions/0078)."""

from __future__ import annotations

import torch

from corolla.engine.ops.decode_ops import LARGE_GROUP, LARGE_GROUP_SPLITS, DecodeOps


def test_large_groups_take_fewer_splits() -> None:
    ops = DecodeOps(torch.device("cpu"), 64, use_triton=False)
    ops.num_sms = 132  # an H200
    assert ops.num_splits(1, 8, 4) == 16  # Llama-3-8B: the cap
    assert ops.num_splits(8, 32, 1) == 2  # BLOOM-7b1 at 8 rows: two programs per multiprocessor
    assert ops.num_splits(1, 1, 71) == LARGE_GROUP_SPLITS == 8  # Falcon-7B
    assert ops.num_splits(1, 8, LARGE_GROUP) == 16
    assert ops.num_splits(64, 1, 71) == 5
