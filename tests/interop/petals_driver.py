"""Runs stock Petals (2.2.0) from its own venv for tests/interop: `server` serves blocks with petals' Server, `client`
drives petals' AutoDistributedModelForCausalLM and saves what it saw (torch.save) for the corolla-side test to check.
Every DHT it creates listens on 127.0.0.1 only, with relays, AutoNAT and NAT port mapping off."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

os.environ.setdefault("PETALS_IGNORE_DEPENDENCY_VERSION", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

LOOPBACK_DHT_KWARGS = dict(
    host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    use_relay=False,
    use_auto_relay=False,
    nat_port_map=False,
    auto_nat=False,
)
READY_PREFIX = "petals-server: ready"


def run_server(args: argparse.Namespace) -> int:
    """Serves `--block_indices` of `--model` with petals' own Server class until SIGTERM."""
    import torch
    from hivemind.proto.runtime_pb2 import CompressionType
    from petals.server.server import Server

    torch.set_num_threads(1)
    server = Server(
        initial_peers=args.initial_peers,
        dht_prefix=args.dht_prefix,
        converted_model_name_or_path=args.model,
        block_indices=args.block_indices,
        num_blocks=args.num_blocks,
        throughput=1.0,  # a float skips the speedtest (network) and the compute benchmark
        device="cpu",
        torch_dtype=args.torch_dtype,
        compression=getattr(CompressionType, args.compression),
        num_handlers=2,
        update_period=args.update_period,
        mean_block_selection_delay=0.2,
        inference_max_length=256,
        cache_dir=args.cache_dir,
        skip_reachability_check=True,
        reachable_via_relay=False,  # a full DHT peer; also skips the reachability probe
        use_relay=False,
        use_auto_relay=False,
        nat_port_map=False,
        auto_nat=False,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
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
        print("petals-server: not ready in time", flush=True)
        server.shutdown()
        return 1
    maddrs = " ".join(str(a) for a in server.dht.get_visible_maddrs())
    blocks = sorted(int(uid.rsplit(".", 1)[1]) for uid in server.module_container.module_backends)
    print(
        f"{READY_PREFIX} peer_id={server.dht.peer_id} blocks={blocks[0]}:{blocks[-1] + 1} initial_peers={maddrs}",
        flush=True,
    )
    stop.wait()
    server.shutdown()
    thread.join(10)
    return 0


def run_client(args: argparse.Namespace) -> int:
    """Forward logits, greedy generation, a multi-step inference session and a backward pass through the swarm."""
    import petals.client.routing.sequence_manager as sequence_manager
    import torch
    from petals import AutoDistributedModelForCausalLM

    torch.set_num_threads(1)

    # keep petals' client DHT on loopback with no relay/NAT traffic (petals' client does not expose these options)
    class LoopbackDHT(sequence_manager.DHT):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**LOOPBACK_DHT_KWARGS, **kwargs})

    sequence_manager.DHT = LoopbackDHT
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model,
        initial_peers=args.initial_peers,
        dht_prefix=args.dht_prefix,
        max_retries=3,
        daemon_startup_timeout=30,
        request_timeout=30,
        torch_dtype=torch.float32,
    ).eval()
    input_ids = torch.tensor([args.input_ids])  # [1, T]
    results: dict[str, torch.Tensor] = {"input_ids": input_ids}
    cases = args.cases.split(",")
    with torch.no_grad():
        if "forward" in cases:
            results["logits"] = model(input_ids).logits  # [1, T, V]
        if "generate" in cases:
            results["generated"] = model.generate(input_ids, max_new_tokens=args.new_tokens, do_sample=False)
        if "session" in cases:
            split = max(1, input_ids.shape[1] - 3)
            with model.inference_session(max_length=input_ids.shape[1] + 4):
                steps = [model(input_ids[:, :split]).logits]
                steps += [model(input_ids[:, i : i + 1]).logits for i in range(split, input_ids.shape[1])]
            results["session_logits"] = torch.cat(steps, dim=1)  # [1, T, V]
    if "backward" in cases:
        embeds = model.get_input_embeddings()(input_ids).detach().requires_grad_(True)  # [1, T, H]
        weights = torch.linspace(-1.0, 1.0, model.config.vocab_size)  # [V]
        loss = (model(inputs_embeds=embeds).logits * weights).sum()
        loss.backward()
        results["loss"] = loss.detach()
        results["embeds_grad"] = embeds.grad
    torch.save(results, args.out)
    print("petals-client: done", flush=True)
    # petals' client teardown (DHT shutdown, interpreter exit with hivemind threads) sometimes hangs after all RPCs
    # have finished; bound it, then leave (the caller kills our process group, reaping the DHT and p2pd children)
    closer = threading.Thread(target=model.model.layers.sequence_manager.dht.shutdown, daemon=True)
    closer.start()
    closer.join(10)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    server = sub.add_parser("server")
    server.add_argument("--model", required=True)
    server.add_argument("--dht_prefix", required=True)
    where = server.add_mutually_exclusive_group(required=True)
    where.add_argument("--block_indices")
    where.add_argument("--num_blocks", type=int)
    server.add_argument("--initial_peers", nargs="*", default=[])
    server.add_argument("--cache_dir", default=None)
    server.add_argument("--torch_dtype", default="float32")
    server.add_argument("--compression", default="NONE")
    server.add_argument("--update_period", type=float, default=5.0)
    server.add_argument("--ready_timeout_s", type=float, default=90.0)
    client = sub.add_parser("client")
    client.add_argument("--model", required=True)
    client.add_argument("--dht_prefix", required=True)
    client.add_argument("--initial_peers", nargs="+", required=True)
    client.add_argument("--input_ids", type=int, nargs="+", required=True)
    client.add_argument("--new_tokens", type=int, default=6)
    client.add_argument("--cases", default="forward,generate,session,backward")
    client.add_argument("--out", required=True)
    args = parser.parse_args()
    return run_server(args) if args.command == "server" else run_client(args)


if __name__ == "__main__":
    sys.exit(main())
