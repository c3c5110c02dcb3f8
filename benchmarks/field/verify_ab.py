"""A/B of verification's cost on this machine, in one run (inside `../shared/tools/loopback-only`):
`python -m benchmarks.field.verify_ab [--new_tokens 48] [--repeats 3]`. The demo model on a loopback swarm with two
honest servers per span; tokens/s of greedy generation with verification off, with the per-step re-run
(`verify_fraction` 0.1 and 1.0) and with shadow sessions (`verify_shadow_fraction` 0.75, the rate that catches a
1%-liar within 1,000 steps, and 1.0). Every generation's verification finishes before its time is taken (the
session's close waits for its shadows), so the cost counted is the whole recomputation on this machine's CPUs.

A lone client's tok/s is latency, not throughput: the servers idle between its steps and a background recomputation
uses that idle time. So the bench also reports the servers' CPU time per generated token (every server process and
its children: p2pd, the DHT), measured around each generation, the verification included: on a swarm whose
servers are CPU-bound, throughput is the inverse of that figure, so `cpu_vs_off` - 1 is verification's throughput
cost on this machine, whatever else shares it."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch

from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.client.session.shadows import DEFAULT_SHADOW_FRACTION
from corolla.demo.checkpoint import DEMO_CHECKPOINT_DIR, ensure_demo_checkpoint
from corolla.swarm.local import LocalSwarm, LocalSwarmConfig, even_block_ranges

# name: (ClientConfig.verify_fraction, ClientConfig.verify_shadow_fraction)
VARIANTS: dict[str, tuple[float, float]] = {
    "off": (0.0, 0.0),
    "step_0.1": (0.1, 0.0),
    "step_1.0": (1.0, 0.0),
    f"shadow_{DEFAULT_SHADOW_FRACTION}": (0.0, DEFAULT_SHADOW_FRACTION),
    "shadow_1.0": (0.0, 1.0),
}


def servers_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds used so far by the processes `pids` and their living descendants."""
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for process in [root, *root.children(recursive=True)]:
                times = process.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new_tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model_dir", default=None)
    args = parser.parse_args()
    model_dir = ensure_demo_checkpoint(Path(args.model_dir) if args.model_dir else DEMO_CHECKPOINT_DIR)
    from transformers import AutoConfig

    ranges = even_block_ranges(AutoConfig.from_pretrained(model_dir).num_hidden_layers, 2)
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
                for name, (verify_fraction, shadow_fraction) in VARIANTS.items():
                    models[name] = model = stack.enter_context(
                        AutoDistributedModelForCausalLM.from_pretrained(
                            model_dir,
                            initial_peers=swarm.initial_peers,
                            client_config=dataclasses.replace(
                                base, verify_fraction=verify_fraction, verify_shadow_fraction=shadow_fraction
                            ),
                        )
                    )
                    deadline = time.monotonic() + 60
                    while len(model.manager.spans) < 4 and time.monotonic() < deadline:
                        model.manager.update()
                    model.generate(prompt, max_new_tokens=4)  # warm-up: routes, streams, rpc_info
                pids = [server.proc.pid for server in swarm.servers]
                rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
                cpu_ms: dict[str, list[float]] = {name: [] for name in VARIANTS}  # servers' CPU ms per token
                for _ in range(args.repeats):  # interleaved: a shared machine's load changes hit every variant alike
                    for name, model in models.items():
                        cpu_before = servers_cpu_s(pids)
                        started = time.perf_counter()
                        model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
                        rates[name].append(args.new_tokens / (time.perf_counter() - started))
                        cpu_ms[name].append(1e3 * (servers_cpu_s(pids) - cpu_before) / args.new_tokens)
                for name, model in models.items():
                    runs = rates[name]
                    print(json.dumps({"variant": name, "tok_s": round(statistics.median(runs), 2),
                                      "runs": [round(r, 2) for r in runs],
                                      "server_cpu_ms_per_token": round(statistics.median(cpu_ms[name]), 2),
                                      "cpu_runs": [round(c, 2) for c in cpu_ms[name]],
                                      "banned": sorted(model.manager.bans.banned_peers())}), flush=True)  # fmt: skip
                off = statistics.median(rates["off"])
                print(json.dumps({name: round(statistics.median(r) / off, 3) for name, r in rates.items()}), flush=True)
                off_cpu = statistics.median(cpu_ms["off"])
                print(json.dumps({"cpu_vs_off": {name: round(statistics.median(c) / off_cpu, 3)
                                                 for name, c in cpu_ms.items()}}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
