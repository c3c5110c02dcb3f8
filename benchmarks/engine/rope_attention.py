"""GPU micro-benchmark of the rotary decode attention: the fused kernel (`rope_attention_triton`: rotary embedding,
KV write and paged attention in one programmatic launch) against the pair it replaced in the Llama-style decode step
(`triton_kernels.rope_and_store`, then `paged_decode_attention`), per graph bucket of rows, at Llama-3-8B's attention
(32 query heads on 8 kv heads of 128, 64-token pages), each row its own sequence after `--prefix_tokens` tokens.

Each variant runs as one CUDA graph over `--layers` layers' caches (distinct caches: no L2 flattery): alone, and
after a stand-in for the qkv projection ahead of it (`ahead`: a programmatic kernel on every multiprocessor that
releases its dependents at once, spins `--ahead_us`, then writes qkv, as the row GEMVs do), where the attention's
exposed time is the graph's less the stand-in's alone. Medians of the replays (CUDA events), microseconds per layer.
`python -m benchmarks.engine.rope_attention --out DIR`; `--device cpu` (with TRITON_INTERPRET=1) runs each variant
once on a tiny shape instead (a dry run of the code paths)."""

from __future__ import annotations

import argparse
import ctypes
import json
import math
from pathlib import Path

import torch

from benchmarks.common.report import log
from corolla.engine.kernels import rope_attention_triton, triton_kernels
from corolla.engine.kernels.graph_timing import graph_median_ms
from corolla.engine.kernels.nvrtc_kernels import CUDA_HELPERS, NvrtcKernel
from corolla.engine.ops.decode_ops import DecodeOps
from corolla.engine.spans.span_model import rotary_tables, row_slots

PAGE = 64
LLAMA3_8B_ATTENTION = (32, 8, 128)  # query heads, kv heads, head size
TINY_ATTENTION = (4, 2, 32)

# the qkv projection's stand-in: releases its dependents, spins, then copies qkv (what the attention waits for)
_AHEAD = r"""
extern "C" __global__ void ahead(const u32* __restrict__ src, u32* dst, int words, long long spin) {
  grid_release();
  grid_wait();
  const long long t0 = clock64();
  while (clock64() - t0 < spin) {}
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) dst[i] = src[i];
}
"""


def make_layers(rows: int, prefix: int, layers: int, shape: tuple[int, int, int], dev: torch.device):
    """Per layer: k, v caches [pages, PAGE, nkv, D] (bf16 on CUDA) holding `rows` sequences of prefix + 1 tokens;
    the rows' tables [rows, pages per row] (shuffled pages) and positions (all `prefix`)."""
    nq, nkv, d = shape
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    per_row = prefix // PAGE + 1
    pages = rows * per_row + 1
    gen = torch.Generator(device=dev).manual_seed(rows)
    caches = [
        (torch.randn(pages, PAGE, nkv, d, device=dev, dtype=dtype, generator=gen),
         torch.randn(pages, PAGE, nkv, d, device=dev, dtype=dtype, generator=gen))
        for _ in range(layers)
    ]  # fmt: skip
    tables = (torch.randperm(pages - 1, device=dev, generator=gen)[: rows * per_row] + 1).reshape(rows, per_row)
    positions = torch.full((rows,), prefix, device=dev, dtype=torch.long)
    return caches, tables.int(), positions


def bench_rows(rows: int, args, dev: torch.device, lines: list[str]) -> dict:
    shape = LLAMA3_8B_ATTENTION if dev.type == "cuda" else TINY_ATTENTION
    nq, nkv, d = shape
    caches, tables, positions = make_layers(rows, args.prefix_tokens, args.layers, shape, dev)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=dev) / d))
    cos, sin = rotary_tables(inv_freq, args.prefix_tokens + 1, dev)
    dtype = caches[0][0].dtype
    src = torch.randn(rows, (nq + 2 * nkv) * d, device=dev, dtype=dtype)
    qkv = src.clone()
    slots = row_slots(tables, positions, PAGE)
    seq_lens = (positions + 1).int()
    splits = DecodeOps(dev, d, use_triton=dev.type == "cuda").num_splits(rows, nkv, nq // nkv)
    scale = 1 / math.sqrt(d)

    def one(name: str, k: torch.Tensor, v: torch.Tensor) -> None:
        if name == "pair":
            q = triton_kernels.rope_and_store(qkv, cos, sin, positions, slots, k, v, nq, nkv, d)
            triton_kernels.paged_decode_attention(q, k, v, tables, seq_lens, scale, splits)
        else:
            rope_attention_triton.rope_paged_decode_attention(
                qkv, cos, sin, positions, k, v, tables, scale, splits, nq, nkv
            )

    names = ("pair", "fused")
    if dev.type != "cuda":  # dry run: each variant once (interpreted)
        for name in names:
            for k, v in caches:
                one(name, k, v)
        log(lines, f"rows {rows}: {', '.join(names)} ran (dry run)")
        return {}
    ahead_kernel = NvrtcKernel(CUDA_HELPERS + _AHEAD, "ahead", {})
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    spin = ctypes.c_longlong(int(args.ahead_us * args.clock_ghz * 1000))
    params = [ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(qkv.data_ptr()), ctypes.c_int(src.numel() // 2), spin]

    def run(name: str | None, with_ahead: bool) -> None:
        for k, v in caches:
            if with_ahead:
                ahead_kernel.launch(dev, (sms, 1, 1), 128, 0, params)
            if name is not None:
                one(name, k, v)

    out: dict[str, float] = {}
    per_layer = 1000 / len(caches)
    for _ in range(args.rounds):  # alternated rounds; the lowest median per variant
        for key, name, with_ahead in (
            [(n, n, False) for n in names]
            + [("ahead_alone", None, True)]
            + [(f"{n}_after_ahead", n, True) for n in names]
        ):
            ms = graph_median_ms(lambda name=name, with_ahead=with_ahead: run(name, with_ahead), args.reps)
            out[key] = min(out.get(key, math.inf), ms * per_layer)
    for name in names:
        out[f"{name}_exposed"] = out[f"{name}_after_ahead"] - out["ahead_alone"]
    log(lines, f"rows {rows} (splits {splits}): us per layer alone " + ", ".join(f"{n} {out[n]:.2f}" for n in names)
        + f"; after a {args.ahead_us:.0f} us stand-in ({out['ahead_alone']:.2f}) exposed "
        + ", ".join(f"{n} {out[n + '_exposed']:.2f}" for n in names))  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="1,4,16,64", help="graph buckets (rows per call)")
    parser.add_argument("--prefix_tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--ahead_us", type=float, default=10.0, help="the projection stand-in's spin")
    parser.add_argument("--clock_ghz", type=float, default=1.98, help="SM clock for the spin (H200: 1.98)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    dev = torch.device(args.device)
    if dev.type != "cuda":
        args.prefix_tokens, args.layers = min(args.prefix_tokens, 100), min(args.layers, 2)
    args.out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    if dev.type == "cuda":
        log(lines, f"device: {torch.cuda.get_device_name(dev)}")
    results = {f"rows_{r}": bench_rows(int(r), args, dev, lines) for r in args.rows.split(",")}
    (args.out / "rope_attention.json").write_text(json.dumps(results, indent=1))
    (args.out / "rope_attention.log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
