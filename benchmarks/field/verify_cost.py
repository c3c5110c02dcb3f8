"""What verification by shadow sessions costs a replica's throughput, on the built path (issue 37's target: <= 5%):
`python -m benchmarks.field.verify_cost --graphs --out DIR` on a GPU (`--tiny` dry-runs the code on the CPU, where the
CPU's own forward is most of the time; `--simulated_forward_ms MS` measures the replica's host work alone on the CPU:
one Llama-3-8B-wide layer on the launched CUDA-graph path, each graph a timed no-op on a simulated device,
`benchmarks.users.device_cpu`). None of the client's shadow code runs here (its cost: `verify_client_cost`).

A span of random Llama-3-8B-shaped bf16 layers is served by the server's own device path: its `Runtime` (the device
thread, the priority queue that merges steps, the gather rule, launch-ahead and held launches) and `EngineExecutor`
(Triton kernels on CUDA, paged pool; `--graphs`: decode steps replay CUDA graphs of the buckets `rows`, `rows + 16`,
... up to room for every shadow's row or one shadow's prompt and `BUCKET_ROWS` more), in a process with a GPU
server's GIL switch interval. Each step's inputs reach the executor as a server's front hands them over: the hidden
states' bytes in CPU memory (`StepInputs.hidden_bytes`), so that merged decode steps take the launched-forward path a
server's do (with inputs already on the device, as this bench had them before, every forward ran to its end before
the next was popped: no launch-ahead, and host work the server does not do). `rows` real sessions, each a client
coroutine that sends its next step as soon as the last came back: its `--prompt`-token prefill, then `steps`
single-token decode steps. With verification, `shadows` more sessions (`round(fraction x rows)`, at least one; a lone
session's shadow is counted at the fraction, its expectation) are opened marked `shadow` (`SessionSpec.shadow`, as
`protocol.shadow` marks them on the wire) and mirror the inputs of real sessions 0..shadows-1 as `client.shadows`
sends them: the prefill in chunks of `SHADOW_CHUNK_TOKENS`, then the decode positions `SHADOW_BATCH_ROWS` at a time,
each request sent as soon as its real session has done those positions and the shadow's previous request came back
(a client's shadow worker is never ahead of its session; here it is never further behind it than it holds: the most
the replica has to do at once). Sessions of a swarm start at different times, so their shadows' requests fall on
different steps; here the real sessions start together and step in lockstep, so shadow j's first decode request
holds j x `SHADOW_BATCH_ROWS` / shadows positions (or all of them), which spreads the shadows' requests evenly over
the steps as different starts would.

Timed, `--repeats` times each after one untimed warm-up of each, without and with shadows, their order alternated
from one repeat to the next (a drift over the process's runs hits both alike; a garbage collection before each run).
Per run: the real sessions' prompts phase (from the start to the last real prefill)
and decode phase (from there to the last real decode step); cost = time with shadows / time without - 1 (their
tokens/s: what the replica's users lose), as medians and per repeat (`cost_decode_real_pairs`: median, quartiles,
extremes); over the decode phase (as its time: before, the shadows' and real prefills were in them), the runtime's
busy seconds (`Runtime.stats`: every batch, from its launch to its results; `cost_busy`), of them the device's own
seconds on the launched decode forwards (`cost_device`), and the host's CPU seconds (this process's event loop, where
the clients and the executor's step intake run, plus the runtime thread: `cost_host_cpu`), the two resources a
replica's throughput is bound by, also per shadow row (the runtime thread's), per shadow request (the loop's) and
per forward (the runtime thread's). How the runtime batched the steps, per run: forwards per real decode step, rows
per forward, and its gather rule's learned return and forward times (whether it held launches:
docs/decisions/0002, 0009). The per-step latency of the real decode steps (median, p99) is reported for both. The
shadows' outputs are compared with the real sessions' at every position (`stretches.position_errors` against
`output_checks.verify_rtol`: an honest server must never be banned)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

from benchmarks.common.measure import thread_cpu_s
from benchmarks.engine.quant import LLAMA3_8B, TINY, random_layer
from benchmarks.field.verify_tolerance import engine_over, standin_backend
from benchmarks.users.device_cpu import SPEC as SIMULATED_SPEC
from benchmarks.users.device_cpu import simulated_engine
from corolla.client.calls.output_checks import verify_rtol
from corolla.client.session.shadows import DEFAULT_SHADOW_FRACTION, SHADOW_BATCH_ROWS, SHADOW_CHUNK_TOKENS
from corolla.client.verification.stretches import position_errors
from corolla.engine.graph_decode import host_bytes
from corolla.engine.spans.fast_llama import LayerWeights, LlamaSpec
from corolla.server.core.engine_executor import EngineExecutor, shorten_gil_switch_interval
from corolla.server.core.executor import SessionSpec, StepInputs
from corolla.server.core.runtime import Runtime
from corolla.utils.tensor_bytes import TensorBytes

BUCKET_ROWS = 16  # the graph buckets' step: rows, rows + 16, ... (a server's buckets are finer still)


def shadow_rows(rows: int, fraction: float) -> int:
    """Shadows of `rows` sessions sampled whole with probability `fraction` (the expected number, rounded; >= 1)."""
    return max(1, round(fraction * rows))


class Progress:
    """A real session's decode steps done so far, which its shadow waits for (`reach`)."""

    def __init__(self) -> None:
        self.done = 0
        self._waiter: asyncio.Future[None] | None = None
        self._target = 0

    def advance(self) -> None:
        self.done += 1
        if self._waiter is not None and self.done >= self._target and not self._waiter.done():
            self._waiter.set_result(None)

    async def reach(self, target: int) -> None:
        if self.done < target:
            self._waiter, self._target = asyncio.get_running_loop().create_future(), target
            await self._waiter
            self._waiter = None


def _inputs(raw: memoryview, dtype: torch.dtype, start: int, end: int, hidden: int) -> StepInputs:
    """Positions [start, end) of one sequence as a server's front hands a step to its core: the hidden states' bytes
    as they came off the wire (CPU memory: a launched forward stages them with a memcpy)."""
    row = hidden * dtype.itemsize
    return StepInputs(
        None, start, None, None, "", False, raw[start * row : end * row], (dtype, (1, end - start, hidden))
    )


async def _session(
    executor: EngineExecutor, cache, inputs: torch.Tensor, prompt: int, steps: int, chunk: int, record: dict,
    progress: Progress, mirrors: Progress | None = None, phase: int = 0, prefilled: Callable[[], None] | None = None,
) -> None:  # fmt: skip
    """One client of a session: `inputs` [1, prompt + steps, H] (CPU): the prefill (in chunks of `chunk` tokens),
    then one decode step at a time (`progress` advanced after each); a shadow (`mirrors`: its real session's
    progress) sends the decode positions `SHADOW_BATCH_ROWS` at a time once its real session has done them (the first
    request `phase` of them, where > 0: the module docstring). `record`: prefill end time, each real decode step's
    latency, the decode steps' outputs ([steps, H]); `prefilled` is called once its prefill is done.

    Each step's output rows are copied once into `record`'s outputs as they come back, as a server's front copies
    them into the step's reply, and the step's output is let go: a launched step's output views its forward's host
    buffer (`graph_decode.HostOutput`), which a server's runtime takes again for a later forward once the replies are
    sent; an output kept to the end of the run kept its buffer out of use, so that every forward's output went into a
    new buffer, its rows written into fresh pages (a cost per row, shadow rows' too, that a server does not pay:
    docs/decisions/0157)."""
    raw, dtype, hidden = host_bytes(inputs[0].contiguous()), inputs.dtype, inputs.shape[2]
    # the kept outputs [steps, H], written before the run (no page first touched inside it)
    kept = torch.zeros(steps, hidden, dtype=dtype)
    kept_bytes, row = host_bytes(kept), hidden * dtype.itemsize
    for start in range(0, prompt, chunk):
        await executor.step(cache, _inputs(raw, dtype, start, min(prompt, start + chunk), hidden))
    record["prefilled"] = time.perf_counter()
    if prefilled is not None:
        prefilled()
    latencies = []
    t = 0
    while t < steps:
        n = 1 if mirrors is None else min((t == 0 and phase) or SHADOW_BATCH_ROWS, steps - t)
        if mirrors is not None:
            await mirrors.reach(t + n)
        position = prompt + t
        started = time.perf_counter()
        out = await executor.step(cache, _inputs(raw, dtype, position, position + n, hidden))
        latencies.append(time.perf_counter() - started)
        _keep(out, kept, kept_bytes, t * row, (t + n) * row)
        del out  # (its forward's host buffer is free for another forward once no step's output views it)
        progress.advance()
        t += n
    record["done"], record["latencies"], record["outputs"] = time.perf_counter(), latencies, kept


def _keep(out: torch.Tensor | TensorBytes, kept: torch.Tensor, kept_bytes: memoryview, start: int, end: int) -> None:
    """A step's output [1, n, H] copied into bytes [start, end) of `kept` [steps, H] (`kept_bytes`: its bytes): a
    launched step's bytes with one memcpy, as a front's reply copies them (`StepPort.reply_joined`), else the
    tensor's rows."""
    if isinstance(out, TensorBytes):
        kept_bytes[start:end] = out.data
    else:
        row = kept_bytes.nbytes // kept.shape[0]
        kept[start // row : end // row] = out[0]


def _totals(runtime: Runtime) -> tuple[float, float, int]:
    """The runtime's busy seconds, device seconds (`KindStats.device_s`: CUDA events around each graph-replayed decode
    forward; 0 on the CPU) and batches so far, over every kind."""
    stats = runtime.stats().values()
    return sum(s.busy_s for s in stats), sum(s.device_s for s in stats), sum(s.batches for s in stats)


def _spread(values: list[float]) -> dict:
    """Median, quartiles and extremes of per-pair costs."""
    values = sorted(values)
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": round(statistics.median(values), 4), "quartiles": [round(quartiles[0], 4),
            round(quartiles[2], 4)], "min": round(values[0], 4), "max": round(values[-1], 4)}  # fmt: skip


KEYS = ("prefill_real_s", "decode_real_s", "busy_s", "device_s", "host_cpu_s", "loop_cpu_s", "runtime_cpu_s",
        "batches", "forwards_per_step", "rows_per_forward", "step_p50_ms", "step_p99_ms")  # fmt: skip


def measure(spec: LlamaSpec, layers: list[LayerWeights], rows: int, steps: int, args: argparse.Namespace) -> dict:
    device = layers[0].ln1.device
    total = args.prompt + steps
    # no inference mode here: the pool's tensors are written by the runtime's thread, as a server's are; the inputs
    # in CPU memory, as a server receives them
    gen = torch.Generator().manual_seed(rows * 1000 + steps)
    inputs = torch.randn(rows, total, spec.hidden_size, generator=gen).to(torch.bfloat16)  # [R, T, H]
    shadows = shadow_rows(rows, args.fraction)
    # a forward's rows: the real sessions' and room for the shadows' (one row per shadow, or a shadow's prompt, and a
    # bucket more: the shadows' rows come in bursts, and where they fill every spare row the replica falls behind and
    # their aged requests take real rows' places), in buckets of `BUCKET_ROWS`
    room = max(shadows, min(args.prompt, SHADOW_CHUNK_TOKENS)) + BUCKET_ROWS
    buckets = tuple(rows + k for k in range(0, room + BUCKET_ROWS, BUCKET_ROWS))
    if args.simulated_forward_ms is None:
        engine = engine_over(spec, layers, triton=device.type == "cuda", rows=rows + shadows, tokens=total,
                             graphs=args.graphs, buckets=buckets)  # fmt: skip
        on_device: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    else:  # the CUDA-graph path, each forward a timed no-op on a simulated device (`benchmarks.users.device_cpu`)
        engine = simulated_engine(buckets[-1], total, args.simulated_forward_ms / 1e3)
        stream = engine.graphs.stream  # type: ignore[union-attr]

        def on_device() -> contextlib.AbstractContextManager:
            return mock.patch.object(torch.cuda, "current_stream", lambda device=None: stream)

    backend = standin_backend(spec, len(layers), device)

    def run(with_shadows: bool) -> dict:
        gc.collect()  # (not inside the timed window)
        with on_device(), Runtime(max_batch_size_tokens=4096, device=device) as runtime:
            executor = EngineExecutor(backend, engine, runtime)  # type: ignore[arg-type]
            result = asyncio.run(_run(runtime, executor, with_shadows))
            result["held_launches"], result["gather_skipped"] = runtime.num_held_launches, runtime.gather.num_skipped
            result["return_ms"] = None if runtime.gather.return_s is None else 1e3 * runtime.gather.return_s
            result["forward_ms"] = None if runtime.gather.forward_s is None else 1e3 * runtime.gather.forward_s
        return result

    async def _run(runtime: Runtime, executor: EngineExecutor, with_shadows: bool) -> dict:
        blocks = tuple(range(len(layers)))
        specs = [SessionSpec(blocks, 1, total) for _ in range(rows)]
        specs += [SessionSpec(blocks, 1, total, shadow=True) for _ in range(shadows if with_shadows else 0)]
        caches = []
        opened = []
        for spec_ in specs:
            context = executor.open_session(spec_, None)
            caches.append(await context.__aenter__())
            opened.append(context)
        records: list[dict] = [{} for _ in specs]
        started = time.perf_counter()
        progress = [Progress() for _ in specs]
        # the decode phase's totals start when the last real prefill is done (as its time does): the host's CPU
        # seconds of this loop's clients and of the runtime thread, the runtime's busy and device seconds
        decode: dict = {"waiting": rows}

        def prefilled() -> None:
            decode["waiting"] -= 1
            if decode["waiting"] == 0:
                decode["totals"], decode["rows"] = _totals(runtime), executor.inference_tokens
                decode["cpu"] = time.thread_time(), thread_cpu_s(runtime.thread)

        # shadow j's first decode request: j x SHADOW_BATCH_ROWS / shadows positions (the shadows' requests spread
        # evenly over the steps, as sessions starting at different times would send them)
        clients = [
            _session(executor, cache, inputs[i % rows : i % rows + 1], args.prompt, steps,
                     args.prompt if i < rows else SHADOW_CHUNK_TOKENS, records[i], progress[i],
                     None if i < rows else progress[i - rows], (i - rows) * SHADOW_BATCH_ROWS // max(1, shadows),
                     prefilled if i < rows else None)
            for i, cache in enumerate(caches)
        ]  # fmt: skip
        await asyncio.gather(*clients)
        cpu_before = decode["cpu"]
        loop_cpu_s, runtime_cpu_s = time.thread_time() - cpu_before[0], thread_cpu_s(runtime.thread) - cpu_before[1]
        totals = zip(_totals(runtime), decode["totals"], strict=True)
        busy_s, device_s, batches = (after - earlier for after, earlier in totals)
        for context in opened:
            await context.__aexit__(None, None, None)
        real, mirror = records[:rows], records[rows:]
        errors = None
        if mirror:  # real session j against its shadow, every decode position
            claimed = torch.stack([r["outputs"] for r in real[: len(mirror)]])  # [V, S, H]
            recomputed = torch.stack([r["outputs"] for r in mirror])
            errors = position_errors(claimed, recomputed).flatten().float().cpu()
        latencies = sorted(x for r in real for x in r["latencies"])
        return {
            "prefill_real_s": max(r["prefilled"] for r in real) - started,
            "decode_real_s": max(r["done"] for r in real) - max(r["prefilled"] for r in real),
            "busy_s": busy_s,
            "device_s": device_s,
            "batches": batches,
            "forwards_per_step": batches / steps,
            "rows_per_forward": (executor.inference_tokens - decode["rows"]) / max(1, batches),
            "step_p50_ms": 1e3 * latencies[len(latencies) // 2],
            "step_p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "host_cpu_s": loop_cpu_s + runtime_cpu_s,
            "loop_cpu_s": loop_cpu_s,
            "runtime_cpu_s": runtime_cpu_s,
            "errors": errors,
        }

    run(False)  # compiles the kernels and captures the graphs of the buckets
    run(True)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for repeat in range(args.repeats):  # alternated (ABBA...): a drift over the process hits both alike
        for variant in (False, True) if repeat % 2 == 0 else (True, False):
            runs[variant].append(run(variant))
    scale = args.fraction * rows / shadows  # the expected shadows over the measured ones
    off, on = ({k: statistics.median(r[k] for r in runs[v]) for k in KEYS} for v in (False, True))

    def cost(key: str) -> float | None:
        return round(scale * (on[key] / off[key] - 1), 4) if off[key] else None

    # each timed pair (the two runs of one repeat, next to each other): the spread behind the medians
    pairs = [
        scale * (b["decode_real_s"] / a["decode_real_s"] - 1) for a, b in zip(runs[False], runs[True], strict=True)
    ]
    errors = runs[True][-1]["errors"]
    rtol = verify_rtol(torch.bfloat16)
    per_run = (
        "decode_real_s",
        "forwards_per_step",
        "rows_per_forward",
        "runtime_cpu_s",
        "loop_cpu_s",
        "device_s",
        "return_ms",
        "forward_ms",
        "gather_skipped",
        "held_launches",
    )
    return {
        "rows": rows, "shadows": shadows, "fraction": args.fraction, "steps": steps, "prompt": args.prompt,
        "graphs": args.graphs, "repeats": args.repeats,
        "off": {k: round(v, 4) for k, v in off.items()}, "on": {k: round(v, 4) for k, v in on.items()},
        "runs": {("on" if v else "off"): {k: [None if r[k] is None else round(r[k], 4) for r in runs[v]]
                                          for k in per_run} for v in runs},
        "off_decode_ms_per_step": round(1e3 * off["decode_real_s"] / steps, 3),
        "cost_decode_real": cost("decode_real_s"), "cost_decode_real_pairs": _spread(pairs),
        "cost_prompts_real": cost("prefill_real_s"), "cost_busy": cost("busy_s"), "cost_device": cost("device_s"),
        "cost_host_cpu": cost("host_cpu_s"), "cost_loop_cpu": cost("loop_cpu_s"),
        "cost_runtime_cpu": cost("runtime_cpu_s"),
        # the host's CPU per shadow row (positions x batch) and per shadow request, on and off apart
        "runtime_cpu_us_per_shadow_row": round(1e6 * (on["runtime_cpu_s"] - off["runtime_cpu_s"]) / (shadows * steps), 2),
        "loop_cpu_us_per_shadow_request": round(
            1e6 * (on["loop_cpu_s"] - off["loop_cpu_s"]) / (shadows * steps / SHADOW_BATCH_ROWS), 2),
        "runtime_cpu_us_per_forward": {v: round(1e6 * r["runtime_cpu_s"] / r["batches"], 1)
                                       for v, r in (("off", off), ("on", on))},
        "positions_compared": int(errors.numel()), "max_error": float(errors.max()), "tolerance": rtol,
        "honest_server_banned": bool((errors > rtol).any()),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (dry run)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--cases", default="64:160,16:160,1:160", help="rows:steps, comma-separated")
    p.add_argument("--fraction", type=float, default=DEFAULT_SHADOW_FRACTION, help="sessions shadowed")
    p.add_argument("--graphs", action="store_true", help="decode steps replay CUDA graphs")
    p.add_argument("--simulated_forward_ms", type=float, default=None,
                   help="on the CPU, the replica's host work alone: one Llama-3-8B-wide layer whose decode forwards "
                        "take the CUDA-graph path with the graph a timed no-op of this many ms on a simulated device "
                        "(benchmarks.users.device_cpu); the GIL switch interval a GPU server's")  # fmt: skip
    p.add_argument("--repeats", type=int, default=7, help="timed runs with and without shadows (median; pairs' spread)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    simulated = args.simulated_forward_ms is not None
    device = torch.device("cpu" if args.tiny or simulated else "cuda")
    if device.type == "cuda" or simulated:
        shorten_gil_switch_interval()  # as a server serving a GPU span does (`build_engine_executor`)
    if simulated:
        torch.set_num_threads(1)  # (only the prefills compute, on one layer)
        args.layers = 1
    spec = SIMULATED_SPEC if simulated else TINY if args.tiny else LLAMA3_8B
    gen = torch.Generator(device=device).manual_seed(0)
    layers = [random_layer(spec, device, gen) for _ in range(args.layers)]
    name = platform.processor() or "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)
    if simulated:
        name += f" (simulated device, {args.simulated_forward_ms} ms a forward)"
    print(f"{args.layers} bf16 layers of {'tiny' if args.tiny else 'Llama-3-8B'} shape on {name}", flush=True)
    results = []
    for case in args.cases.split(","):
        rows, steps = (int(x) for x in case.split(":"))
        started = time.perf_counter()
        result = {"device": name, "layers": args.layers, **measure(spec, layers, rows, steps, args)}
        result["seconds"] = round(time.perf_counter() - started, 1)
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"verify_cost{'_graphs' if args.graphs else ''}.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
