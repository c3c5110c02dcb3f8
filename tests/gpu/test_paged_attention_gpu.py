"""The paged decode attention's in-kernel split combine on a real GPU, at Llama-3-8B's attention shape (32 query
heads over 8 kv heads of 128, 64-token pages) and Falcon-7B's (71 query heads on one kv head of 64): captured once in a CUDA graph and replayed with new queries and
lengths, each replay equals the reference and the eager call bit for bit, and the arrival counters are zero after
every replay (the last program of each (row, kv head) resets its own). Skipped without CUDA."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from corolla.engine.ops import decode_ops as ops
from helpers.cuda_capture import capture

DEV = torch.device("cuda")
PAGE, PAGES = 64, 200
LLAMA, FALCON = (32, 8, 128), (71, 1, 64)  # query heads, kv heads, head size


@pytest.mark.parametrize(
    ("shape", "rows", "splits"),
    [(LLAMA, 1, 16), (LLAMA, 3, 11), (LLAMA, 8, 4), (FALCON, 1, 16), (FALCON, 3, 11), (FALCON, 8, 2)],
)
@pytest.mark.parametrize("early", [False, True])
def test_graph_replays_combine_every_split(shape: tuple[int, int, int], rows: int, splits: int, early: bool) -> None:
    from corolla.engine.kernels import triton_kernels as tk
    from corolla.engine.kernels.attention_counters import attention_counters

    NQ, NKV, D = shape
    gen = torch.Generator(device=DEV).manual_seed(rows * 100 + splits)
    kc = torch.randn(PAGES, PAGE, NKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(PAGES, PAGE, NKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    tables = (torch.randperm(PAGES - 1, device=DEV, generator=gen)[: rows * 24].reshape(rows, 24) + 1).int()
    q = torch.zeros(rows, NQ, D, device=DEV, dtype=torch.bfloat16)
    positions = torch.zeros(rows, device=DEV, dtype=torch.long)
    scale = 1 / math.sqrt(D)
    counters = attention_counters(DEV, rows * NKV)
    attend = functools.partial(tk.paged_decode_attention, early=early)  # early: splits of one page read before the wait
    graph, out = capture(attend, q, kc, vc, tables, positions, scale, splits)
    for replay in range(4):
        q.copy_(torch.randn(rows, NQ, D, device=DEV, dtype=torch.bfloat16, generator=gen))
        positions.copy_(torch.randint(0, 24 * PAGE, (rows,), device=DEV, generator=gen, dtype=torch.long))
        graph.replay()
        torch.cuda.synchronize()
        assert int(counters.abs().sum()) == 0, replay
        ref = ops.paged_decode_attention_ref(q, kc, vc, tables, (positions + 1).int(), scale)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(out, attend(q, kc, vc, tables, positions, scale, splits)), replay
