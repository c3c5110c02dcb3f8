"""The paged decode attention's in-kernel split combine on a real GPU, at Llama-3-8B's attention shape (32 query
heads over 8 kv heads of 128, 64-token pages) and Falcon-7B's (71 query heads on one kv head of 64): captured once in a CUDA graph and replayed with new queries and
lengths, each replay equals the reference and the eager call bit for bit, and the arrival counters are zero after
every replay (the last program of each (row, kv head) resets its own). The fused rotary attention
(rope_attention_triton) likewise, captured behind a programmatic kernel that writes qkv late (qkv poisoned before
each replay): its output and caches equal rope_and_store_ref + the reference attention. Skipped without CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from corolla.engine.ops import decode_ops as ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
PAGE, PAGES = 64, 200
LLAMA, FALCON = (32, 8, 128), (71, 1, 64)  # query heads, kv heads, head size


@pytest.mark.parametrize(
    ("shape", "rows", "splits"),
    [(LLAMA, 1, 16), (LLAMA, 3, 11), (LLAMA, 8, 4), (FALCON, 1, 16), (FALCON, 3, 11), (FALCON, 8, 2)],
)
def test_graph_replays_combine_every_split(shape: tuple[int, int, int], rows: int, splits: int) -> None:
    from corolla.engine.kernels import triton_kernels as tk
    from corolla.engine.kernels.attention_counters import attention_counters

    NQ, NKV, D = shape
    gen = torch.Generator(device=DEV).manual_seed(rows * 100 + splits)
    kc = torch.randn(PAGES, PAGE, NKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(PAGES, PAGE, NKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    tables = (torch.randperm(PAGES - 1, device=DEV, generator=gen)[: rows * 24].reshape(rows, 24) + 1).int()
    q = torch.zeros(rows, NQ, D, device=DEV, dtype=torch.bfloat16)
    lens = torch.ones(rows, device=DEV, dtype=torch.int32)
    scale = 1 / math.sqrt(D)
    counters = attention_counters(DEV, rows * NKV)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tk.paged_decode_attention(q, kc, vc, tables, lens, scale, splits)  # compiles outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tk.paged_decode_attention(q, kc, vc, tables, lens, scale, splits)
    for replay in range(4):
        q.copy_(torch.randn(rows, NQ, D, device=DEV, dtype=torch.bfloat16, generator=gen))
        lens.copy_(torch.randint(1, 24 * PAGE + 1, (rows,), device=DEV, generator=gen, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert int(counters.abs().sum()) == 0, replay
        ref = ops.paged_decode_attention_ref(q, kc, vc, tables, lens, scale)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(out, tk.paged_decode_attention(q, kc, vc, tables, lens, scale, splits)), replay


# the kernel ahead of the fused attention in a test graph: releases its dependents at once (as the row GEMVs do), then
# spins ~20 us before it writes qkv, so that a fused attention that read qkv before its wait would read the poison
_LATE_COPY = r"""
extern "C" __global__ void late_copy(const u32* __restrict__ src, u32* dst, int words, long long spin) {
  grid_release();
  grid_wait();
  const long long t0 = clock64();
  while (clock64() - t0 < spin) {}
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) dst[i] = src[i];
}
"""


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_fused_rope_attention_waits_for_the_kernel_ahead_in_graph_replays(rows: int) -> None:
    # Llama-3-8B's attention shape; rows 3: a short step of one sequence at 3 consecutive positions (one table);
    # each replay: new qkv (written late by the kernel ahead, poisoned before), new positions; the output and the
    # caches equal rope_and_store_ref + the reference attention, the counters are zero
    import ctypes

    from corolla.engine.kernels import rope_attention_triton as rat
    from corolla.engine.kernels.attention_counters import attention_counters
    from corolla.engine.kernels.nvrtc_kernels import CUDA_HELPERS, NvrtcKernel
    from corolla.engine.spans.span_model import rotary_tables, row_slots

    NQ, NKV, D = LLAMA
    gen = torch.Generator(device=DEV).manual_seed(rows)
    kc = torch.randn(PAGES, PAGE, NKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(PAGES, PAGE, NKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    tables = (torch.randperm(PAGES - 1, device=DEV, generator=gen)[: rows * 24].reshape(rows, 24) + 1).int()
    if rows == 3:
        tables[1:] = tables[0]
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=DEV) / D))
    cos, sin = rotary_tables(inv_freq, 24 * PAGE, DEV)
    width = (NQ + 2 * NKV) * D
    src = torch.zeros(rows, width, device=DEV, dtype=torch.bfloat16)
    qkv = torch.zeros_like(src)
    positions = torch.zeros(rows, device=DEV, dtype=torch.long)
    splits = ops.DecodeOps(DEV, D, use_triton=True).num_splits(rows, NKV, NQ // NKV)
    counters = attention_counters(DEV, rows * NKV)
    late = NvrtcKernel(CUDA_HELPERS + _LATE_COPY, "late_copy", {})
    words = rows * width // 2
    spin = ctypes.c_longlong(40_000)  # ~20 us at ~2 GHz

    def step() -> torch.Tensor:
        args = [ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(qkv.data_ptr()), ctypes.c_int(words), spin]
        late.launch(DEV, (8, 1, 1), 256, 0, args)
        return rat.rope_paged_decode_attention(qkv, cos, sin, positions, kc, vc, tables, D**-0.5, splits, NQ, NKV)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for replay in range(4):
        src.copy_(torch.randn(rows, width, device=DEV, dtype=torch.bfloat16, generator=gen))
        start = int(torch.randint(rows, 24 * PAGE - rows, (1,), device=DEV, generator=gen))
        if rows == 3:  # the later positions first (see the unit test)
            positions.copy_(torch.tensor([start + 2, start + 1, start], device=DEV))
        else:
            positions.copy_(torch.randint(0, 24 * PAGE, (rows,), device=DEV, generator=gen))
        k_ref, v_ref = kc.clone(), vc.clone()
        q = ops.rope_and_store_ref(src, cos, sin, positions, row_slots(tables, positions, PAGE), k_ref, v_ref,
                                   NQ, NKV, D)  # fmt: skip
        ref = ops.paged_decode_attention_ref(q, k_ref, v_ref, tables, (positions + 1).int(), D**-0.5)
        qkv.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert int(counters.abs().sum()) == 0, replay
        assert not out.isnan().any(), replay
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(kc.float(), k_ref.float(), atol=1e-2, rtol=1e-2)
        assert torch.equal(vc, v_ref), replay
