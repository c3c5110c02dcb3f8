"""The decode attention's splits by the rows' pages (`DecodeOps.attention_splits`) against one split count for the
whole batch (`DecodeOps.num_splits`, every row split alike): `python -m benchmarks.engine.attention_splits` on a GPU.

One Llama-3-8B layer's paged decode attention (32 query heads on 8 kv heads, head size 128, bf16, the pool's 64-token
pages, shuffled) for batches of equal rows and batches with one long row among short ones; each variant's launch
captured in a CUDA graph and replayed (`--replays` launches a timing, median of `--timings`). Variants: `batch`
(num_splits for the batch, every row split over them: the rule before) and `rows` (attention_splits: the product's).
Prints one JSON line per batch. `--sweep_rows R` (> 0) then times R rows of each of `--sweep_tokens` with every
pages_per_split of `--sweep_pages` at the grid's splits for R rows (one JSON line per length). `--engine_layers N` (> 0) then
times a whole merged decode step of N random Llama-3-8B bf16 layers (`SpanEngine.decode_many`, CUDA graphs) for 64
sessions, 63 of `--short_tokens` and one of `--long_tokens`, with the rule before and the product's (an engine each,
alternated `--engine_rounds` times; median ms a step)."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from benchmarks.engine.quant import LLAMA3_8B, random_layer
from benchmarks.field.verify_tolerance import engine_over
from corolla.engine.kernels import triton_kernels
from corolla.engine.kernels.graph_timing import graph_median_ms
from corolla.engine.ops.decode_ops import DecodeOps
from corolla.engine.span_engine import SpanEngine, StepRequest

HEADS, KV_HEADS, HEAD_DIM, PAGE_TOKENS = 32, 8, 128, 64
BATCHES = {
    "64 x 512": [512] * 64,
    "32 x 512": [512] * 32,
    "16 x 512": [512] * 16,
    "8 x 128": [128] * 8,
    "1 x 128": [128],
    "63 x 512 + 4096": [512] * 63 + [4096],
    "63 x 512 + 16384": [512] * 63 + [16384],
    "8 x 512": [512] * 8,
    "7 x 512 + 8192": [512] * 7 + [8192],
    "1 x 512": [512],
    "1 x 8192": [8192],
}


def _cache(lengths: list[int], device: torch.device, gen: torch.Generator):
    pages = [-(-n // PAGE_TOKENS) for n in lengths]
    total = sum(pages)
    k = torch.randn(total, PAGE_TOKENS, KV_HEADS, HEAD_DIM, device=device, generator=gen).to(torch.bfloat16)
    v = torch.randn(total, PAGE_TOKENS, KV_HEADS, HEAD_DIM, device=device, generator=gen).to(torch.bfloat16)
    order = torch.randperm(total, device=device, generator=gen).to(torch.int32)
    tables = torch.zeros(len(lengths), max(pages), dtype=torch.int32, device=device)
    first = 0
    for row, n in enumerate(pages):
        tables[row, :n] = order[first : first + n]
        first += n
    q = torch.randn(len(lengths), HEADS, HEAD_DIM, device=device, generator=gen).to(torch.bfloat16)
    return q, k, v, tables, torch.tensor(lengths, dtype=torch.long, device=device) - 1  # rows' positions


def _timed_us(run, replays: int, timings: int) -> float:
    """Median device us of one `run` launch: `replays` launches in one CUDA graph, `timings` replays."""
    return graph_median_ms(lambda: [run() for _ in range(replays)], timings) * 1e3 / replays


ENGINE_ROWS, ENGINE_STEPS = 64, 20


def _engine_step_ms(engine: SpanEngine, sessions: list, steps: int) -> float:
    """Median ms of `steps` merged decode steps of every session (hidden states on the CPU, as a server's)."""
    hidden = torch.randn(1, 1, LLAMA3_8B.hidden_size).to(torch.bfloat16)  # [1, 1, H]
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.decode_many([StepRequest(s, hidden, s.length_tokens) for s in sessions])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def engine_steps(args: argparse.Namespace, device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(1)
    layers = [random_layer(LLAMA3_8B, device, gen) for _ in range(args.engine_layers)]
    lengths = [args.short_tokens] * (ENGINE_ROWS - 1) + [args.long_tokens]
    total = args.long_tokens + (args.engine_rounds + 1) * ENGINE_STEPS + 64
    engines = {}
    for variant in ("batch", "rows"):
        engine = engine_over(
            LLAMA3_8B, layers, triton=True, rows=ENGINE_ROWS, tokens=total, graphs=True, buckets=(ENGINE_ROWS,)
        )
        if variant == "batch":  # the rule before: the batch's splits for every row
            ops = engine.model.ops  # type: ignore[attr-defined]
            ops.attention_splits = lambda b, n, g, p, ops=ops: (ops.num_splits(b, n, g), 1)
        sessions = [engine.open_session(1, total) for _ in lengths]
        for session, n in zip(sessions, lengths, strict=True):
            engine.step(session, torch.randn(1, n, LLAMA3_8B.hidden_size, device=device).to(torch.bfloat16), 0)
        engines[variant] = (engine, sessions)
    times: dict[str, list[float]] = {"batch": [], "rows": []}
    for _ in range(args.engine_rounds):
        for variant, (engine, sessions) in engines.items():
            times[variant].append(_engine_step_ms(engine, sessions, ENGINE_STEPS))
    return {
        "engine_layers": args.engine_layers, "rows": ENGINE_ROWS, "short_tokens": args.short_tokens,
        "long_tokens": args.long_tokens, "device": torch.cuda.get_device_name(),
        **{f"{v}_ms": round(statistics.median(t), 3) for v, t in times.items()}, "runs_ms": times,
    }  # fmt: skip


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--timings", type=int, default=15)
    p.add_argument("--engine_layers", type=int, default=0)
    p.add_argument("--engine_rounds", type=int, default=3)
    p.add_argument("--short_tokens", type=int, default=512)
    p.add_argument("--long_tokens", type=int, default=4096)
    p.add_argument("--sweep_rows", type=int, default=0)
    p.add_argument("--sweep_tokens", default="128,512,1024,2048,4096,8192")
    p.add_argument("--sweep_pages", default="1,2,4,8,16")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    ops = DecodeOps(device, HEAD_DIM, use_triton=True)
    gen = torch.Generator(device=device).manual_seed(0)
    scale = HEAD_DIM**-0.5
    for name, lengths in BATCHES.items():
        q, k, v, tables, positions = _cache(lengths, device, gen)
        base = ops.num_splits(len(lengths), KV_HEADS, HEADS // KV_HEADS)
        splits, pages = ops.attention_splits(len(lengths), KV_HEADS, HEADS // KV_HEADS, PAGE_TOKENS)
        variants = {
            "batch": functools.partial(triton_kernels.paged_decode_attention, q, k, v, tables, positions, scale, base),
            "rows": functools.partial(ops.paged_decode_attention, q, k, v, tables, positions, scale),  # the product's
        }
        outputs: dict[str, torch.Tensor] = {}
        row: dict[str, object] = {"lengths": name, "device": torch.cuda.get_device_name()}
        for variant, run in variants.items():
            outputs[variant] = run().float()
            us = round(_timed_us(run, args.replays, args.timings), 2)
            row[variant] = (
                {"splits": base, "us": us} if variant == "batch" else {"splits": splits, "pages": pages, "us": us}
            )
        row["max_diff_rows_vs_batch"] = float((outputs["rows"] - outputs["batch"]).abs().max())
        print(json.dumps(row), flush=True)
    if args.sweep_rows > 0:
        splits, _ = ops.attention_splits(args.sweep_rows, KV_HEADS, HEADS // KV_HEADS, PAGE_TOKENS)
        for tokens in (int(t) for t in args.sweep_tokens.split(",")):
            q, k, v, tables, positions = _cache([tokens] * args.sweep_rows, device, gen)
            swept: dict[str, object] = {"rows": args.sweep_rows, "tokens": tokens, "splits": splits}
            for pps in (int(x) for x in args.sweep_pages.split(",")):
                run = functools.partial(
                    triton_kernels.paged_decode_attention,
                    q,
                    k,
                    v,
                    tables,
                    positions,
                    scale,
                    splits,
                    pages_per_split=pps,
                )
                swept[f"pages_per_split={pps}"] = round(_timed_us(run, args.replays, args.timings), 2)
            print(json.dumps(swept), flush=True)
    if args.engine_layers > 0:
        print(json.dumps(engine_steps(args, device)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
