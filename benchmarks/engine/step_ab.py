"""A/B of the decode step with module functions swapped for other sources' on one card:
`python -m benchmarks.engine.step_ab --swap LABEL=MODULE:FUNCTION=FILE [...] [--kind nf4] [--sessions 1]`.

One engine of `--kind` over 32 random Llama-3-8B-shaped layers (benchmarks.engine.quant's; `--device cpu`: 2 tiny
layers, a dry run of the code paths), `--sessions` sessions prefilled to 512 tokens; then, alternated over
`--rounds` rounds, this tree ("tree") and each LABEL: for a label, every MODULE:FUNCTION it names replaced by
FUNCTION of FILE (loaded as a module of its own, e.g. a copy of `triton_kernels.py` with one kernel changed; several
`--swap` items may share a label), the engine's CUDA graphs captured afresh. Per round and variant: the merged step
of all sessions (host-timed median of `benchmarks.engine.quant.STEPS`) and its graph replayed alone, and whether the
step's outputs are `torch.equal` to the tree's first. The swapped functions are put back after each variant.
Writes a JSON under `--out` where given; the log on stdout."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common.measure import event_median_ms
from benchmarks.engine.kernel_ab import loaded_kernel
from benchmarks.engine.quant import STEPS, open_prefilled, random_quantized_engine, step_ms

PREFIX_TOKENS = 512
BASE = "tree"


@dataclass(frozen=True)
class Swap:
    label: str
    module: str
    function: str
    path: Path

    @classmethod
    def parse(cls, text: str) -> Swap:
        """LABEL=MODULE:FUNCTION=FILE -> Swap; ValueError naming the form otherwise."""
        label, _, rest = text.partition("=")
        target, _, path = rest.partition("=")
        module, _, function = target.partition(":")
        if not (label and module and function and path) or label == BASE:
            raise ValueError(f"--swap takes LABEL=MODULE:FUNCTION=FILE with a label other than {BASE!r}, got {text!r}")
        return cls(label, module, function, Path(path))


def variant_functions(swaps: list[Swap]) -> dict[str, dict[tuple[str, str], Callable]]:
    """Per label (BASE first, swapping nothing): the functions its swaps put in place, by (module, function)."""
    variants: dict[str, dict[tuple[str, str], Callable]] = {BASE: {}}
    for s in swaps:
        variants.setdefault(s.label, {})[(s.module, s.function)] = loaded_kernel(s.path, s.label, s.function)
    return variants


@contextlib.contextmanager
def swapped(functions: dict[tuple[str, str], Callable]) -> Iterator[None]:
    """Each (module, function) set to its replacement for the block, the originals put back after it."""
    originals = {key: getattr(importlib.import_module(key[0]), key[1]) for key in functions}
    try:
        for (module, name), fn in functions.items():
            setattr(importlib.import_module(module), name, fn)
        yield
    finally:
        for (module, name), fn in originals.items():
            setattr(importlib.import_module(module), name, fn)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict:
    dev = torch.device(args.device)
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    variants = variant_functions([Swap.parse(t) for t in args.swap])
    gen = torch.Generator(device=dev).manual_seed(0)
    layers_n = 32 if dev.type == "cuda" else 2
    engine, _, _, bandwidth = random_quantized_engine(args.kind, dev, layers_n, args.sessions, PREFIX_TOKENS, gen)
    print(f"step_ab.start(card={card!r}, copy_TBps={bandwidth / 1e12:.2f}, kind={args.kind}, sessions={args.sessions})")
    floor_ms = engine.model.weight_bytes() / bandwidth * 1000
    sessions = open_prefilled(engine, args.sessions, PREFIX_TOKENS, gen)
    reference: list[torch.Tensor] | None = None
    rounds: list[dict] = []
    for r in range(args.rounds):
        for label, functions in variants.items():
            with swapped(functions):
                if engine.graphs is not None:
                    engine.graphs.clear()
                    engine.graphs.capture_all()
                ms, outs = step_ms(engine, sessions, PREFIX_TOKENS)
                outs = [o.clone() for o in outs]
                replay = (
                    event_median_ms(functools.partial(engine.graphs.run, args.sessions), STEPS)
                    if engine.graphs is not None
                    else float("nan")
                )
            reference = outs if reference is None else reference
            row = {"round": r, "variant": label, "step_ms": ms, "replay_ms": replay, "equal": _same(reference, outs)}
            rounds.append(row)
            print(
                f"step_ab.round(round={r}, variant={label}, step_ms={ms:.3f}, floor_x={ms / floor_ms:.3f}, "
                f"replay_ms={replay:.3f}, outputs_equal_tree={row['equal']})",
                flush=True,
            )
    summary = {}
    for label in variants:
        steps = [x["step_ms"] for x in rounds if x["variant"] == label]
        replays = [x["replay_ms"] for x in rounds if x["variant"] == label]
        summary[label] = {
            "step_ms": statistics.median(steps),
            "floor_x": statistics.median(steps) / floor_ms,
            "replay_ms": statistics.median(replays),
            "equal": all(x["equal"] for x in rounds if x["variant"] == label),
        }
        s = summary[label]
        print(
            f"step_ab.summary(variant={label}, step_ms={s['step_ms']:.3f}, floor_x={s['floor_x']:.3f}, "
            f"replay_ms={s['replay_ms']:.3f}, outputs_equal_tree={s['equal']})"
        )
    return {"card": card, "kind": args.kind, "sessions": args.sessions, "floor_ms": floor_ms, "rounds": rounds,
            "summary": summary}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--swap", nargs="+", required=True, metavar="LABEL=MODULE:FUNCTION=FILE")
    p.add_argument("--kind", default="nf4", choices=["nf4", "int8"])
    p.add_argument("--sessions", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    result = run(args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"step_ab-{args.kind}-{args.sessions}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
