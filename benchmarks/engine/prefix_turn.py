"""Prefix caching on the engine, measured (issue 34's GPU targets): `python -m benchmarks.engine.prefix_turn --out DIR`.

In one process on one device: a span of `--layers` Llama-3-8B-shaped corolla blocks (random bf16 weights on CUDA,
float32 on CPU) over the engine's paged pool, pages as a server has them (64 tokens on CUDA, 16 on CPU).

1. Time to first token of the next turn of a conversation: `--history_tokens` tokens were computed by an earlier
   session and published (its keys: the client's 16-token block hashes); the next turn's prompt is that history plus
   `--new_tokens`. "full prefill" runs the whole prompt in a fresh session (what a server without the cache does);
   "cached" opens a session, attaches the cached pages the keys name (`SpanEngine.attach_prefix`: whole pages) and
   prefills the rest (on CUDA a chunk of at most 256 tokens replays one CUDA graph over all the layers, with the
   paged Triton attention, `engine.graphs.prefill_graphs`; the same chunk run eagerly is timed too). Each is the median of
   `--repeats` synchronized host timings, alternated; the ratio is the target (<= 0.1x). The last position's output of both is compared (max abs difference).
2. A merged decode step of `--decode_sessions` sessions after the prompt, with shared pages (every session attached
   the same cached prefix) vs without (each session prefilled its own), alternated in `--rounds` of `--steps` steps
   (CUDA graphs on CUDA, inputs on the device; host-timed medians); target: shared within 3% of own pages.

3. `--profile`: one cached turn and one full prefill under torch's profiler: device busy time against wall time, kernel
   launches, the kernels and host operations that take the most time (where the cached turn's milliseconds go).
   `--rounds 0` skips part 2.

`--shape tiny --device cpu` dry-runs the code on a tiny model (seconds). Prints a markdown table; `--out` also writes
`prefix_turn.json` and `prefix_turn.md` there."""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.common.engine_steps import device_token_inputs, merged_decode_ms
from benchmarks.common.measure import sync
from benchmarks.common.model import NAMED_SHAPES, random_blocks
from benchmarks.common.report import log
from corolla.engine.config import EngineConfig
from corolla.engine.span_engine import EngineSession, SpanEngine
from corolla.protocol.prefix import PrefixKeys, chain_hashes, prefix_root
from corolla.server.core.engine_executor import CPU_PAGE_TOKENS, GPU_PAGE_TOKENS

NAMESPACE = "bench/"
T = TypeVar("T")


def build_engine(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> SpanEngine:
    """`--layers` llama blocks with random weights (built on `device`) under an engine whose pool holds every
    session of the run."""
    config = replace(NAMED_SHAPES[args.shape], num_layers=args.layers).hf_config()
    blocks = random_blocks(config, args.layers, device, dtype)
    page = GPU_PAGE_TOKENS if device.type == "cuda" else CPU_PAGE_TOKENS
    engine_config = EngineConfig(
        kv_pool_bytes=args.kv_pool_gib << 30, page_size_tokens=page, max_seq_len_tokens=8192,
        max_batch_rows=args.decode_sessions, graph_buckets=tuple(sorted({1, args.decode_sessions})),
    )  # fmt: skip
    engine = SpanEngine.from_blocks(blocks, engine_config)
    assert engine.fused, "the llama span runs on fused kernels"
    engine.warmup()
    return engine


def timed_ms(fn: Callable[[], T], device: torch.device) -> tuple[float, T]:
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return (time.perf_counter() - start) * 1000, result


def turn_ms(engine: SpanEngine, prompt: torch.Tensor, keys: PrefixKeys | None, max_length: int):
    """One next turn: (ms to the last position's output, positions reused, that output [H], host ms until the
    step returned: the rest is the device finishing queued work); the session closes afterwards (its own pages go
    back, the cached ones stay)."""
    device = engine.device
    returned: list[float] = []

    def run() -> tuple[int, torch.Tensor]:
        start = time.perf_counter()
        with engine.open_session(1, max_length) as session:
            hit = 0 if keys is None else engine.attach_prefix(session, NAMESPACE, keys)
            out = engine.step(session, prompt[:, hit:], hit)  # [1, T - hit, H]
        returned.append((time.perf_counter() - start) * 1000)
        return hit, out[0, -1]

    ms, (hit, last) = timed_ms(run, device)
    return ms, hit, last, returned[0]


@contextlib.contextmanager
def eager_prefill(engine: SpanEngine) -> Iterator[None]:
    """The engine without its prefill graphs meanwhile (every chunk eager: the A/B of the graphs)."""
    graphs, engine.prefill_graphs = engine.prefill_graphs, None
    try:
        yield
    finally:
        engine.prefill_graphs = graphs


def profile_turn(engine: SpanEngine, prompt: torch.Tensor, keys: PrefixKeys | None, max_length: int) -> list[str]:
    """One turn under torch's profiler -> markdown lines: wall ms (inflated by the profiler), device busy ms, kernel
    launches, the top kernels by device time and the top host operations by their own host time."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        ms, hit, _, host_ms = turn_ms(engine, prompt, keys, max_length)
    events = list(prof.key_averages())
    # the device's own events only: a host operation (aten::mm) also carries its kernels' device time
    on_device = (e for e in events if e.device_type != DeviceType.CPU and e.self_device_time_total > 0)
    kernels = sorted(on_device, key=lambda e: -e.self_device_time_total)
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1000
    launches = sum(e.count for e in kernels)
    on_host = (e for e in events if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0)
    host = sorted(on_host, key=lambda e: -e.self_cpu_time_total)
    lines = [
        f"{prompt.shape[1] - hit} positions computed: wall {ms:.2f} ms under the profiler (step returned after "
        f"{host_ms:.2f} ms), device busy {busy_ms:.2f} ms, {launches} kernel launches",
        "",
        "| kernel | calls | device ms |",
        "|---|---|---|",
    ]
    lines += [f"| {e.key[:90]} | {e.count} | {e.self_device_time_total / 1000:.3f} |" for e in kernels[:12]]
    lines += ["", "| host operation | calls | own host ms |", "|---|---|---|"]
    lines += [f"| {e.key[:90]} | {e.count} | {e.self_cpu_time_total / 1000:.3f} |" for e in host[:12]]
    return lines


def decode_step_ms(engine: SpanEngine, sessions: list[EngineSession], position: int, steps: int, gen) -> list[float]:
    """Host ms of `steps` merged single-token steps of `sessions` from `position` (inputs on the device)."""
    return merged_decode_ms(engine, sessions, position, device_token_inputs(engine, len(sessions), steps, gen))


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b", choices=list(NAMED_SHAPES))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--history_tokens", type=int, default=4000, help="the conversation so far (cached)")
    p.add_argument("--new_tokens", type=int, default=100, help="the next turn's new prompt tokens")
    p.add_argument("--repeats", type=int, default=5, help="timings per way of the next turn")
    p.add_argument("--decode_sessions", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="decode steps per round and way")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kv_pool_gib", type=int, default=16)
    p.add_argument("--profile", action="store_true", help="profile one cached turn and one full prefill")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    lines: list[str] = []
    torch.manual_seed(0)
    gen = torch.Generator(device=device).manual_seed(0)
    built = time.perf_counter()
    engine = build_engine(args, device, dtype)
    page = engine.pool.page_size_tokens
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    log(lines, f"engine: {args.layers} x {args.shape} layers, {dtype}, {name}, page {page} tokens, "
               f"built in {time.perf_counter() - built:.0f} s")  # fmt: skip

    total = args.history_tokens + args.new_tokens
    max_length = total + args.rounds * args.steps + 8
    h = engine.hidden_size
    prompt = (torch.randn(1, total, h, device=device, generator=gen) * 0.5).to(dtype)  # [1, T, H]
    token_ids = list(range(7, 7 + total))  # the client names its tokens; the server only sees their hashes
    root = prefix_root(model=f"bench-{args.shape}-{args.layers}")
    # the keys of the history only: the next turn's own new pages are never published, so every repeat finds the
    # cache as the first did (a real next turn sends the keys of its whole prompt and publishes them for the next)
    keys = PrefixKeys(0, tuple(chain_hashes(root, token_ids[: args.history_tokens])))

    # turn 1: the history, computed once and published when its session closes
    with engine.open_session(1, max_length) as first:
        engine.attach_prefix(first, NAMESPACE, keys)
        engine.step(first, prompt[:, : args.history_tokens], 0)
    cached_pages = engine.pool.layer_pages_cached // args.layers
    log(lines, f"turn 1: {args.history_tokens} tokens computed, {cached_pages} pages cached "
               f"({engine.pool.cached_bytes / 2**30:.2f} GiB)")  # fmt: skip

    # 1. the next turn's time to first token, full prefill vs cached prefix (alternated)
    graphs = engine.prefill_graphs
    first_full = turn_ms(engine, prompt, None, max_length)[0]  # warm-up of every way (kernels, allocator)
    first_cached = turn_ms(engine, prompt, keys, max_length)[0]  # (captures the chunk's graph)
    if graphs is not None:
        log(lines, f"first turns after the engine's warm-up: full prefill {first_full:.1f} ms, cached {first_cached:.1f} "
                   f"ms (its graph captured then; the prefill graphs' warm-up took {graphs.warmup_s:.2f} s: every "
                   f"row bucket's attention launch chosen, its kernels compiled)")  # fmt: skip
    with eager_prefill(engine):
        turn_ms(engine, prompt, keys, max_length)
    full, cached, cached_host, eager, hit, diff = [], [], [], [], 0, 0.0
    for _ in range(args.repeats):
        ms, _, full_last, _ = turn_ms(engine, prompt, None, max_length)
        full.append(ms)
        ms, hit, cached_last, host_ms = turn_ms(engine, prompt, keys, max_length)
        cached.append(ms)
        cached_host.append(host_ms)
        diff = max(diff, float((full_last.float() - cached_last.float()).abs().max()))
        with eager_prefill(engine):
            eager.append(turn_ms(engine, prompt, keys, max_length)[0])
    ratio = median(cached) / median(full)
    log(lines, "")
    log(lines, f"| next turn: {args.history_tokens} history + {args.new_tokens} new tokens | ms to first token "
               f"(median of {args.repeats}) | positions computed |")  # fmt: skip
    log(lines, "|---|---|---|")
    log(lines, f"| full prefill (no cache) | {median(full):.1f} | {total} |")
    log(lines, f"| cached prefix ({hit} positions reused; the step returned after {median(cached_host):.1f} ms) | "
               f"{median(cached):.1f} | {total - hit} |")  # fmt: skip
    log(lines, f"| cached prefix, chunk run eagerly (no prefill graphs) | {median(eager):.1f} | {total - hit} |")
    log(lines, f"| ratio (target <= 0.1x) | {ratio:.3f}x | last output max abs diff {diff:.3g} |")
    graph_record = {}
    if graphs is not None:
        launches = {rows: str(config) for rows, config in graphs.attention_configs.items()}
        graph_record = dict(
            prefill_graphs=graphs.graph_count, prefill_graph_reserved_bytes=graphs.reserved_bytes,
            prefill_attention_launches=launches, prefill_graphs_warmup_s=graphs.warmup_s,
            first_full_prefill_ms=first_full, first_cached_turn_ms=first_cached,
        )  # fmt: skip
        log(lines, f"prefill graphs: {graphs.graph_count} captured, {graphs.reserved_bytes / 2**20:.1f} MiB reserved "
                   f"by their captures, {graphs.chunks} chunks, capture error: {graphs.capture_error}, attention "
                   f"launch by row bucket: {launches}")  # fmt: skip

    if args.profile:
        for label, way in (("cached turn", keys), ("full prefill", None)):
            log(lines, "")
            log(lines, f"profile, {label}: " + "\n".join(profile_turn(engine, prompt, way, max_length)))
    record = dict(
        args={k: str(v) for k, v in vars(args).items()}, device=name, page_tokens=page, hit_tokens=hit,
        full_prefill_ms=full, cached_turn_ms=cached, cached_turn_host_ms=cached_host, ttft_ratio=ratio,
        last_output_max_abs_diff=diff, cached_turn_eager_ms=eager, **graph_record,
    )  # fmt: skip
    if args.rounds > 0:
        record.update(decode_comparison(args, engine, prompt, keys, max_length, gen, lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefix_turn.json").write_text(json.dumps(record, indent=1))
        (args.out / "prefix_turn.md").write_text("\n".join(lines) + "\n")
    return 0


def decode_comparison(
    args: argparse.Namespace,
    engine: SpanEngine,
    prompt: torch.Tensor,
    keys: PrefixKeys,
    max_length: int,
    gen: torch.Generator,
    lines: list[str],
) -> dict:
    """Part 2: merged decode steps of sessions sharing one cached prefix vs sessions with their own pages."""
    total = prompt.shape[1]
    own = [engine.open_session(1, max_length) for _ in range(args.decode_sessions)]
    shared = [engine.open_session(1, max_length) for _ in range(args.decode_sessions)]
    for session in own:
        engine.step(session, prompt, 0)
    for session in shared:
        reused = engine.attach_prefix(session, NAMESPACE, keys)
        engine.step(session, prompt[:, reused:], reused)
    distinct = {page for s in shared for page in s.slots[0].pages}
    decode_step_ms(engine, own, total, 2, gen)  # warm-up (graph replays)
    decode_step_ms(engine, shared, total, 2, gen)
    own_ms: list[float] = []
    shared_ms: list[float] = []
    position = total + 2
    for _ in range(args.rounds):  # rounds alternate the ways: both see the same clocks and neighbours
        own_ms += decode_step_ms(engine, own, position, args.steps, gen)
        shared_ms += decode_step_ms(engine, shared, position, args.steps, gen)
        position += args.steps
    for session in own + shared:
        session.close()
    change = median(shared_ms) / median(own_ms) - 1
    log(lines, "")
    log(lines, f"| decode step, {args.decode_sessions} sessions at position ~{total} | median ms | pages held |")
    log(lines, "|---|---|---|")
    log(lines, f"| own pages (each session prefilled its prompt) | {median(own_ms):.3f} | "
               f"{sum(len(s.slots[0].pages) for s in own)} |")  # fmt: skip
    log(lines, f"| shared pages (one cached prefix attached by all) | {median(shared_ms):.3f} | {len(distinct)} |")
    log(lines, f"| shared vs own (target within 3%) | {change * 100:+.1f}% | |")
    return dict(decode_own_ms=own_ms, decode_shared_ms=shared_ms, decode_shared_vs_own=change)


if __name__ == "__main__":
    raise SystemExit(main())
