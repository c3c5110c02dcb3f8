"""Where the device time of shadow rows goes (issue 37's verification cost, decision 0260): `python -m
benchmarks.field.shadow_rows --layers 8 --contexts 160,600` on a GPU (`--tiny`: the code paths on the CPU, no figures).

One merged decode forward of random Llama-3-8B-shaped bf16 layers on the engine's CUDA-graph path (`SpanEngine.
decode_many` with the hidden states on the CPU, as a server's launched forwards take them), profiled by kernel
(`torch.profiler`, device time of each kernel summed, averaged over `--reps` forwards), in three compositions of the
same context length: `--rows` real single-token rows; the same plus `--shadows` shadow requests of `SHADOW_BATCH_ROWS`
consecutive positions each (how a replica runs a shadow's request: its rows attend to each other through the pool,
`StepRequest.is_decode`); the same real rows plus as many rows of distinct sessions. Prints one JSON line per context:
each composition's kernel time and its largest kernels."""

from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine.quant import LLAMA3_8B, TINY, random_layer
from benchmarks.field.verify_tolerance import engine_over
from corolla.client.session.shadows import SHADOW_BATCH_ROWS
from corolla.engine.span_engine import SpanEngine, StepRequest
from corolla.engine.step_request import StepSession

TOP_KERNELS = 10


def _step(session: StepSession, hidden: torch.Tensor) -> StepRequest:
    """The session's next positions as merged decode rows (a shadow's request as a replica marks it)."""
    request = StepRequest(session, hidden, session.length_tokens)
    request.is_decode = True
    return request


def _kernels(engine: SpanEngine, requests: list[StepRequest], reps: int, cuda: bool) -> dict:
    """Device time a forward of `requests` (fresh ones each rep: positions advance), by kernel."""
    hiddens = [(r.session, r.hidden) for r in requests]
    for _ in range(2):  # warm: graph capture of the bucket, allocator
        engine.decode_many([_step(s, h) for s, h in hiddens])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            engine.decode_many([_step(s, h) for s, h in hiddens])
        if cuda:
            torch.cuda.synchronize()
    by_kernel: collections.Counter[str] = collections.Counter()
    for event in prof.key_averages():
        if event.key.startswith(("cuda", "Activity")):  # host-side API calls, not device work
            continue
        by_kernel[event.key[:60]] += (event.device_time_total if cuda else event.cpu_time_total) / reps
    return {
        "kernels_us": round(sum(by_kernel.values()), 1),
        "top_us": {name: round(us, 1) for name, us in by_kernel.most_common(TOP_KERNELS)},
    }


@torch.inference_mode()
def measure(args: argparse.Namespace, context: int) -> dict:
    cuda = not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    spec = TINY if args.tiny else LLAMA3_8B
    gen = torch.Generator(device=device).manual_seed(0)
    layers = [random_layer(spec, device, gen) for _ in range(args.layers)]
    shadow_rows = args.shadows * SHADOW_BATCH_ROWS
    total = context + (2 + args.reps) * 3 * SHADOW_BATCH_ROWS + 8  # every composition's positions fit
    engine = engine_over(
        spec, layers, triton=cuda, rows=args.rows + shadow_rows, tokens=total, graphs=cuda,
        buckets=(args.rows, args.rows + shadow_rows),
    )  # fmt: skip
    real = [engine.open_session(1, total) for _ in range(args.rows)]
    distinct = [engine.open_session(1, total) for _ in range(shadow_rows)]
    shadows = [engine.open_session(1, total) for _ in range(args.shadows)]
    prompt = torch.randn(1, context, spec.hidden_size, device=device, generator=gen).to(torch.bfloat16)
    for session in real + distinct + shadows:
        engine.step(session, prompt, 0)
    one = torch.randn(1, 1, spec.hidden_size, generator=None).to(torch.bfloat16)  # [1, 1, H] on the CPU
    batch = torch.randn(1, SHADOW_BATCH_ROWS, spec.hidden_size).to(torch.bfloat16)  # [1, 16, H]
    compositions = {
        "real": [_step(s, one) for s in real],
        "real+shadows": [_step(s, one) for s in real] + [_step(s, batch) for s in shadows],
        "real+distinct": [_step(s, one) for s in real + distinct],
    }
    result = {"context": context, "rows": args.rows, "shadow_rows": shadow_rows, "layers": args.layers}
    for name, requests in compositions.items():
        result[name] = _kernels(engine, requests, args.reps, cuda)
    base = result["real"]["kernels_us"]
    for name in ("real+shadows", "real+distinct"):
        result[name]["vs_real"] = round(result[name]["kernels_us"] / base - 1, 4) if base else None
    # positions each shadow session took (2 warm-up forwards and `reps` profiled ones, 16 positions each): its
    # requests ran whole, as rows of the merged forwards
    result["shadow_positions"] = [s.length_tokens - context for s in shadows]
    for session in real + distinct + shadows:
        session.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (dry run)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", type=int, default=64, help="real single-token rows")
    p.add_argument("--shadows", type=int, default=3, help=f"shadow requests of {SHADOW_BATCH_ROWS} positions")
    p.add_argument("--contexts", default="160,600", help="tokens before the step, comma-separated")
    p.add_argument("--reps", type=int, default=4, help="profiled forwards per composition")
    args = p.parse_args(argv)
    if args.tiny:
        args.rows, args.shadows = min(args.rows, 4), min(args.shadows, 1)
    name = "cpu" if args.tiny else torch.cuda.get_device_name()
    for context in (int(c) for c in args.contexts.split(",")):
        print(json.dumps({"device": name, **measure(args, context)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
