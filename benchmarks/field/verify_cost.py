"""What stretch verification costs a GPU swarm's throughput (issue 37's target: <= 5%): `python -m
benchmarks.field.verify_cost --out DIR` on a GPU (`--tiny` dry-runs the code on the CPU in seconds).

A span of random Llama-3-8B-shaped bf16 layers serves `rows` sessions: one prefill of `--prompt` tokens each, then
`steps` merged single-token decode steps through the engine's serving path (Triton kernels on CUDA, paged pool; no
kernel tuning; `--graphs`: decode steps replay CUDA graphs, as a server's do). That decode time is the work served (the baseline,
verification off). Verification as `client.verification.stretches` samples it: at the end of each stretch of `--stretch_steps`
steps of a session (and at its close) a replica, a server of the same kind, recomputes positions [0, b) of that
session in ONE forward (b = prompt + 64, prompt + 128, ..., prompt + steps), each stretch with probability
`--fraction`. Every such forward is timed here, per session, unmerged (an upper bound: a replica may merge concurrent
forwards), on the same engine. Cost = fraction x recompute time / decode time: the share of the swarm's GPU time
that verification adds (the replicas are servers of the same swarm). Each case runs twice; the second is reported
(the first compiles the kernels).

`--mode shadow` measures verification on a replica's spare rows instead (decision 0028): the replica keeps a shadow
session of each session it verifies and replays that session's steps as extra single-token rows merged into the
batched decode forwards it runs for its own `rows` sessions (a decode forward reads every weight once whatever its
rows, so below the compute knee extra rows cost little), each position recomputed once (no stretch from position 0).
Sessions are sampled whole: `--fractions` of them shadowed (at least one row; the cost of a lone session's shadow is
scaled by the fraction, its expectation). In one engine, interleaved, `--repeats` times each (after one untimed
warm-up of each): the served sessions' prompts and `steps` merged decode steps without shadows (the baseline) and
with them (the shadows' prompts prefilled too). Cost = time with shadows / time without - 1, for the decode steps
and for everything (prompts included); the shadow rows' outputs are compared with the served rows' at every position
(`stretches.position_errors` against `stretches.stretch_rtol`: an honest server must never be banned)."""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from benchmarks.engine.quant import LLAMA3_8B, TINY, quantized, random_layer
from benchmarks.field.verify_tolerance import engine_over
from corolla.client.verification.stretches import DEFAULT_FRACTION, DEFAULT_STRETCH_STEPS, position_errors, stretch_rtol
from corolla.engine.span_engine import StepRequest
from corolla.engine.spans.fast_llama import LayerWeights, LlamaSpec


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stretch_ends(prompt: int, steps: int, stretch_steps: int) -> list[int]:
    """The b of each recomputation [0, b) of a session of `prompt` + `steps` tokens: every full stretch, then the
    rest at its close."""
    ends = [prompt + k for k in range(stretch_steps, steps + 1, stretch_steps)]
    return ends if steps % stretch_steps == 0 else [*ends, prompt + steps]


@torch.inference_mode()
def measure(spec: LlamaSpec, layers: list[LayerWeights], rows: int, steps: int, args: argparse.Namespace) -> dict:
    device = layers[0].ln1.device
    total = args.prompt + steps
    gen = torch.Generator(device=device).manual_seed(rows * 1000 + steps)
    inputs = torch.randn(rows, total, spec.hidden_size, device=device, generator=gen).to(torch.bfloat16)
    engine = engine_over(spec, layers, triton=device.type == "cuda", rows=rows, tokens=total, graphs=args.graphs)
    sessions = [engine.open_session(1, total) for _ in range(rows)]
    for i, session in enumerate(sessions):  # the prompts (not counted: verification off or on, they are served)
        engine.step(session, inputs[i : i + 1, : args.prompt], 0)
    _sync(device)
    started = time.perf_counter()
    for t in range(steps):  # the decode steps served: every session's token per merged step
        position = args.prompt + t
        engine.decode_many(
            [StepRequest(s, inputs[i : i + 1, position : position + 1], position) for i, s in enumerate(sessions)]
        )
    _sync(device)
    decode_s = time.perf_counter() - started
    for session in sessions:
        session.close()
    ends = stretch_ends(args.prompt, steps, args.stretch_steps)
    _sync(device)
    started = time.perf_counter()
    for i in range(rows):  # every stretch of every session recomputed once, alone, in a fresh session
        for end in ends:
            with engine.open_session(1, end) as session:
                engine.step(session, inputs[i : i + 1, :end], 0)
    _sync(device)
    recompute_s = time.perf_counter() - started
    return {
        "rows": rows, "graphs": args.graphs, "prompt": args.prompt, "steps": steps, "stretch_ends": ends,
        "decode_s": round(decode_s, 4), "decode_ms_per_step": round(1e3 * decode_s / steps, 3),
        "recompute_all_s": round(recompute_s, 4), "fraction": args.fraction,
        "cost": round(args.fraction * recompute_s / decode_s, 4),
    }  # fmt: skip


def shadow_rows(rows: int, fraction: float) -> int:
    """Shadow rows of `rows` sessions sampled whole with probability `fraction` (their expected number, rounded; at
    least one)."""
    return max(1, round(fraction * rows))


@torch.inference_mode()
def measure_shadow(
    spec: LlamaSpec, layers: list[LayerWeights], rows: int, steps: int, args: argparse.Namespace, kind: str
) -> dict:
    """`--mode shadow` for one case (module docstring): times and errors of `rows` served sessions with 0 shadow rows
    and with `shadow_rows(rows, f)` for each fraction f, in one engine."""
    device = layers[0].ln1.device
    total = args.prompt + steps
    gen = torch.Generator(device=device).manual_seed(rows * 1000 + steps)
    inputs = torch.randn(rows, total, spec.hidden_size, device=device, generator=gen).to(torch.bfloat16)  # [R, T, H]
    fractions = [float(f) for f in args.fractions.split(",")]
    variants = sorted({0, *(shadow_rows(rows, f) for f in fractions)})
    engine = engine_over(spec, layers, triton=device.type == "cuda", rows=rows + variants[-1], tokens=total,
                         graphs=args.graphs, buckets=tuple(rows + v for v in variants))  # fmt: skip
    h = spec.hidden_size

    def run(shadows: int) -> tuple[float, float, torch.Tensor | None]:
        served = [engine.open_session(1, total) for _ in range(rows)]
        shadow = [engine.open_session(1, total) for _ in range(shadows)]
        out = torch.empty(steps, rows + shadows, h, dtype=torch.bfloat16, device=device)  # [S, R + V, H]
        _sync(device)
        started = time.perf_counter()
        for i, session in enumerate(served):  # the prompts served
            engine.step(session, inputs[i : i + 1, : args.prompt], 0)
        for j, session in enumerate(shadow):  # the replica's shadow of session j starts with its prompt
            engine.step(session, inputs[j : j + 1, : args.prompt], 0)
        _sync(device)
        decode_started = time.perf_counter()
        for t in range(steps):  # one merged forward: every served session's token and every shadow's replayed one
            position = args.prompt + t
            reqs = [StepRequest(s, inputs[i : i + 1, position : position + 1], position) for i, s in enumerate(served)]
            reqs += [StepRequest(s, inputs[j : j + 1, position : position + 1], position) for j, s in enumerate(shadow)]
            torch.cat(engine.decode_many(reqs), out=out[t].view(rows + shadows, 1, h))
        _sync(device)
        ended = time.perf_counter()
        for session in served + shadow:
            session.close()
        errors = None
        if shadows:  # served row j against its shadow, every decode position: [V * S]
            claimed, recomputed = out[:, :shadows].transpose(0, 1), out[:, rows:].transpose(0, 1)  # [V, S, H] each
            errors = position_errors(claimed, recomputed).flatten().float().cpu()
        return ended - started, ended - decode_started, errors

    for v in variants:  # compiles the kernels and captures the graphs of every bucket
        run(v)
    timings: dict[int, list[tuple[float, float]]] = {v: [] for v in variants}
    errors: torch.Tensor | None = None
    for _ in range(args.repeats):
        for v in variants:
            total_s, decode_s, errs = run(v)
            timings[v].append((total_s, decode_s))
            if v == variants[-1]:
                errors = errs
    median = {v: tuple(sorted(x[k] for x in timings[v])[len(timings[v]) // 2] for k in (0, 1)) for v in variants}
    base_total, base_decode = median[0]
    result: dict = {
        "mode": "shadow", "weights": kind, "rows": rows, "steps": steps, "prompt": args.prompt, "graphs": args.graphs,
        "repeats": args.repeats, "off_total_s": round(base_total, 4), "off_decode_s": round(base_decode, 4),
        "off_decode_ms_per_step": round(1e3 * base_decode / steps, 3), "fractions": {},
    }  # fmt: skip
    for f in fractions:
        v = shadow_rows(rows, f)
        scale = f * rows / v  # the expected shadows over the measured ones (a lone session: shadowed with prob f)
        total_s, decode_s = median[v]
        result["fractions"][str(f)] = {
            "shadow_rows": v, "total_s": round(total_s, 4), "decode_s": round(decode_s, 4),
            "cost_decode": round(scale * (decode_s / base_decode - 1), 4),
            "cost_total": round(scale * (total_s / base_total - 1), 4),
        }  # fmt: skip
    if errors is not None:
        rtol = stretch_rtol(torch.bfloat16, kind != "bf16")
        result.update({
            "positions_compared": int(errors.numel()), "max_error": float(errors.max()),
            "p999_error": float(errors.quantile(0.999)), "tolerance": rtol,
            "honest_server_banned": bool((errors > rtol).any()),
        })  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (dry run)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--cases", default="1:160,16:160,64:160,1:480,64:480", help="rows:steps, comma-separated")
    p.add_argument("--fraction", type=float, default=DEFAULT_FRACTION)
    p.add_argument("--stretch_steps", type=int, default=DEFAULT_STRETCH_STEPS)
    p.add_argument("--graphs", action="store_true", help="decode steps replay CUDA graphs")
    p.add_argument("--mode", choices=["recompute", "shadow"], default="recompute")
    p.add_argument("--fractions", default=f"{DEFAULT_FRACTION},1.0", help="shadow mode: sessions shadowed")
    p.add_argument("--repeats", type=int, default=3, help="shadow mode: timed runs of each variant (median)")
    p.add_argument("--kinds", default="bf16", help="shadow mode: weights, bf16 and/or nf4 (corolla's kernels)")
    p.add_argument("--nf4_cases", default="64:160", help="shadow mode: the cases run with NF4 weights")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    spec = TINY if args.tiny else LLAMA3_8B
    gen = torch.Generator(device=device).manual_seed(0)
    layers = [random_layer(spec, device, gen) for _ in range(args.layers)]
    name = platform.processor() or "cpu" if args.tiny else torch.cuda.get_device_name(device)
    print(f"{args.layers} bf16 layers of {'tiny' if args.tiny else 'Llama-3-8B'} shape on {name}", flush=True)
    results = []
    if args.mode == "shadow":
        for kind in args.kinds.split(","):
            weights = layers if kind == "bf16" else [quantized(layer, "nf4") for layer in layers]
            for case in (args.cases if kind == "bf16" else args.nf4_cases).split(","):
                rows, steps = (int(x) for x in case.split(":"))
                started = time.perf_counter()
                result = {
                    "device": name,
                    "layers": args.layers,
                    **measure_shadow(spec, weights, rows, steps, args, kind),
                }
                result["seconds"] = round(time.perf_counter() - started, 1)
                print(json.dumps(result), flush=True)
                results.append(result)
    for case in args.cases.split(",") if args.mode == "recompute" else ():
        rows, steps = (int(x) for x in case.split(":"))
        measure(spec, layers, rows, steps, args)  # compiles the kernels for these shapes
        result = {"device": name, "layers": args.layers, **measure(spec, layers, rows, steps, args)}
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        suffix = f"{'_shadow' if args.mode == 'shadow' else ''}{'_graphs' if args.graphs else ''}"
        (args.out / f"verify_cost{suffix}.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
