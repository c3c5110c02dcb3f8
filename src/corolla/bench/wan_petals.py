"""Stock Petals 2.2 for `corolla-bench --wan`, run by the Petals venv's interpreter as a script (it imports nothing
of corolla). `server`: petals' own Server on `--host_port`, announcing `--announce_port` (its WAN proxy), on loopback
with relays, AutoNAT and NAT port mapping off. `client`: petals' own client; for each round it waits (bounded) for
the file `<rounds_dir>/go-<i>`, generates greedily with a streamer taking the time of every token, and prints one
`petals-wan: round {json}` line, so the bench can change the proxies' delay between rounds."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("PETALS_IGNORE_DEPENDENCY_VERSION", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

READY_PREFIX = "petals-wan: ready"
ROUND_PREFIX = "petals-wan: round "
CLIENT_READY = "petals-wan: client ready"
LOOPBACK = dict(use_relay=False, use_auto_relay=False, nat_port_map=False, auto_nat=False)


def run_server(args: argparse.Namespace) -> int:
    import torch
    from hivemind.proto.runtime_pb2 import CompressionType
    from petals.server.server import Server

    torch.set_num_threads(1)
    server = Server(
        initial_peers=args.initial_peers,
        dht_prefix=args.dht_prefix,
        converted_model_name_or_path=args.model,
        block_indices=args.block_indices,
        throughput=1.0,  # a float skips the speedtest (network) and the compute benchmark
        device="cpu",
        torch_dtype="float32",
        compression=CompressionType.NONE,
        num_handlers=2,
        update_period=5.0,
        mean_block_selection_delay=0.2,
        inference_max_length=512,
        cache_dir=args.cache_dir,
        skip_reachability_check=True,
        reachable_via_relay=False,
        host_maddrs=[f"/ip4/127.0.0.1/tcp/{args.host_port}"],
        announce_maddrs=[f"/ip4/127.0.0.1/tcp/{args.announce_port}"],
        **LOOPBACK,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    thread = threading.Thread(target=server.run, name="petals-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + args.ready_timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        container = server.module_container
        if container is not None and container.ready.is_set():
            break
        time.sleep(0.1)
    else:
        print("petals-wan: server not ready in time", flush=True)
        server.shutdown()
        return 1
    maddrs = " ".join(str(a) for a in server.dht.get_visible_maddrs())
    print(f"{READY_PREFIX} peer_id={server.dht.peer_id} maddrs={maddrs}", flush=True)
    stop.wait()
    server.shutdown()
    thread.join(10)
    return 0


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
    import petals.client.routing.sequence_manager as sequence_manager
    import torch
    from petals import AutoDistributedModelForCausalLM

    torch.set_num_threads(1)

    class LoopbackDHT(sequence_manager.DHT):  # petals' client does not expose these options
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "host_maddrs": ["/ip4/127.0.0.1/tcp/0"], **LOOPBACK})

    sequence_manager.DHT = LoopbackDHT
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
    server = sub.add_parser("server")
    server.add_argument("--model", required=True)
    server.add_argument("--dht_prefix", required=True)
    server.add_argument("--block_indices", required=True)
    server.add_argument("--initial_peers", nargs="+", required=True)
    server.add_argument("--host_port", type=int, required=True)
    server.add_argument("--announce_port", type=int, required=True)
    server.add_argument("--cache_dir", default=None)
    server.add_argument("--ready_timeout_s", type=float, default=180.0)
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
    return run_server(args) if args.command == "server" else run_client(args)


if __name__ == "__main__":
    sys.exit(main())
