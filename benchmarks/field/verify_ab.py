"""A/B of verification's cost on this machine, in one run (inside `../shared/tools/loopback-only`):
`python -m benchmarks.field.verify_ab [--new_tokens 48] [--repeats 3]`. The demo model on a loopback swarm with two
honest servers per span; tokens/s of greedy generation with verification off, with the per-step re-run
(`verify_fraction` 0.1 and 1.0) and with stretch recomputation (`verify_stretch_fraction` 0.55, the rate that catches a
1%-liar within 1,000 steps, and 1.0). Every generation's verification finishes before its time is taken (the
session's close waits for it), so the cost counted is the whole recomputation on this machine's CPUs."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from corolla.cli.demo import split_blocks
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.client.stretches import DEFAULT_FRACTION
from corolla.demo.checkpoint import DEMO_CHECKPOINT_DIR, ensure_demo_checkpoint
from corolla.swarm.local import LocalSwarm, LocalSwarmConfig

VARIANTS: dict[str, dict[str, float]] = {
    "off": {},
    "step_0.1": {"verify_fraction": 0.1},
    "step_1.0": {"verify_fraction": 1.0},
    f"stretch_{DEFAULT_FRACTION}": {"verify_stretch_fraction": DEFAULT_FRACTION},
    "stretch_1.0": {"verify_stretch_fraction": 1.0},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new_tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model_dir", default=None)
    args = parser.parse_args()
    model_dir = ensure_demo_checkpoint(Path(args.model_dir) if args.model_dir else DEMO_CHECKPOINT_DIR)
    from transformers import AutoConfig

    ranges = split_blocks(AutoConfig.from_pretrained(model_dir).num_hidden_layers, 2)
    prompt = torch.tensor([[1, 15, 27, 30, 42, 7]])
    with tempfile.TemporaryDirectory(prefix="corolla-verify-ab-") as work:
        config = LocalSwarmConfig(
            server_args=("--device", "cpu", "--torch_dtype", "float32", "--throughput", "1.0",
                         "--cache_dir", str(Path(work) / "cache")),
            startup_timeout_s=300.0,
        )  # fmt: skip
        with LocalSwarm(config) as swarm:
            swarm.start(model_dir, [*ranges, *ranges])  # two servers per span
            base = ClientConfig(show_route="never", max_retries=3)
            with contextlib.ExitStack() as stack:
                models = {}
                for name, overrides in VARIANTS.items():
                    models[name] = model = stack.enter_context(
                        AutoDistributedModelForCausalLM.from_pretrained(
                            model_dir,
                            initial_peers=swarm.initial_peers,
                            client_config=dataclasses.replace(base, **overrides),
                        )
                    )
                    deadline = time.monotonic() + 60
                    while len(model.manager.spans) < 4 and time.monotonic() < deadline:
                        model.manager.update()
                    model.generate(prompt, max_new_tokens=4)  # warm-up: routes, streams, rpc_info
                rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
                for _ in range(args.repeats):  # interleaved: a shared machine's load changes hit every variant alike
                    for name, model in models.items():
                        started = time.perf_counter()
                        model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
                        rates[name].append(args.new_tokens / (time.perf_counter() - started))
                for name, model in models.items():
                    runs = rates[name]
                    print(json.dumps({"variant": name, "tok_s": round(statistics.median(runs), 2),
                                      "runs": [round(r, 2) for r in runs],
                                      "banned": sorted(model.manager.bans.banned_peers())}), flush=True)  # fmt: skip
                off = statistics.median(rates["off"])
                print(json.dumps({name: round(statistics.median(r) / off, 3) for name, r in rates.items()}), flush=True)


if __name__ == "__main__":
    main()
