"""`python -m benchmarks.training`: training through one server, as clients meet it.

One corolla server (this process: the users bench's `BenchServer`, hivemind P2P on loopback, a random-weight
Llama-shaped span) serves training clients in other processes (`clients.training_client`: forward+backward steps of
`rows` x `seq_len` tokens through corolla's client calls, each client its own peer) and one inference session
(`clients.inference_client`) that decodes throughout. Phases: the session alone, then 1, then N concurrent training
clients (`--clients 1,8`). Reported per phase: forward+backward tokens/s (every step's tokens over the window from
the first start to the last end), the median training step, the session's median decode step, and the training works
merged per block call on the server (runtime counters); next to `transformers` running the same span locally in the
same process (frozen weights, gradients to the inputs) at 1 and N x `rows` rows.

A/B phases: `--phase N:key=value,...` (repeatable) runs N clients with the server changed for that phase only:
`merge=F/B` (merge limits in tokens; `1/1`: every work alone), `reuse=off` (no forward activations kept for
backwards), `poll=off` (the server's loop never polls after a lone session's inline decode step),
`hold_ms=X` (how long training waits for the session's next step after each decode batch, `Runtime.pace_hold_s`;
0: training launched whenever the runtime is free, also while the session is on its way back), `graphs=off` (every
training block call eager, no CUDA graphs: `TrainingBatcher.graphs`),
`trace=on` (a CUDA trace of the phase, summarized by `timeline`; `--trace_out` writes it), `steps=N` (steps per client
in this phase), `transport=p2p|local` (the clients' calls through both p2pd daemons, or over the same-host unix socket,
instead of the server's direct port: `clients.TRANSPORTS`). Each phase is printed as it ends, with the session's decode step
meanwhile; its ratio is to the 1-client phase with the same options.

CPU dry run: `python -m benchmarks.training --tiny`; the GPU figure: `python -m benchmarks.training` (32 Llama-3-8B
layers, bf16, sequence 512)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import queue
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from benchmarks.common.model import ModelShape, build_hf_model
from benchmarks.training.clients import TRANSPORTS, WINDOWS_DONE, ServerAddress, inference_client, training_client
from benchmarks.training.local import local_tokens_per_s
from benchmarks.training.timeline import Timeline, traced
from benchmarks.users.server import DHT_PREFIX, BenchServer, build_executor
from corolla.server.core.engine_executor import KIND_ENGINE_INFERENCE, EngineExecutor
from corolla.server.core.runtime import PACE_HOLD_S, KindStats
from corolla.server.core.training_activations import KeptActivations
from corolla.server.core.training_batch import (
    BACKWARD_MERGE_TOKENS,
    FORWARD_MERGE_TOKENS,
    training_stats,
)

TINY = ModelShape(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=688)
READY_TIMEOUT_S = 300.0
TEARDOWN_S = 10.0
# untimed steps of every phase's client count before the first phase (after each client's own warm-up step): the
# training block calls' CUDA graphs (captured at a shape's first call) of each count's merged shapes
WARMUP_STEPS = 2


@dataclass(frozen=True)
class PhaseSpec:
    """One phase to run: `clients` concurrent training clients with the server as served, or changed for the phase
    (`--phase`)."""

    clients: int
    forward_tokens: int = FORWARD_MERGE_TOKENS
    backward_tokens: int = BACKWARD_MERGE_TOKENS
    reuse: bool = True
    poll: bool = True  # False: the handler's loop polling off for the phase (as on CPU)
    pace_hold_ms: float = PACE_HOLD_S * 1e3  # `Runtime.pace_hold_s` (0: training not paced around the session)
    graphs: bool = True  # False: training block calls eager (`TrainingBatcher.graphs` None)
    trace: bool = False  # a CUDA trace of the phase (`timeline`)
    steps: int | None = None  # steps per client (None: `--steps`)
    transport: str = "direct"  # the clients' way to the server (`clients.TRANSPORTS`)

    @property
    def served(self) -> bool:
        """The server as served (the ratio's phases), not an A/B phase."""
        return self == PhaseSpec(self.clients, trace=self.trace, steps=self.steps)

    @classmethod
    def parse(cls, text: str) -> PhaseSpec:
        """`N[:key=value,...]` (see the module docstring)."""
        count, _, options = text.partition(":")
        fields: dict = {}
        for option in filter(None, options.split(",")):
            key, _, value = option.partition("=")
            if key == "merge":
                forward, backward = value.split("/")
                fields.update(forward_tokens=int(forward), backward_tokens=int(backward))
            elif key in ("reuse", "poll", "trace", "graphs"):
                fields[key] = _on(value)
            elif key == "hold_ms":
                fields["pace_hold_ms"] = float(value)
            elif key == "steps":
                fields["steps"] = int(value)
            elif key == "transport" and value in TRANSPORTS:
                fields["transport"] = value
            else:
                raise ValueError(f"unknown phase option {key!r} in {text!r}")
        return cls(int(count), **fields)

    @property
    def label(self) -> str:
        """Its options other than the served server's (not `trace`, `steps`): phases of equal labels compare."""
        served = PhaseSpec(self.clients)
        changed = [f"{key}={value}" for key, value in asdict(self).items()
                   if key not in ("clients", "trace", "steps") and value != getattr(served, key)]  # fmt: skip
        return ",".join(changed)


def _on(value: str) -> bool:
    return {"on": True, "off": False}[value]


@dataclass
class Phase:
    clients: int
    merged: bool  # False: the A/B phase with every work run alone (`TrainingBatcher.set_merge_tokens(1, 1)`)
    tokens_per_s: float  # forward+backward tokens of all steps over the phase's window
    step_median_ms: float  # one client's forward+backward
    inference_step_median_ms: float  # the concurrent session's decode step meanwhile
    inference_steps: int
    works_per_block_call: float  # training works merged per block call on the server
    forward_median_ms: float  # the rpc_forward part of one client's step
    training_busy_share: float  # of the phase's window, the share the server's runtime spent on training block calls
    kept_hits: int = 0  # backwards that found their forward's block inputs kept (`training_activations`)
    kept_misses: int = 0  # backwards that recomputed them
    retried_calls: int = 0  # calls run again after their stream closed without a reply (`ConnectionError`)
    forward_merge_tokens: int = FORWARD_MERGE_TOKENS  # the merge limits of the phase
    backward_merge_tokens: int = BACKWARD_MERGE_TOKENS
    reuse: bool = True  # False: the A/B phase with no forward activations kept (every backward recomputes)
    poll: bool = True  # False: the A/B phase with the server loop's polling after inline decode steps off
    inline_steps: int = 0  # decode steps the runtime ran inline (in the loop's thread, each followed by polling)
    block_calls: int = 0  # training block calls on the server
    call_ms: float = float("nan")  # per block call: the device thread running it (on a GPU: launching it)
    call_wait_ms: float = float("nan")  # per block call: then waiting for the call before it (on a GPU)
    decode_device_ms: float = float("nan")  # per decode batch: the device's own time (where the runtime measured it)
    pace_hold_ms: float = PACE_HOLD_S * 1e3  # the runtime's hold of training for the session's return (0: none)
    paced: int = 0  # holds the runtime waited (`Runtime.num_paced`)
    paced_out: int = 0  # of them, holds that ran out with training queued and no session step
    paced_share: float = 0.0  # of the window, the share the runtime held training back
    label: str = ""  # the phase's options (`PhaseSpec.label`): its ratio is to the 1-client phase of the same
    served: bool = True  # the server as served (False: an A/B phase)
    request_ms: float = float("nan")  # per training request on the server: from its first work queued to its answer
    timeline: Timeline | None = None  # the phase's CUDA trace, summarized (trace=on)
    graphs: bool = True  # False: the A/B phase with every training block call eager
    fitted: int = 0  # training calls launched while the session was on its way back (`Runtime.num_fitted`)
    graph_replays: int = 0  # training block calls replayed as CUDA graphs (`TrainingGraphs.num_replays`)
    graph_captures: int = 0  # of them, captured in the phase (`TrainingGraphs.num_captured`)
    transport: str = "direct"  # the clients' way to the server (`clients.TRANSPORTS`)


@dataclass
class Report:
    device: str
    shape: dict
    dtype: str
    rows: int
    seq_len: int
    steps: int
    num_handlers: int
    idle_inference_step_median_ms: float = float("nan")
    idle_inference_steps: int = 0
    phases: list[Phase] = field(default_factory=list)
    local_tokens_per_s: dict[str, float] = field(default_factory=dict)  # "rows=N": transformers, same span
    errors: list[str] = field(default_factory=list)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a 4-layer, hidden-256 span (a CPU dry run)")
    parser.add_argument("--num_layers", type=int, default=None, help="layers of the span (default: the shape's)")
    parser.add_argument(
        "--hidden_size", type=int, default=None, help="hidden size (intermediate 3.5x; default: the shape's)"
    )
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--rows", type=int, default=1, help="sequences per training step of one client")
    parser.add_argument("--clients", default="1,8", help="concurrent training clients of each phase")
    parser.add_argument(
        "--phase", action="append", default=[], help="an A/B phase, N:key=value,... (see above); repeatable"
    )
    parser.add_argument("--trace_out", default=None, help="write the traced phase's chrome trace here (gzipped)")
    parser.add_argument("--steps", type=int, default=8, help="timed forward+backward steps per client and phase")
    parser.add_argument("--idle_s", type=float, default=3.0, help="the inference session alone, seconds")
    parser.add_argument(
        "--num_handlers",
        type=int,
        default=1,
        help="the server's handler processes (1: its own loop serves the streams)",
    )
    parser.add_argument("--no_local", action="store_true", help="no `transformers` baseline (a second run's call)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--out", default=None, help="also write the report here (JSON)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shape = TINY if args.tiny else ModelShape()
    if args.num_layers is not None:
        shape = ModelShape(**{**asdict(shape), "num_layers": args.num_layers})
    if args.hidden_size is not None:
        shape = ModelShape(
            **{**asdict(shape), "hidden_size": args.hidden_size, "intermediate_size": args.hidden_size * 7 // 2}
        )
    counts = [int(c) for c in args.clients.split(",")]
    phases = [PhaseSpec(n) for n in counts] + [PhaseSpec.parse(text) for text in args.phase]
    report = run(shape, dtype, device, rows=args.rows, seq_len=args.seq_len, phases=phases, steps=args.steps,
                 idle_s=args.idle_s, trace_out=args.trace_out, out=args.out, num_handlers=args.num_handlers,
                 local=not args.no_local)  # fmt: skip
    print(json.dumps(asdict(report), indent=1))
    print(summary(report))
    _write(report, args.out)
    return 1 if report.errors else 0


def _write(report: Report, out: str | None) -> None:
    if out:
        with open(out, "w") as f:
            json.dump(asdict(report), f, indent=1)


def run(
    shape: ModelShape, dtype: torch.dtype, device: torch.device, *, rows: int, seq_len: int, phases: list[PhaseSpec],
    steps: int, idle_s: float, trace_out: str | None = None, out: str | None = None, num_handlers: int = 1,
    local: bool = True,
) -> Report:  # fmt: skip
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = Report(name, asdict(shape), str(dtype).removeprefix("torch."), rows, seq_len, steps, num_handlers)
    model = build_hf_model(shape, dtype, device)
    executor = build_executor(shape, dtype, device, num_layers=shape.num_layers, serving_path="fused",
                              cache_bytes=256 * 2**20, model=model)  # fmt: skip
    most = max(spec.clients for spec in phases)
    for n in sorted({1, most}) if local else ():
        report.local_tokens_per_s[f"rows={n * rows}"] = local_tokens_per_s(model, n * rows, seq_len, steps)
        print(f"local transformers, {n * rows} rows: {report.local_tokens_per_s[f'rows={n * rows}']:.0f} tok/s")
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    server = BenchServer(executor, hidden_size=shape.hidden_size, num_layers=shape.num_layers, dtype=dtype,
                         device=device, num_handlers=num_handlers)  # fmt: skip
    with server.running():
        address = ServerAddress(server.maddrs, server.peer_id_b58, DHT_PREFIX, shape.num_layers, shape.hidden_size,
                                report.dtype)  # fmt: skip
        _serve(server, address, report, rows=rows, seq_len=seq_len, phases=phases, steps=steps, idle_s=idle_s,
               trace_out=trace_out, out=out)  # fmt: skip
    return report


def _serve(
    server: BenchServer, address: ServerAddress, report: Report, *, rows: int, seq_len: int, phases: list[PhaseSpec],
    steps: int, idle_s: float, trace_out: str | None, out: str | None,
) -> None:  # fmt: skip
    context = multiprocessing.get_context("forkserver")
    stop = context.Event()
    inference_results: multiprocessing.Queue = context.Queue()
    inference = context.Process(target=inference_client, args=(address, stop, inference_results), daemon=True)
    clients = []
    for i in range(max(spec.clients for spec in phases)):
        commands, results = context.Queue(), context.Queue()
        process = context.Process(target=training_client, args=(address, rows, seq_len, 100 + i, commands, results),
                                  daemon=True)  # fmt: skip
        clients.append((commands, results, process))
    inference.start()
    for _, _, process in clients:
        process.start()
    try:
        for answers in [inference_results, *(results for _, results, _ in clients)]:
            _expect(answers.get(timeout=READY_TIMEOUT_S), "ready", report)
        if report.errors:
            return
        for n in sorted({spec.clients for spec in phases}):  # untimed: the server's CUDA graphs of these shapes
            for commands, _, _ in clients[:n]:
                commands.put((WARMUP_STEPS, "direct"))
            for _, results, _ in clients[:n]:
                warmed = results.get(timeout=READY_TIMEOUT_S)
                if not isinstance(warmed, list):
                    _error(report, str(warmed))
        if report.errors:
            return
        steps_seen = _InferenceWindows(inference_results)
        idle_start = time.time()
        time.sleep(idle_s)
        idle_end = time.time()
        idle = steps_seen.within(idle_start, idle_end)
        report.idle_inference_step_median_ms, report.idle_inference_steps = _median_ms(idle), len(idle)
        print(f"inference session alone: {report.idle_inference_step_median_ms:.2f} ms/step ({len(idle)})", flush=True)
        executor = server.executor
        assert isinstance(executor, EngineExecutor), "the users bench builds the engine's executor"
        training = executor.training
        kept = training.kept
        poll = server.runtime.after_inline  # the serving loop's polling after an inline step (None: off)
        graphs = training.graphs
        for spec in phases:
            n, merged_phase = spec.clients, spec.forward_tokens > 1 or spec.backward_tokens > 1
            training.set_merge_tokens(spec.forward_tokens, spec.backward_tokens)
            training.kept = kept if spec.reuse else KeptActivations(0)
            server.runtime.after_inline = poll if spec.poll else None  # called after each inline step
            server.runtime.pace_hold_s = spec.pace_hold_ms / 1e3
            training.graphs = graphs if spec.graphs else None
            fitted_before = server.runtime.num_fitted
            graphs_before = (graphs.num_replays, graphs.num_captured) if graphs is not None else (0, 0)
            paced_before = (server.runtime.num_paced, server.runtime.num_paced_out, server.runtime.paced_s)
            requests_before = (training.num_requests, training.chain_s)
            phase_steps = steps if spec.steps is None else spec.steps
            inline_before = server.runtime.num_inline_batches
            before = training_stats(server.runtime.stats())
            hits_before, misses_before = training.kept.hits, training.kept.misses
            calls_before = (training.num_calls, training.call_s, training.wait_s)
            decode_before = server.runtime.stats().get(KIND_ENGINE_INFERENCE, KindStats())
            timelines: list[Timeline] = []
            with traced(trace_out, timelines) if spec.trace else contextlib.nullcontext():
                for commands, _, _ in clients[:n]:
                    commands.put((phase_steps, spec.transport))
                steps_of = [results.get(timeout=READY_TIMEOUT_S) for _, results, _ in clients[:n]]
            bad = [s for s in steps_of if not isinstance(s, list)]
            if bad:
                for error in bad:
                    _error(report, str(error))
                return
            merged = training_stats(server.runtime.stats()).since(before)
            calls = training.num_calls - calls_before[0]
            requests = max(training.num_requests - requests_before[0], 1)
            decode = server.runtime.stats().get(KIND_ENGINE_INFERENCE, KindStats()).since(decode_before)
            starts = [start for client in steps_of for start, _, _, _ in client]
            ends = [end for client in steps_of for _, _, end, _ in client]
            during = steps_seen.within(min(starts), max(ends))
            step_ms = statistics.median((end - start) * 1e3 for client in steps_of for start, _, end, _ in client)
            forward_ms = statistics.median((mid - start) * 1e3 for client in steps_of for start, mid, _, _ in client)
            retried = sum(count for client in steps_of for _, _, _, count in client)
            tokens, window_s = n * phase_steps * rows * seq_len, max(ends) - min(starts)
            report.phases.append(Phase(n, merged_phase, tokens / window_s, step_ms, _median_ms(during), len(during),
                                       merged.tasks_per_batch, forward_ms, merged.busy_s / window_s,
                                       training.kept.hits - hits_before, training.kept.misses - misses_before,
                                       retried, spec.forward_tokens, spec.backward_tokens, spec.reuse, spec.poll,
                                       server.runtime.num_inline_batches - inline_before, calls,
                                       (training.call_s - calls_before[1]) * 1e3 / max(calls, 1),
                                       (training.wait_s - calls_before[2]) * 1e3 / max(calls, 1),
                                       decode.device_s * 1e3 / decode.device_timed if decode.device_timed
                                       else float("nan"), spec.pace_hold_ms,
                                       server.runtime.num_paced - paced_before[0],
                                       server.runtime.num_paced_out - paced_before[1],
                                       (server.runtime.paced_s - paced_before[2]) / window_s, spec.label,
                                       spec.served,
                                       (training.chain_s - requests_before[1]) * 1e3 / requests,
                                       timelines[0] if timelines else None, spec.graphs,
                                       server.runtime.num_fitted - fitted_before,
                                       graphs.num_replays - graphs_before[0] if graphs is not None else 0,
                                       graphs.num_captured - graphs_before[1] if graphs is not None else 0,
                                       transport=spec.transport))  # fmt: skip
            print(f"phase: {report.phases[-1]}", flush=True)
            _write(report, out)  # a run cut short keeps the phases it finished
        training.set_merge_tokens(FORWARD_MERGE_TOKENS, BACKWARD_MERGE_TOKENS)
        training.kept = kept
        server.runtime.after_inline = poll
        server.runtime.pace_hold_s = PACE_HOLD_S
        training.graphs = graphs
    except (queue.Empty, _SessionFailed) as e:
        _error(report, str(e) or "a client did not answer in time")
    finally:
        stop.set()
        for commands, _, _ in clients:
            commands.put(None)
        deadline = time.monotonic() + TEARDOWN_S
        processes = [(inference, inference_results), *((process, results) for _, results, process in clients)]
        for process, answers in processes:  # a process exits once what it put was read
            while process.is_alive() and time.monotonic() < deadline:
                _drain(answers)
                process.join(0.1)
            if process.is_alive():
                process.kill()


def _drain(answers: multiprocessing.Queue) -> None:
    with contextlib.suppress(queue.Empty):
        while True:
            answers.get_nowait()


def _expect(answer: object, wanted: str, report: Report) -> None:
    if answer != wanted:
        _error(report, str(answer))


def _error(report: Report, error: str) -> None:
    print(f"error: {error}", flush=True)  # at once: the teardown after it may outlast the caller's time limit
    report.errors.append(error)


class _SessionFailed(RuntimeError):
    """The inference client answered an error instead of its steps' windows."""


class _InferenceWindows:
    """The inference client's step windows as they come (`clients.WINDOWS_EVERY_S`)."""

    def __init__(self, answers: multiprocessing.Queue) -> None:
        self._answers = answers
        self._windows: list[tuple[float, float]] = []
        self._done = False

    def within(self, start: float, end: float) -> list[tuple[float, float]]:
        """The windows of the steps inside [start, end], once the client sent every step that ended by `end`."""
        while not self._done and (not self._windows or self._windows[-1][1] < end):
            answer = self._answers.get(timeout=READY_TIMEOUT_S)
            if answer == WINDOWS_DONE:
                self._done = True
            elif isinstance(answer, list):
                self._windows.extend(answer)
            else:
                raise _SessionFailed(str(answer))
        return [(s, e) for s, e in self._windows if s >= start and e <= end]


def _median_ms(windows: list[tuple[float, float]]) -> float:
    return statistics.median((e - s) * 1e3 for s, e in windows) if windows else float("nan")


def summary(report: Report) -> str:
    lines = [
        f"{report.device}, {report.shape['num_layers']} layers of hidden {report.shape['hidden_size']}, "
        f"{report.dtype}, {report.rows} x {report.seq_len} tokens per step, {report.num_handlers} handler process(es)",
        f"inference session alone: {report.idle_inference_step_median_ms:.2f} ms/step "
        f"({report.idle_inference_steps} steps)",
    ]
    for p in report.phases:
        one = next((o.tokens_per_s for o in report.phases if o.label == p.label and o.clients == 1), None)
        ratio = f" = {p.tokens_per_s / one:.2f}x one client" if one else ""
        slower = p.inference_step_median_ms / report.idle_inference_step_median_ms
        ab = [] if p.merged else ["unmerged A/B"]
        if p.merged and (p.forward_merge_tokens, p.backward_merge_tokens) != (
            FORWARD_MERGE_TOKENS,
            BACKWARD_MERGE_TOKENS,
        ):
            ab.append(f"merge limits {p.forward_merge_tokens}/{p.backward_merge_tokens} A/B")
        if not p.reuse:
            ab.append("no activations kept A/B")
        if not p.poll:
            ab.append("loop polling off A/B")
        if p.pace_hold_ms != PACE_HOLD_S * 1e3:
            ab.append(f"training paced for {p.pace_hold_ms:g} ms A/B" if p.pace_hold_ms else "unpaced A/B")
        if not p.graphs:
            ab.append("eager block calls A/B")
        if p.transport != "direct":
            ab.append(f"calls over {p.transport} A/B")
        if p.timeline is not None:
            t = p.timeline
            gaps = ", ".join(f"{label}: {int(c)} ({ms:.0f} ms)" for label, (c, ms) in t.idle_gaps.items())
            ab.append(
                f"traced: device busy {t.device_busy_share:.0%} of {t.window_ms:.0f} ms, graph (decode) kernels "
                f"{t.graph_device_ms:.0f} ms, other kernels and copies {t.other_device_ms:.0f} ms, idle gaps {gaps}"
            )
        lines.append(
            f"{p.clients} training clients{''.join(f' ({a})' for a in ab)}: {p.tokens_per_s:.0f} tok/s{ratio}, "
            f"step {p.step_median_ms:.1f} ms (forward {p.forward_median_ms:.1f} ms), "
            f"{p.works_per_block_call:.2f} works per block call, server busy with training "
            f"{p.training_busy_share:.0%} of the window, backwards reusing their forward's activations "
            f"{p.kept_hits}/{p.kept_hits + p.kept_misses}, calls retried after a stream closed without a reply "
            f"{p.retried_calls}, inline decode steps {p.inline_steps}; {p.block_calls} block calls of {p.call_ms:.2f} ms "
            f"+ {p.call_wait_ms:.2f} ms waiting for the one before; a request {p.request_ms:.1f} ms on the server; "
            f"decode device time {p.decode_device_ms:.2f} ms; training held for the session {p.paced} times "
            f"({p.paced_out} ran out), {p.paced_share:.0%} of the window, launched in its way back {p.fitted} times; "
            f"block calls replayed as CUDA graphs {p.graph_replays} ({p.graph_captures} captured); "
            f"inference step {p.inference_step_median_ms:.2f} ms ({slower:.2f}x alone, {p.inference_steps} steps)"
        )
    for rows, rate in report.local_tokens_per_s.items():
        lines.append(f"transformers locally, {rows}: {rate:.0f} tok/s")
    lines.extend(f"error: {e}" for e in report.errors)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
