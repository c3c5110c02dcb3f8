"""Cost of client-side verification (`ClientConfig.verify_fraction`): tokens/s of greedy generation through a
loopback swarm of the demo model with two servers per span, for verify_fraction 0, 0.1 and 1.0 (same servers, same
prompt; each fraction gets a warm-up generation first). Run inside `../shared/tools/loopback-only`:
`python benchmarks/verify_cost.py [--new_tokens 48] [--repeats 3]`."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from corolla.cli.demo import split_blocks
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.demo.checkpoint import DEMO_CHECKPOINT_DIR, ensure_demo_checkpoint
from corolla.swarm.local import LocalSwarm, LocalSwarmConfig

FRACTIONS = (0.0, 0.1, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new_tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model_dir", default=None)
    args = parser.parse_args()
    model_dir = ensure_demo_checkpoint(Path(args.model_dir) if args.model_dir else DEMO_CHECKPOINT_DIR)
    from transformers import AutoConfig

    num_blocks = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    ranges = split_blocks(num_blocks, 2)
    prompt = torch.tensor([[1, 15, 27, 30, 42, 7]])
    with tempfile.TemporaryDirectory(prefix="corolla-verify-") as work:
        config = LocalSwarmConfig(
            server_args=("--device", "cpu", "--torch_dtype", "float32", "--throughput", "1.0",
                         "--cache_dir", str(Path(work) / "cache")),
            startup_timeout_s=240.0,
        )  # fmt: skip
        with LocalSwarm(config) as swarm:
            swarm.start(model_dir, [*ranges, *ranges])  # two servers per span
            base = ClientConfig(show_route="never", max_retries=3)
            results: dict[float, list[float]] = {}
            for fraction in FRACTIONS:
                client_config = dataclasses.replace(base, verify_fraction=fraction)
                with AutoDistributedModelForCausalLM.from_pretrained(
                    model_dir, initial_peers=swarm.initial_peers, client_config=client_config
                ) as model:
                    deadline = time.monotonic() + 60
                    while len(model.manager.spans) < 4 and time.monotonic() < deadline:
                        model.manager.update()
                    model.generate(prompt, max_new_tokens=4)  # warm-up: routes, streams, rpc_info
                    rates = []
                    for _ in range(args.repeats):
                        started = time.perf_counter()
                        model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
                        rates.append(args.new_tokens / (time.perf_counter() - started))
                    results[fraction] = rates
                    print(f"verify_fraction={fraction}: {statistics.median(rates):.2f} tok/s "
                          f"(runs: {', '.join(f'{r:.2f}' for r in rates)})", flush=True)  # fmt: skip
            base_rate = statistics.median(results[0.0])
            for fraction, rates in results.items():
                print(f"verify_fraction={fraction}: {statistics.median(rates) / base_rate:.2f}x of unverified speed")


if __name__ == "__main__":
    main()
