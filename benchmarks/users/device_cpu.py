"""The device process's host CPU per merged forward and per step, without a GPU (issues 31 and 37: one front at 64
sessions is bound by that Python, docs/decisions/0049 and 0071): `python -m benchmarks.users.device_cpu`.

The server's own device path runs as on a GPU server: its `Runtime` (the device thread, `TaskQueue.pop_batch`, the
gather rule, launch-ahead and held launches) and `EngineExecutor` (`prepare_step`, `step_task`, `launch_steps`,
`launch_graph_decode`'s staging into host buffers, `PendingDecode.wait`, the replies handed back to the loop) over a
`SpanEngine` of one Llama-3-8B-wide layer on the CPU, with one thing replaced: the CUDA-graph forward
(`NoopGraphs.run`) is a timed no-op on a simulated device (`SimulatedStream`: forwards queue one after another, each
`--forward_ms` long; an event's `synchronize` sleeps until the device would pass it). The graphs' static device
buffers are meta tensors (a host-to-device copy is a dispatch, no memcpy), the staging sets plain host memory; the
output's device-to-host copy is a host memcpy here (a DMA on a GPU): a fixed cost per forward, alike in every run.

`--sessions` clients live in this process's event loop, as one front's sessions do (no transport: what each costs
its loop is `EngineExecutor.step` and the await of its result): each sends its `--prompt`-token prefill, then one
decode step (its hidden states' bytes, as a front hands them over: `StepInputs.hidden_bytes`) as soon as the last
came back. Timed over the decode phase, `--repeats` runs after one untimed warm-up: each thread's own CPU clock
(the runtime thread's, the loop's), per merged forward and per step (medians over runs), forwards per step and rows
per forward. `--sections`: one more run, the runtime thread's CPU inside each function of its decode path per forward
(`thread_sections`: no per-row profiler cost, as cProfile's was, decision 0124)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from benchmarks.common.measure import thread_cpu_s
from benchmarks.engine.quant import LLAMA3_8B, random_layer
from benchmarks.field.verify_tolerance import engine_over, standin_backend
from benchmarks.users.thread_sections import Sections, watched
from corolla.engine.graph_decode import HostStaging, host_bytes
from corolla.engine.graphs.cuda_graphs import GraphInputs, InputLayout
from corolla.engine.span_engine import SpanEngine
from corolla.server.core.engine_executor import EngineExecutor
from corolla.server.core.executor import SessionSpec, StepInputs
from corolla.server.core.runtime import Runtime

RUNTIME_THREAD = "corolla-runtime"  # `Runtime`'s thread name (its default)

# one layer of Llama-3-8B's width (the wire's 8 KiB per bf16 row; its MLP narrow: only the prefill computes)
SPEC = dataclasses.replace(LLAMA3_8B, intermediate_size=256)


class SimulatedStream:
    """A device that runs what is queued on it one after another: `tail_s` (perf_counter) is when it is done."""

    def __init__(self) -> None:
        self.tail_s = 0.0

    def reach(self) -> float:
        """When the device reaches what is queued now (now, or once the work before it is done)."""
        self.tail_s = max(self.tail_s, time.perf_counter())
        return self.tail_s


class SimulatedEvent:
    """`torch.cuda.Event` on a `SimulatedStream`: recorded at the time the device reaches it; `synchronize` sleeps
    until then (a blocking-sync event's waiter: no CPU)."""

    def __init__(self, stream: SimulatedStream) -> None:
        self._stream = stream
        self.at_s = 0.0

    def record(self, stream: object = None) -> None:
        self.at_s = self._stream.reach()

    def synchronize(self) -> None:
        wait_s = self.at_s - time.perf_counter()
        if wait_s > 0:
            time.sleep(wait_s)

    def elapsed_time(self, end: SimulatedEvent) -> float:
        return 1e3 * (end.at_s - self.at_s)


class NoopGraphs:
    """`DecodeGraphs`' surface for `launch_graph_decode`: static inputs (meta tensors), buckets, and a `run` that
    queues `forward_s` of device time (plus `row_s` a row) and returns the static output's first rows (its values are
    not read)."""

    def __init__(
        self,
        engine: SpanEngine,
        buckets: tuple[int, ...],
        stream: SimulatedStream,
        forward_s: float,
        row_s: float = 0.0,
    ):
        rows, h, meta = max(buckets), engine.hidden_size, torch.device("meta")
        self.buckets, self.max_rows = buckets, rows
        pages = engine.pool.max_pages_per_seq
        self.inputs = {b: GraphInputs.allocate(InputLayout.of(b, h, pages, engine.dtype), meta) for b in buckets}
        self._out = torch.zeros((rows, h), dtype=engine.dtype)  # [rows, H]
        self.stream, self._forward_s, self._row_s = stream, forward_s, row_s  # (`torch.cuda.current_stream` ...)

    def bucket_for(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def inputs_for(self, rows: int) -> GraphInputs:
        return self.inputs[self.bucket_for(rows)]

    def run(self, rows: int, layers: object = None, *, adapters: bool = False, reset: bool = True) -> torch.Tensor:
        self.stream.tail_s = self.stream.reach() + self._forward_s + self._row_s * rows
        return self._out[:rows]


def simulated_engine(rows: int, tokens: int, forward_s: float, row_s: float = 0.0) -> SpanEngine:
    """An engine over one random layer on the CPU whose decode forwards take the CUDA-graph path on a simulated
    device (the module docstring), each `forward_s` plus `row_s` a row long."""
    gen = torch.Generator().manual_seed(0)
    engine = engine_over(
        SPEC, [random_layer(SPEC, torch.device("cpu"), gen)], triton=False, rows=rows, tokens=tokens, buckets=(rows,)
    )
    stream = SimulatedStream()
    buckets = tuple(b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128) if b < rows) + (rows,)
    engine.graphs = NoopGraphs(engine, buckets, stream, forward_s, row_s)  # type: ignore[assignment]
    engine.max_batch_rows = rows
    staging = [HostStaging.allocate(rows, SPEC.hidden_size, engine.pool.max_pages_per_seq, engine.dtype,
                                    pin_memory=False) for _ in range(2)]  # fmt: skip
    for s in staging:
        s.start, s.event, s.sleeping_event = (SimulatedEvent(stream) for _ in range(3))  # type: ignore[assignment]
    engine._staging, engine._next_staging = staging, 0
    return engine


async def _client(executor: EngineExecutor, cache, raw: memoryview, prompt: int, steps: int, done: list) -> None:
    row = SPEC.hidden_size * 2  # bf16

    def inputs(start: int, end: int) -> StepInputs:
        meta = (torch.bfloat16, (1, end - start, SPEC.hidden_size))
        return StepInputs(None, start, None, None, "", False, raw[start * row : end * row], meta)

    await executor.step(cache, inputs(0, prompt))
    done.append(time.perf_counter())
    await asyncio.sleep(0)
    for t in range(prompt, prompt + steps):
        await executor.step(cache, inputs(t, t + 1))


def run_once(engine: SpanEngine, args: argparse.Namespace, sections: Sections | None) -> dict:
    gc.collect()
    total = args.prompt + args.steps
    backend = standin_backend(SPEC, 1, torch.device("cpu"))
    stream = engine.graphs.stream  # type: ignore[union-attr]
    with (
        mock.patch.object(torch.cuda, "current_stream", lambda device=None: stream),
        Runtime(max_batch_size_tokens=4096, device="cpu") as runtime,
    ):
        executor = EngineExecutor(backend, engine, runtime)  # type: ignore[arg-type]

        async def main() -> dict:
            contexts = [executor.open_session(SessionSpec((0,), 1, total), None) for _ in range(args.sessions)]
            caches = [await c.__aenter__() for c in contexts]
            gen = torch.Generator().manual_seed(1)
            raws = [host_bytes(torch.randn(total, SPEC.hidden_size, generator=gen).to(torch.bfloat16))
                    for _ in caches]  # fmt: skip
            prefilled: list[float] = []
            clients = [asyncio.create_task(_client(executor, c, r, args.prompt, args.steps, prefilled))
                       for c, r in zip(caches, raws, strict=True)]  # fmt: skip
            while len(prefilled) < len(clients):  # the decode phase is timed: from the last prefill on
                await asyncio.sleep(0.001)
            if sections is not None:  # (in the runtime thread: nothing of the prefills counted)
                await runtime.submit(sections.clear, priority=0, size_tokens=0)
            tokens, batches = executor.inference_tokens, sum(s.batches for s in runtime.stats().values())
            loop0, rt0, wall0 = time.thread_time(), thread_cpu_s(runtime.thread), time.perf_counter()
            await asyncio.gather(*clients)
            loop_s, rt_s = time.thread_time() - loop0, thread_cpu_s(runtime.thread) - rt0
            wall_s = time.perf_counter() - wall0
            forwards = sum(s.batches for s in runtime.stats().values()) - batches
            rows = executor.inference_tokens - tokens
            for c in contexts:
                await c.__aexit__(None, None, None)
            steps = args.sessions * args.steps
            result = {
                "wall_ms_per_step": 1e3 * wall_s / args.steps,
                "forwards_per_step": forwards / args.steps, "rows_per_forward": rows / max(1, forwards),
                "runtime_us_per_forward": 1e6 * rt_s / max(1, forwards), "runtime_us_per_step": 1e6 * rt_s / steps,
                "loop_us_per_step": 1e6 * loop_s / steps, "held_launches": runtime.num_held_launches,
            }  # fmt: skip
            if sections is not None:  # (read once the clients are done: the thread's last accounting may be running)
                result["sections_per_forward"] = sections.per(forwards)
            return result

        return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", default="64,16", help="comma-separated session counts")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--forward_ms", type=float, default=6.0, help="the simulated device's time per forward")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sections", action="store_true", help="one more run: the runtime thread's CPU per function")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for sessions in (int(s) for s in args.sessions.split(",")):
        args.sessions = sessions
        engine = simulated_engine(sessions, args.prompt + args.steps, args.forward_ms / 1e3)
        run_once(engine, args, None)  # warm-up
        runs = [run_once(engine, args, None) for _ in range(args.repeats)]
        result = {"sessions": sessions, "forward_ms": args.forward_ms, "steps": args.steps,
                  **{k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]},
                  "runs": {k: [round(r[k], 1) for r in runs] for k in ("runtime_us_per_forward", "loop_us_per_step")}}  # fmt: skip
        if args.sections:  # one more run, watched (its wrappers' cost kept out of the figures above)
            with watched(Sections(RUNTIME_THREAD)) as sections:
                result["sections_per_forward"] = run_once(engine, args, sections)["sections_per_forward"]
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "device_cpu.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
