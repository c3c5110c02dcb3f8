"""The paged decode attention reads part of its pages before its `gdc_wait` (docs/decisions/0278): on a real GPU,
behind a kernel that releases it at once and writes the step's keys and values only ~0.3 ms later, every row still
attends to every token the step wrote, its own and its sequence's other rows' (a speculative step's rows share one
block table). An attention that kept the early copy of such a token fails here. Skipped without CUDA (sm_90+ for the
programmatic launch it tests)."""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
gdc = pytest.importorskip("triton.language.extra.cuda")

from corolla.engine.kernels import triton_kernels as tk  # noqa: E402  (needs Triton)
from corolla.engine.kernels.nvrtc_kernels import programmatic_launches  # noqa: E402
from corolla.engine.ops import decode_ops as ops  # noqa: E402

DEV = torch.device("cuda")
PAGE, PAGES, NQ, NKV, D = 64, 40, 32, 8, 128  # Llama-3-8B's attention, 64-token pages


@triton.jit
def _late_store_kernel(k_new, v_new, k_ptr, v_ptr, slot_ptr, chase_ptr, spins, W: tl.constexpr):
    # the kernel ahead of the attention: releases it at once, then writes row r's token (all kv heads, W values)
    # at its slot after `spins` dependent uncached loads (each address depends on the last value, always 0)
    gdc.gdc_launch_dependents()
    row = tl.program_id(0)
    x = tl.load(chase_ptr)
    for _ in range(spins):
        x = tl.load(chase_ptr + x, volatile=True)
    offs = tl.arange(0, W)
    slot = tl.load(slot_ptr + row)
    tl.store(k_ptr + slot * W + offs + x, tl.load(k_new + row * W + offs))  # (+ x: after the loop)
    tl.store(v_ptr + slot * W + offs + x, tl.load(v_new + row * W + offs))


@pytest.mark.skipif(
    not torch.cuda.is_available() or not programmatic_launches(DEV), reason="needs programmatic launches (sm_90+)"
)
@pytest.mark.parametrize(("splits", "pages_per_split"), [(16, 1), (4, 3)])
def test_every_row_sees_the_tokens_written_ahead(splits: int, pages_per_split: int) -> None:
    gen = torch.Generator(device=DEV).manual_seed(splits)
    kc = torch.randn(PAGES, PAGE, NKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    # rows 0-3: one sequence at positions 576-579 (the first tokens of its page 9, a split's first page), row 4
    # another sequence at 1000
    positions = torch.tensor([576, 577, 578, 579, 1000], device=DEV)
    tables = torch.randperm(PAGES, device=DEV, generator=gen).int()[None].repeat(5, 1)  # [5, PAGES]
    tables[4] = tables[4].flip(0)
    slots, lens = ops.decode_slots_ref(positions, tables, PAGE)
    k_flat, v_flat = kc.view(-1, NKV, D), vc.view(-1, NKV, D)  # [PAGES * PAGE, nkv, D]
    old_k, old_v = k_flat[slots].clone(), v_flat[slots].clone()
    new_k = torch.randn(5, NKV, D, device=DEV, dtype=torch.bfloat16, generator=gen) * 4
    new_v = torch.randn(5, NKV, D, device=DEV, dtype=torch.bfloat16, generator=gen) * 4
    q = torch.randn(5, NQ, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    scale = 1 / math.sqrt(D)
    k_flat[slots], v_flat[slots] = new_k, new_v
    expected = ops.paged_decode_attention_ref(q, kc, vc, tables, lens, scale)
    k_flat[slots], v_flat[slots] = old_k, old_v
    stale = ops.paged_decode_attention_ref(q, kc, vc, tables, lens, scale)
    assert ((stale.float() - expected.float()).abs().amax(dim=(1, 2)) > 0.1).all()  # every row sees the write
    chase = torch.zeros(1, dtype=torch.int64, device=DEV)
    for attempt in range(3):
        k_flat[slots], v_flat[slots] = old_k, old_v
        _late_store_kernel[(5,)](new_k, new_v, kc, vc, slots, chase, 2000, W=NKV * D, num_warps=4)
        got = tk.paged_decode_attention(
            q, kc, vc, tables, positions, scale, splits, pages_per_split=pages_per_split, early=True
        )
        torch.cuda.synchronize()
        assert torch.equal(k_flat[slots], new_k)  # the write landed
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2, msg=f"attempt {attempt}")
