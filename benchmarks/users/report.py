"""The report and command line of the many-users bench (`benchmarks.users`): `python -m benchmarks.users --cpu`
(the CPU shape, float32) or `--gpu_layers N` (N Llama-3-8B-shaped layers, bfloat16, one CUDA device), each serving
path built once and served by one server per `--num_handlers` value, every transport x session count through it,
the in-process engine's rows and a lone session's server-side step beside them. `--clients corolla,petals` drives
the sessions with corolla's own client streams and/or stock-Petals-style ones (a "client" column);
`--client_cpus 10-15` runs the client processes on those CPUs and the server side on the others."""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.common import engine_steps
from benchmarks.common.measure import median
from benchmarks.common.model import ModelShape
from benchmarks.users.clients import CLIENT_DESCRIPTIONS, CpuSplit, format_cpus
from benchmarks.users.config import CLIENT_KINDS, UsersConfig
from benchmarks.users.server import BenchServer, UsersResult, build_executor, run_users
from corolla.server.core.engine_executor import EngineExecutor
from corolla.server.core.gather import GatherRule, GatherSettings
from corolla.server.front import step_timeline
from corolla.server.front.step_timeline import TIMELINE_ENV


def markdown(rows: list[UsersResult], *, title: str, notes: list[str]) -> str:
    from benchmarks.users.cpu_share import CHANNEL_THREADS, CLIENTS, HANDLERS, LOOP_THREAD, RUNTIME_THREAD

    lines = [
        f"### {title}",
        "",
        "| serving path | handler processes | gather | transport | client | sessions (client processes) | aggregate tok/s"
        " | x 1 session | client step median / p90 / worst ms | worst session median ms | steps per merged forward"
        " (merged forward ms) | runtime busy | CPU us per step: runtime thread / device loop / channel threads /"
        " handler processes / client processes | errors / unfinished |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lone = {
        (r.serving_path, r.num_handlers, r.transport, r.client, r.repeat): r.aggregate_tokens_per_s
        for r in rows
        if r.sessions == 1
    }
    for r in rows:
        base = lone.get((r.serving_path, r.num_handlers, r.transport, r.client, r.repeat))
        ratio = f"{r.aggregate_tokens_per_s / base:.1f}x" if base else "-"
        cpu = " / ".join(f"{r.cpu_us_per_step.get(k, float('nan')):.0f}"
                         for k in (RUNTIME_THREAD, LOOP_THREAD, CHANNEL_THREADS, HANDLERS, CLIENTS))  # fmt: skip
        lines.append(
            f"| {r.serving_path} | {r.num_handlers}{_handler_options(r)} | {r.gather_fraction:g} | {r.transport} | "
            f"{r.client} | {r.sessions} "
            f"({r.client_processes}) | {r.aggregate_tokens_per_s:.1f} | {ratio} | {r.step_median_ms:.1f} / "
            f"{r.step_p90_ms:.1f} / {r.step_worst_ms:.1f} | {r.worst_session_median_ms:.1f} | "
            f"{r.steps_per_merged_forward:.1f} ({r.merged_forward_ms:.2f}) | {r.device_busy_share:.0%} | {cpu} | "
            f"{len(r.errors)} / {r.sessions - r.sessions_finished} |"
        )
    lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines)


def _engine_row(executor: EngineExecutor, sessions: int, prefix_tokens: int, steps: int) -> dict | None:
    """The fast path's engine driven in this process by its `ContinuousBatcher` (no RPC): its own, labelled row."""
    from corolla.server.core.engine_executor import EngineExecutor

    if not isinstance(executor, EngineExecutor):
        return None
    engine = executor.engine
    return engine_steps.concurrent_sessions(engine, sessions=sessions, prefix_tokens=prefix_tokens, steps=steps)


def _engine_rows(
    executor: EngineExecutor,
    runs: list[ServerRun],
    args: argparse.Namespace,
    engine_rows: list[dict],
    started: float,
    repeat: int,
) -> None:
    """The in-process engine's rows of one repeat, one per session count of the runs."""
    for n in sorted({n for run in runs for n in run.counts}):
        r = _engine_row(executor, n, args.prefix_tokens, args.decode_steps)
        if r is not None:
            engine_rows.append({**r, "repeat": repeat})
            print(f"[{time.perf_counter() - started:6.1f}s] in-process engine: {json.dumps(r)}", flush=True)


def _handler_options(row: UsersResult) -> str:
    """The handler column's note: whether the handler processes polled, whether the runtime held its launches at the
    row's end (`GatherRule.holds_launch`), and whether the run spec forced that."""
    notes = [f"poll {row.handler_poll_ms:g} ms"] if row.handler_poll_ms else []
    if row.launch_rule == "forced":
        notes.append("launch forced: held" if row.held_launches else "launch forced: at once")
    elif row.held_launches:
        notes.append("launch held")
    return f" ({', '.join(notes)})" if notes else ""


_RUN_SPEC = re.compile(r"^(\d+)(?:g([0-9.]+))?(?:p([0-9.]+))?([ha])?$")


class ForcedLaunch(GatherRule):
    """The gather rule with its launch decision forced (run spec letter `h`: always held, `a`: always at once), to
    compare the automatic decision (`GatherRule.holds_launch`, by the learned return time) with both in one call."""

    def __init__(self, settings: GatherSettings, *, hold: bool):
        super().__init__(settings)
        self.hold = hold

    def holds_launch(self) -> bool:
        return self.hold


@dataclass(frozen=True)
class ServerRun:
    """One server of a `--runs` spec: `N[gF][pMS][h|a]:counts`, e.g. `4:1,64,256`, `4g0:64` (gather fraction 0: no
    gather, no launch hold), `4p2:64` (the handler processes poll for 2 ms after each message instead of sleeping;
    `p0`: they sleep at once; default: as a server's `--busy_poll_ms` on a GPU, no polling on a CPU), `4h:64` / `4a:64`
    (the next launch always held / always at once: `ForcedLaunch`; default: the rule decides)."""

    num_handlers: int
    gather_fraction: float | None  # None: the runtime's default
    counts: list[int]
    handler_poll_ms: float | None = None  # None: as a server's default (`--busy_poll_ms` on a GPU)
    forced_hold: bool | None = None  # None: the gather rule decides (`GatherRule.holds_launch`)

    @classmethod
    def parse(cls, spec: str, default_counts: list[int]) -> ServerRun:
        head, _, tail = spec.partition(":")
        match = _RUN_SPEC.match(head)
        if match is None:
            raise ValueError(f"a --runs entry reads N[gF][pMS][h|a][:counts], got {spec!r}")
        handlers, fraction, poll, forced = match.groups()
        counts = [int(c) for c in tail.split(",")] if tail else default_counts
        return cls(int(handlers), float(fraction) if fraction else None, counts,
                   float(poll) if poll else None, None if forced is None else forced == "h")  # fmt: skip


def _measure(
    server: BenchServer, args: argparse.Namespace, counts: list[int], path: str, rows: list, started: float, last: bool
) -> None:
    """Every transport x client kind x session count through one running `server` (its runtime kept for the next
    one unless `last`)."""
    with server.running(keep_runtime=not last):
        for transport, client, n in itertools.product(args.transports.split(","), args.clients.split(","), counts):
            if transport == "direct" and client != "corolla":
                continue  # corolla's own transport: a Petals client has none
            config = UsersConfig(sessions=n, client_processes=args.processes, transport=transport, client=client,
                                 prefix_tokens=args.prefix_tokens, decode_steps=args.decode_steps)  # fmt: skip
            held_before, launched_before = server.runtime.num_held_launches, server.runtime.num_batches_done
            row = run_users(server, config, path)
            row.held_launch_count = server.runtime.num_held_launches - held_before
            row.launch_count = server.runtime.num_batches_done - launched_before
            row.gather_fraction = server.runtime.gather.settings.fraction
            gather = server.runtime.gather
            row.held_launches = gather.holds_launch()
            row.launch_rule = "automatic" if type(gather) is GatherRule else "forced"
            row.rule_return_ms = 1000 * gather.return_s if gather.return_s is not None else math.nan
            row.rule_forward_ms = 1000 * gather.forward_s if gather.forward_s is not None else math.nan
            launch_s = server.runtime.launch_s
            row.held_launch_ms = 1000 * launch_s if launch_s is not None else math.nan
            rows.append(row)
            print(f"[{time.perf_counter() - started:6.1f}s] {json.dumps(asdict(row))}", flush=True)


def _server_step_ms(executor: EngineExecutor, prefix_tokens: int) -> float:
    """A lone session's step on the engine itself (no RPC): the floor a client step is compared with."""
    from corolla.server.core.engine_executor import EngineExecutor

    assert isinstance(executor, EngineExecutor)
    return float(engine_steps.single_session(executor.engine, prefix_tokens=prefix_tokens, steps=64)["median_ms"])


def _cpu_linear_off(executor: EngineExecutor) -> None:
    """Drops the CPU projection choices the fast executor's warm-up made (`--cpu_linear off`)."""
    from corolla.engine.spans.fast_llama import FastLlamaSpan
    from corolla.server.core.engine_executor import EngineExecutor

    assert isinstance(executor, EngineExecutor) and isinstance(executor.engine.model, FastLlamaSpan)
    executor.engine.model.ops.cpu_linear = None
    print("cpu_linear off: F.linear / addmm for every projection", flush=True)


def _gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"


CPU_SHAPE = ModelShape(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=16, intermediate_size=5120)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.users", description=__doc__)
    p.add_argument("--cpu", action="store_true", help="run on the CPU (float32; the default shape is CPU_SHAPE)")
    p.add_argument("--gpu_layers", type=int, default=0, help="instead of --cpu: N Llama-3-8B layers, bf16, on cuda")
    p.add_argument("--num_handlers", default="1", help="comma-separated handler process counts, each a server")
    p.add_argument(
        "--runs", default="", help="instead of --num_handlers x --sessions: servers as 'N[gF][pMS]:counts' separated "
        "by spaces, e.g. '4:1,64,256 1:1,64 4g0:64 4p0:64 4h:64' (F: the runtime's gather fraction, server.gather; MS: "
        "how long the handler processes poll after each message, p0 none; h / a: the next launch always held / at "
        "once instead of as the gather rule decides)",
    )  # fmt: skip
    p.add_argument("--sessions", default="1,16")
    p.add_argument(
        "--repeats", type=int, default=1, help="measure everything this many times, alternating: each repeat the "
        "in-process engine's rows, then every server's; the ratios of each repeat and their median in the notes",
    )  # fmt: skip
    p.add_argument("--processes", type=int, default=4, help="client processes (sessions are spread over them)")
    p.add_argument("--transports", default="p2p,socket")
    p.add_argument(
        "--clients", default="petals", help="comma-separated client kinds, each a row: petals (stock-Petals-style "
        "hivemind stub streams) and/or corolla (corolla's own p2pd / socket streams, as InferenceSession sends)",
    )  # fmt: skip
    p.add_argument(
        "--client_cpus", default="", help="CPUs of the client processes and their p2pd daemons, e.g. 10-15 or "
        "12,13,14,15 (emulates clients on other machines); the server side runs on the other CPUs (default: no pinning)",
    )  # fmt: skip
    p.add_argument(
        "--runtime_cpus", default="", help="with --client_cpus: some of the server's CPUs for the device runtime "
        "thread alone (e.g. 0,16: a core and its SMT sibling); the rest of the server side runs on the others",
    )  # fmt: skip
    p.add_argument("--serving_paths", default="fused,eager")
    p.add_argument("--prefix_tokens", type=int, default=32)
    p.add_argument("--decode_steps", type=int, default=32)
    p.add_argument("--torch_threads", type=int, default=0, help="torch threads of the server (0: torch's default)")
    p.add_argument(
        "--cpu_linear", choices=("tuned", "off"), default="tuned",
        help="CPU fast path: the projections' GEMM chosen per row bucket at warm-up (engine.kernels.cpu_linear), or off "
        "(F.linear / addmm for every input: what the engine ran before)",
    )  # fmt: skip
    p.add_argument(
        "--timeline", action="store_true",
        help="the fronts stamp each step of every transport (server.step_timeline); each row then notes where its "
        "steps' time went: the server's part (request read to response written: the front before and after the core, "
        "the core's part) and the client's turnaround",
    )  # fmt: skip
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="cpu-users")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    if args.cpu == bool(args.gpu_layers):
        raise SystemExit("pass --cpu (the CPU shape, float32) or --gpu_layers N (Llama-3-8B layers, bf16, cuda)")
    unknown = set(args.clients.split(",")) - set(CLIENT_KINDS)
    if unknown:
        raise ValueError(
            f"--clients {args.clients!r}: unknown {sorted(unknown)}; choose from {', '.join(CLIENT_KINDS)}"
        )
    cpus = CpuSplit.parse(args.client_cpus) if args.client_cpus else None  # ValueError before anything is built
    if args.runtime_cpus:
        if cpus is None:
            raise ValueError("--runtime_cpus needs --client_cpus (it takes some of the server side's CPUs)")
        cpus = cpus.with_runtime(args.runtime_cpus)
    if args.timeline:  # before the forkserver starts: the handler processes read it when they import
        os.environ[TIMELINE_ENV] = tempfile.mkdtemp(prefix="corolla-timeline-")
        step_timeline.start(Path(os.environ[TIMELINE_ENV]))  # this process's own front (one-front rows)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    shape, dtype, device = CPU_SHAPE, torch.float32, torch.device("cpu")
    if args.gpu_layers:
        shape, dtype, device = ModelShape(num_layers=args.gpu_layers), torch.bfloat16, torch.device("cuda")
    params = shape.num_layers * (
        2 * shape.hidden_size**2
        + 2 * shape.hidden_size * shape.hidden_size * shape.num_kv_heads // shape.num_heads
        + 3 * shape.hidden_size * shape.intermediate_size
    )
    counts = [int(s) for s in args.sessions.split(",")]
    rows: list[UsersResult] = []
    engine_rows: list[dict] = []
    started = time.perf_counter()
    lone_steps: dict[str, float] = {}  # server-side step of a lone session (the engine, no RPC), per path
    for path in args.serving_paths.split(","):
        cache_bytes = (40 << 30) if args.gpu_layers else (1 << 30)  # 256 sessions of 648 tokens at 32 layers: 21 GiB
        executor = build_executor(
            shape, dtype, device, num_layers=shape.num_layers, serving_path=path, cache_bytes=cache_bytes
        )
        if path == "fused" and args.cpu and args.cpu_linear == "off":
            _cpu_linear_off(executor)
        if path == "fused" and args.gpu_layers:  # on a CPU it costs minutes and the RPC is not what limits
            lone_steps[path] = _server_step_ms(executor, args.prefix_tokens)
        runs = [ServerRun.parse(spec, counts) for spec in args.runs.split()] or [
            ServerRun(int(x), None, counts) for x in args.num_handlers.split(",")
        ]
        default_gather = executor.runtime.gather.settings
        for repeat in range(args.repeats):
            if path == "fused" and args.repeats > 1:  # alternated with the servers' rows (else after them, as before)
                _engine_rows(executor, runs, args, engine_rows, started, repeat)
            for i, run in enumerate(runs):
                fraction = run.gather_fraction
                settings = default_gather if fraction is None else GatherSettings(fraction, default_gather.quantile)
                executor.runtime.gather = (
                    GatherRule(settings) if run.forced_hold is None else ForcedLaunch(settings, hold=run.forced_hold)
                )
                poll_s = None if run.handler_poll_ms is None else run.handler_poll_ms / 1000  # None: the default
                server = BenchServer(executor, hidden_size=shape.hidden_size, num_layers=shape.num_layers,
                                     dtype=dtype, device=device, num_handlers=run.num_handlers,
                                     cpus=cpus, handler_poll_s=poll_s)  # fmt: skip
                measured = len(rows)
                last = repeat == args.repeats - 1 and i == len(runs) - 1  # the runtime does not start twice
                _measure(server, args, run.counts, path, rows, started, last=last)
                for row in rows[measured:]:
                    row.repeat = repeat
        if path == "fused" and args.repeats == 1:
            _engine_rows(executor, runs, args, engine_rows, started, 0)
        del executor
    where = f"{_gpu_name()}, bfloat16"
    if args.cpu:
        wait_policy = os.environ.get("OMP_WAIT_POLICY", "unset: libgomp spins")
        where = (
            f"CPU ({torch.get_num_threads()} torch threads, OMP_WAIT_POLICY {wait_policy}, projections: cpu_linear "
            f"{args.cpu_linear}), float32"
        )
    notes = [
        f"{where}, span of {shape.num_layers} Llama layers, hidden "
        f"{shape.hidden_size}, MLP {shape.intermediate_size}: {params / 1e6:.0f}M parameters; prefix "
        f"{args.prefix_tokens} tokens, {args.decode_steps} decode steps per session (first 3 not timed).",
        "Server: one corolla span server in the bench process (hivemind P2P on loopback + same-host socket, the real "
        "handler and runtime; 'handler processes' N > 1: N processes own the p2p streams and feed this one, "
        "server.handler_pool, each serving its own same-host socket since session 12); clients in "
        f"{args.processes} forked processes, each row's 'client' column says how they drive their sessions: "
        + "; ".join(f"'{kind}' = {CLIENT_DESCRIPTIONS[kind]}" for kind in args.clients.split(","))
        + ". 'fused' = SpanEngine on fused kernels; 'eager' = SpanEngine running the blocks eagerly over its pool; "
        "both merge the decode steps of all sessions into one forward.",
        f"CPUs: {cpus.describe()}."
        if cpus is not None
        else f"CPUs: not pinned (server and clients share CPUs {format_cpus(os.sched_getaffinity(0))}).",
        "steps per merged forward and runtime busy come from the runtime's per-kind counters over the decode window.",
    ]
    for path, step_ms in lone_steps.items():
        for row in rows:
            if row.serving_path == path and row.sessions == 1:
                notes.append(
                    f"lone session, {path}, {row.num_handlers} handler process(es), {row.transport}, {row.client} "
                    f"client: client step median "
                    f"{row.step_median_ms:.2f} ms = server-side step {step_ms:.2f} ms + {row.step_median_ms - step_ms:.2f} ms"
                )
    for r in engine_rows:
        which = f" (repeat {r['repeat'] + 1})" if args.repeats > 1 else ""
        notes.append(
            f"in-process engine (ContinuousBatcher in one process, no RPC; its own row){which}: {r['sessions']} sessions "
            f"{r['aggregate_tokens_per_s']:.1f} tok/s, client step median {r['client_step_median_ms']:.1f} ms (mean "
            f"{r['client_step_mean_ms']:.2f}), "
            f"merged step {r['merged_step_ms']:.1f} ms"
        )
    for row in rows:
        if row.device_forward_ms == row.device_forward_ms:  # measured on the device (not nan)
            notes.append(
                f"device time, {row.sessions} sessions, {row.transport}, {row.client} client (CUDA events around "
                f"each launched forward): {row.device_forward_ms:.2f} ms per merged forward against "
                f"{row.merged_forward_ms:.2f} ms as the runtime thread saw it; the device ran forwards "
                f"{row.device_time_share:.0%} of the window (runtime busy {row.device_busy_share:.0%})"
            )
    for row in rows:
        if row.sessions > 1 and row.rule_forward_ms == row.rule_forward_ms:
            notes.append(
                f"launch rule, {row.sessions} sessions, {row.transport}, {row.client} client ({row.launch_rule}): at "
                f"the row's end the learned return time {row.rule_return_ms:.2f} ms against a merged forward of "
                f"{row.rule_forward_ms:.2f} ms: {'held' if row.held_launches else 'at once'}; launches held in the "
                f"row (its prefills included): {row.held_launch_count} of {row.launch_count} "
                f"({row.held_launch_count / max(1, row.launch_count):.0%}: the rule's state over the row, decision "
                f"0125), a held launch's learned seconds {row.held_launch_ms:.2f} ms"
            )
    for row in rows:
        if row.sessions > 1 and len(row.sessions_per_handler) > 1:
            notes.append(
                f"sessions per handler process, {row.sessions} sessions, {row.transport}, {row.client} client: "
                + " / ".join(str(n) for n in row.sessions_per_handler)
            )
    for row in rows:
        if row.timeline_ms.get("steps"):
            t = row.timeline_ms
            handler = ""
            if not math.isnan(t["device_round_trip_p50_ms"]):  # (a lone session's inline steps have no core part)
                handler = (
                    f" (the front before the core {t['handler_in_p50_ms']:.2f} / {t['handler_in_p90_ms']:.2f}, the "
                    f"core's part: queue, forward, device channel {t['device_round_trip_p50_ms']:.2f} / "
                    f"{t['device_round_trip_p90_ms']:.2f}, the front after {t['handler_out_p50_ms']:.2f} / "
                    f"{t['handler_out_p90_ms']:.2f})"
                )
            notes.append(
                f"timeline, {row.sessions} sessions, {row.num_handlers} handler processes, {row.transport}, "
                f"{row.client} client ({t['steps']:.0f} steps; p50 / p90 ms): server's part (request read to response "
                f"written) {t['server_step_p50_ms']:.2f} / {t['server_step_p90_ms']:.2f}{handler}, client turnaround "
                f"(response written to next request read) {t['client_turn_p50_ms']:.2f} / {t['client_turn_p90_ms']:.2f}"
            )
    for row in rows:
        if row.sessions > 1 and len(row.timeline_by_process) > 1:
            notes.append(
                f"per handler process, {row.sessions} sessions, {row.transport}, {row.client} client (p50 ms): device "
                "round trip "
                + " / ".join(f"{t:.2f}" for t, _ in row.timeline_by_process)
                + "; a session's step as the server sees it "
                + " / ".join(f"{c:.2f}" for _, c in row.timeline_by_process)
            )
    for row in rows:
        if row.sessions > 1 and row.window_ms:
            w = row.window_ms
            notes.append(
                f"window, {row.sessions} sessions, {row.transport}, {row.client} client: {row.wall_s * 1000:.0f} ms; "
                f"sessions start within {w['start_spread_ms']:.1f} ms and end within {w['end_spread_ms']:.1f} ms of "
                f"each other; timed steps' mean {w['step_mean_ms']:.2f} ms (median {row.step_median_ms:.2f}); "
                f"untimed per session (warm-up steps, gaps between steps) {w['untimed_ms_per_session']:.1f} ms"
            )
    for row in rows:
        if row.sessions > 1 and row.start:
            b = row.start
            firsts = ", ".join(
                f"step {k}: {b[f'step{k}_p50_ms']:.1f} / {b[f'step{k}_max_ms']:.1f}"
                for k in range(8) if f"step{k}_p50_ms" in b
            )  # fmt: skip
            notes.append(
                f"start, {row.sessions} sessions, {row.transport}, {row.client} client: untimed first steps (p50 / "
                f"worst ms) {firsts}; at the start signal the rule's return {b['rule_return_ms_at_go']:.2f} ms, "
                f"forward {b['rule_forward_ms_at_go']:.2f} ms; first 100 ms: {b.get('forwards_first_100ms', 0):.0f} "
                f"merged forwards of {b.get('rows_first_100ms', 0):.0f} rows; inline steps in the row "
                f"{b.get('inline_steps', 0):.0f}"
            )
    notes += ratio_notes(rows, engine_rows)
    title = "Many users at once through one server (" + ("CPU" if args.cpu else _gpu_name()) + ")"
    text = markdown(rows, title=title, notes=notes)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"users-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M}-{args.tag}"
    (out / f"{stem}.md").write_text(text + "\n")
    (out / f"{stem}.json").write_text(
        json.dumps({"rows": [asdict(r) for r in rows], "engine": engine_rows, "notes": notes}, indent=1)
    )
    print(f"wrote {out / stem}.md/.json")
    return 0


def ratio_notes(rows: list[UsersResult], engine_rows: list[dict]) -> list[str]:
    """Each many-session row's aggregate over the in-process engine's of the same session count and repeat, and the
    same for the sessions' own rates summed (each session's steps over its own window: the rate while all of them
    run, without the start-up and the drain at the end, which the aggregate's window includes); with several repeats,
    one line per configuration: every repeat's ratios and their medians."""
    engine = {(r["sessions"], r.get("repeat", 0)): r for r in engine_rows}
    several = any(r.get("repeat", 0) for r in engine_rows)
    notes: list[str] = []
    ratios: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        base = engine.get((row.sessions, row.repeat))
        if row.sessions < 2 or not base or not base["aggregate_tokens_per_s"]:
            continue
        what = (
            f"{row.sessions} sessions, {row.num_handlers} handler process(es){_handler_options(row)}, gather "
            f"{row.gather_fraction:g}, {row.transport}, {row.client} client"
        )
        ratio = row.aggregate_tokens_per_s / base["aggregate_tokens_per_s"]
        base_rates = base.get("session_rates_tok_s", float("nan"))
        rates = row.session_rates_tok_s / base_rates if base_rates else float("nan")
        ratios.setdefault(what, []).append((ratio, rates))
        repeat = f" (repeat {row.repeat + 1})" if several else ""
        own = (
            f"; sessions' own rates summed {row.session_rates_tok_s:.0f} against {base_rates:.0f} tok/s, {rates:.2f}x"
            if math.isfinite(rates) else ""
        )  # fmt: skip
        notes.append(f"{what}{repeat}: {ratio:.2f}x the in-process engine's aggregate{own}")
    for what, values in ratios.items():
        if len(values) > 1:
            notes.append(
                f"{what}, {len(values)} repeats: "
                + " / ".join(f"{v:.2f}x" for v, _ in values)
                + f" the in-process engine (median {median([v for v, _ in values]):.2f}x)"
                + (
                    "; sessions' own rates "
                    + " / ".join(f"{r:.2f}x" for _, r in values)
                    + f" (median {median([r for _, r in values]):.2f}x)"
                    if all(math.isfinite(r) for _, r in values)
                    else ""
                )
            )
    return notes
