"""Stock Petals 2.2 for `python -m benchmarks.wan`, run by the Petals venv's interpreter as a script (it imports nothing
of corolla). `server`: petals' own Server on `--host_port`, announcing `--announce_port` (its WAN proxy), on loopback
with relays, AutoNAT and NAT port mapping off (`petals_server.serve`, shared with the interop tests' driver).
`client`: petals' own client; for each round it waits (bounded) for the file `<rounds_dir>/go-<i>`, generates
greedily with a streamer taking the time of every token, and prints one `petals-wan: round {json}` line, so the bench
can change the proxies' delay between rounds."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# run as a script (`python petals_side.py ...`), so its own directory is on sys.path: the shared stock-Petals server
# (the checker, which sees the file as `benchmarks.wan.petals_server`, cannot resolve this script-relative name)
from petals_server import add_server_args, loopback_client_dht, serve  # type: ignore[import-not-found]

READY_PREFIX = "petals-wan: ready"
ROUND_PREFIX = "petals-wan: round "
CLIENT_READY = "petals-wan: client ready"


class _Clock:
    """A `generate(streamer=...)` sink: the time of each put after the prompt's."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value: object) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def run_client(args: argparse.Namespace) -> int:
    import torch
    from petals import AutoDistributedModelForCausalLM

    torch.set_num_threads(1)
    loopback_client_dht()
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model,
        initial_peers=args.initial_peers,
        dht_prefix=args.dht_prefix,
        max_retries=3,
        daemon_startup_timeout=60,
        request_timeout=60,
        torch_dtype=torch.float32,
    ).eval()
    prompt = torch.tensor([args.input_ids])  # [1, T]
    print(CLIENT_READY, flush=True)
    rounds = Path(args.rounds_dir)
    for i in range(args.rounds):
        go = rounds / f"go-{i}"
        deadline = time.monotonic() + args.round_timeout_s
        while not go.exists():
            if time.monotonic() > deadline:
                print(f"petals-wan: round {i} never started", flush=True)
                os._exit(1)
            time.sleep(0.02)
        results = []
        for _ in range(args.repeats):
            clock = _Clock()
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(
                    prompt, max_new_tokens=args.new_tokens, do_sample=False, streamer=clock,
                    attention_mask=torch.ones_like(prompt),
                )  # fmt: skip
            results.append({"start": start, "token_times": clock.times, "tokens": out[0, prompt.shape[1] :].tolist()})
        print(ROUND_PREFIX + json.dumps({"round": i, "runs": results}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # petals' client teardown sometimes hangs in hivemind; the caller reaps our process group


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_server_args(sub.add_parser("server"), inference_max_length=512, ready_timeout_s=180.0)
    client = sub.add_parser("client")
    client.add_argument("--model", required=True)
    client.add_argument("--dht_prefix", required=True)
    client.add_argument("--initial_peers", nargs="+", required=True)
    client.add_argument("--input_ids", type=int, nargs="+", required=True)
    client.add_argument("--new_tokens", type=int, default=16)
    client.add_argument("--repeats", type=int, default=1)
    client.add_argument("--rounds", type=int, required=True)
    client.add_argument("--rounds_dir", required=True)
    client.add_argument("--round_timeout_s", type=float, default=600.0)
    args = parser.parse_args()
    return serve(args, READY_PREFIX) if args.command == "server" else run_client(args)


if __name__ == "__main__":
    sys.exit(main())
