"""What mirroring span steps to shadow sessions costs a client's host, per step (issue 37: verification <= 5% of the
swarm's throughput): `python -m benchmarks.field.verify_client_cost [--sessions 64] [--steps 256] [--repeats 7]`.

`benchmarks.field.verify_cost` measures the replica (the shadows' rows and requests on its runtime); it runs none of
the client's code. Here the client's own `client.session.shadows.ShadowVerifier` runs, on the CPU, as a client's
`InferenceSession._step` runs it: on the client loop (`background_loop`), `after_step` after each span step of
`--sessions` span sessions stepping in lockstep (their `--prompt`-token step, then one decode position a step, hidden
size `--hidden`, bf16), every session's step of a round in turn, the loop free between rounds (the shadows' workers
run then). The span sessions' server is not modelled (its outputs are given: a fresh [1, T, H] tensor per step, as a
reply's deserialization makes); each shadow's replica is honest and answers its requests at once (its outputs are the
server's own), so what is measured is the client's work for the shadows: copying each mirrored step, holding, waking
its worker, joining the held steps into one request, recording the inputs replayed and comparing outputs
(`stretches.position_errors`), with no network under it. Per run, the CPU seconds of the client loop's thread
over the steps and the shadows' end (`finish`), with the shadows (`--fraction` of the span sessions, drawn as a
client draws them: seeded) and without (`verify_shadow_fraction` 0: `after_step` returns at once), their order
alternated from one repeat to the next; the cost is their difference per mirrored step (median over the repeats, and
per pair). Prints one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import time
from types import SimpleNamespace

import torch

from benchmarks.field.catch_rate import HonestReplicas, LocalManager
from corolla.client import background_loop
from corolla.client.config import ClientConfig
from corolla.client.session.shadows import DEFAULT_SHADOW_FRACTION
from corolla.utils.logging import quiet_logs


async def _run(
    args: argparse.Namespace, inputs: torch.Tensor, answers: torch.Tensor, fraction: float, seed: int
) -> dict:
    """One run on the client loop: every session's steps, then every shadow's end; -> CPU seconds, counts."""
    manager = LocalManager(ClientConfig(verify_shadow_fraction=fraction))
    server = next(s for s in manager.spans if s.peer_id == "server")
    total = args.prompt + args.steps
    rng = random.Random(seed)
    verifiers = [HonestReplicas(manager, answers, i, random.Random(rng.random())) for i in range(args.sessions)]
    span_sessions = [
        SimpleNamespace(span=server, history=inputs[i : i + 1], max_length=total) for i in range(args.sessions)
    ]  # (the history holds every input from the start: `after_step` reads positions up to the step's)
    started_cpu, started = time.thread_time(), time.perf_counter()
    first = 0
    while first < total:
        last = args.prompt if first == 0 else first + 1
        for i, verifier in enumerate(verifiers):
            outputs = answers[i : i + 1, first:last].clone()  # a reply's fresh tensor [1, T, H]
            verifier.after_step(span_sessions[i], outputs, first)  # type: ignore[arg-type]
        await asyncio.sleep(0)  # the loop free between rounds of steps: the shadows' workers woken by this one run
        first = last
    for verifier in verifiers:
        await verifier.finish()
    cpu_s, wall_s = time.thread_time() - started_cpu, time.perf_counter() - started
    shadows = [shadow for verifier in verifiers for shadow in verifier.shadows]
    assert all(shadow.state == "agreed" for shadow in shadows), [shadow.state for shadow in shadows]
    compared = sum(shadow.positions_compared for shadow in shadows)
    assert compared == len(shadows) * total, "every mirrored position compared"
    return {"cpu_s": cpu_s, "wall_s": wall_s, "shadows": len(shadows), "positions_compared": compared,
            "max_error": max((shadow.max_error for shadow in shadows), default=0.0)}  # fmt: skip


def measure(args: argparse.Namespace) -> dict:
    total = args.prompt + args.steps
    generator = torch.Generator().manual_seed(args.seed)
    inputs = torch.randn(args.sessions, total, args.hidden, generator=generator).to(torch.bfloat16)  # [S, L, H]
    answers = torch.randn(args.sessions, total, args.hidden, generator=generator).to(torch.bfloat16)

    def run(fraction: float, repeat: int) -> dict:
        gc.collect()  # (not inside the timed window)
        return background_loop.run(_run(args, inputs, answers, fraction, args.seed * 1000 + repeat))

    run(args.fraction, -1)  # warm-up (first-use costs: the loop, torch's kernels)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for repeat in range(args.repeats):  # alternated: a drift over the process hits both alike
        for shadowed in (False, True) if repeat % 2 == 0 else (True, False):
            runs[shadowed].append(run(args.fraction if shadowed else 0.0, repeat))
    steps = args.sessions * (1 + args.steps)  # span steps (the prompt's, then one per position)
    pairs_us = []  # the shadows' CPU per mirrored step, per repeat
    for off, on in zip(runs[False], runs[True], strict=True):
        mirrored_steps = on["shadows"] * (1 + args.steps)
        pairs_us.append(1e6 * (on["cpu_s"] - off["cpu_s"]) / max(1, mirrored_steps))
    off_cpu = statistics.median(r["cpu_s"] for r in runs[False])
    shadows = statistics.median(r["shadows"] for r in runs[True])
    return {
        "sessions": args.sessions, "steps": args.steps, "prompt": args.prompt, "hidden": args.hidden,
        "fraction": args.fraction, "repeats": args.repeats, "shadows_median": shadows,
        "off_cpu_s": [round(r["cpu_s"], 4) for r in runs[False]], "on_cpu_s": [round(r["cpu_s"], 4) for r in runs[True]],
        "off_us_per_step": round(1e6 * off_cpu / steps, 2),
        "shadow_us_per_mirrored_step": round(statistics.median(pairs_us), 2),
        "shadow_us_per_mirrored_step_pairs": [round(x, 2) for x in pairs_us],
        "positions_compared": runs[True][-1]["positions_compared"], "max_error": runs[True][-1]["max_error"],
    }  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=64, help="span sessions stepping in lockstep")
    p.add_argument("--steps", type=int, default=256, help="decode positions per session after its prompt")
    p.add_argument("--prompt", type=int, default=32, help="tokens of each session's first step")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (Llama-3-8B's by default)")
    p.add_argument("--fraction", type=float, default=DEFAULT_SHADOW_FRACTION, help="span sessions shadowed")
    p.add_argument("--repeats", type=int, default=7, help="timed runs with and without shadows (medians)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main() -> None:
    torch.set_num_threads(1)  # a client's copies and comparisons of one step are small
    with quiet_logs():
        report = measure(parser().parse_args())
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
