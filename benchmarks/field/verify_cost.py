"""What stretch verification costs a GPU swarm's throughput (issue 37's target: <= 5%): `python -m
benchmarks.field.verify_cost --out DIR` on a GPU (`--tiny` dry-runs the code on the CPU in seconds).

A span of random Llama-3-8B-shaped bf16 layers serves `rows` sessions: one prefill of `--prompt` tokens each, then
`steps` merged single-token decode steps through the engine's serving path (Triton kernels on CUDA, paged pool; no
kernel tuning; `--graphs`: decode steps replay CUDA graphs, as a server's do). That decode time is the work served (the baseline,
verification off). Verification as `client.stretches` samples it: at the end of each stretch of `--stretch_steps`
steps of a session (and at its close) a replica, a server of the same kind, recomputes positions [0, b) of that
session in ONE forward (b = prompt + 64, prompt + 128, ..., prompt + steps), each stretch with probability
`--fraction`. Every such forward is timed here, per session, unmerged (an upper bound: a replica may merge concurrent
forwards), on the same engine. Cost = fraction x recompute time / decode time: the share of the swarm's GPU time
that verification adds (the replicas are servers of the same swarm). Each case runs twice; the second is reported
(the first compiles the kernels)."""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from benchmarks.engine.quant import LLAMA3_8B, TINY, random_layer
from benchmarks.field.verify_tolerance import engine_over
from corolla.client.stretches import DEFAULT_FRACTION, DEFAULT_STRETCH_STEPS
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (dry run)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--cases", default="1:160,16:160,64:160,1:480,64:480", help="rows:steps, comma-separated")
    p.add_argument("--fraction", type=float, default=DEFAULT_FRACTION)
    p.add_argument("--stretch_steps", type=int, default=DEFAULT_STRETCH_STEPS)
    p.add_argument("--graphs", action="store_true", help="decode steps replay CUDA graphs")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    spec = TINY if args.tiny else LLAMA3_8B
    gen = torch.Generator(device=device).manual_seed(0)
    layers = [random_layer(spec, device, gen) for _ in range(args.layers)]
    name = platform.processor() or "cpu" if args.tiny else torch.cuda.get_device_name(device)
    print(f"{args.layers} bf16 layers of {'tiny' if args.tiny else 'Llama-3-8B'} shape on {name}", flush=True)
    results = []
    for case in args.cases.split(","):
        rows, steps = (int(x) for x in case.split(":"))
        measure(spec, layers, rows, steps, args)  # compiles the kernels for these shapes
        result = {"device": name, "layers": args.layers, **measure(spec, layers, rows, steps, args)}
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"verify_cost{'_graphs' if args.graphs else ''}.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
