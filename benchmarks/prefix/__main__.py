"""`python -m benchmarks.prefix [--conversations N] [--hidden_size H] ... [--server_arg=--flag ...]`: prints the
summary as JSON lines (one per run) and, with `--markdown`, a table row for RESULTS.md."""

from __future__ import annotations

import argparse
import json
import tempfile

from benchmarks.prefix.checkpoint import ModelShape
from benchmarks.prefix.run import run
from benchmarks.prefix.workload import WorkloadConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefix", description=__doc__)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=float, default=WorkloadConfig.turns_per_conversation)
    parser.add_argument("--prompt_tokens", type=float, default=WorkloadConfig.prompt_tokens)
    parser.add_argument("--response_tokens", type=float, default=WorkloadConfig.response_tokens)
    parser.add_argument("--system_prompt_tokens", type=int, default=WorkloadConfig.system_prompt_tokens)
    parser.add_argument("--system_prompts", type=int, default=WorkloadConfig.num_system_prompts)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden_size", type=int, default=ModelShape.hidden_size)
    parser.add_argument("--num_layers", type=int, default=ModelShape.num_layers)
    parser.add_argument("--server_arg", action="append", default=[], help="a flag for both servers (repeat)")
    parser.add_argument("--workdir", default=None, help="where the model is written (default: a temp dir)")
    args = parser.parse_args(argv)
    workload = WorkloadConfig(
        num_conversations=args.conversations,
        turns_per_conversation=args.turns,
        prompt_tokens=args.prompt_tokens,
        response_tokens=args.response_tokens,
        system_prompt_tokens=args.system_prompt_tokens,
        num_system_prompts=args.system_prompts,
        seed=args.seed,
    )
    heads = max(1, args.hidden_size // 64)
    shape = ModelShape(
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        intermediate_size=int(args.hidden_size * 2.6875),
    )
    with tempfile.TemporaryDirectory(prefix="corolla-prefix-bench-") as tmp:
        report = run(
            args.workdir or tmp,
            workload=workload,
            shape=shape,
            server_args=args.server_arg,
            concurrency=args.concurrency,
        )
    print(json.dumps(report.summary()))
    for result in report.off.results + report.on.results:
        if result.error:
            print(json.dumps({"conversation": result.conversation, "turn": result.turn, "error": result.error}))
    return 0 if report.on.errors == report.off.errors == 0 and report.unexplained_mismatches == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
