"""Runs stock Petals (2.2.0) from its own venv for tests/interop: `server` serves blocks with petals' Server
(`benchmarks.wan.petals_server.serve`, shared with `python -m benchmarks.wan`), `client` drives petals'
AutoDistributedModelForCausalLM and saves what it saw (torch.save) for the corolla-side test to check. Every DHT it
creates listens on 127.0.0.1 only, with relays, AutoNAT and NAT port mapping off. `server --lie_file PATH` makes the
stock server lie in its inference sessions as PATH says (`install_lie`: the interop tests' liar, never shipped)."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib.util
import os
import sys
import threading
import time
from pathlib import Path


def _load_petals_server():
    """corolla's shared stock-Petals server (`benchmarks/wan/petals_server.py`, which imports nothing of corolla:
    this interpreter has no corolla), loaded by its path."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "wan" / "petals_server.py"
    spec = importlib.util.spec_from_file_location("petals_server", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


petals_server = _load_petals_server()
READY_PREFIX = "petals-server: ready"


LIE_MODES = ("honest", "garbage")


def lie_mode(path: str) -> tuple[str, int]:
    """(mode, honest_steps) from `path` (`MODE [HONEST_STEPS]`; a missing file: honest)."""
    try:
        parts = Path(path).read_text().split() or ["honest"]
    except OSError:
        parts = ["honest"]
    if parts[0] not in LIE_MODES:
        raise ValueError(f"lie file {path}: mode must be one of {LIE_MODES}, got {parts[0]!r}")
    return parts[0], int(parts[1]) if len(parts) > 1 else 0


def install_lie(path: str) -> None:
    """Wraps petals' `iterate_rpc_inference` (the steps of one `rpc_inference` session, as its handler calls it) so
    that, while `path` reads `garbage N`, each session's steps after its first N are answered with finite noise of
    the true outputs' scale and shape (only a recomputation tells it from the truth). Installed before the server
    starts: its connection handlers are forked from this process and inherit the wrapper; `path` is read at every
    step, so a test switches the lie on and off without restarting the server."""
    import petals.server.handler as handler
    import torch
    from hivemind import deserialize_torch_tensor, serialize_torch_tensor

    original = handler.iterate_rpc_inference
    generator = torch.Generator().manual_seed(1234)

    async def iterate_rpc_inference(*args, **kwargs):
        step = 0
        async for output_tensors, can_push in original(*args, **kwargs):
            mode, honest_steps = lie_mode(path)
            if mode == "garbage" and step >= honest_steps:
                proto = output_tensors[0]
                true = deserialize_torch_tensor(proto)  # [B, T, H]
                noise = torch.randn(true.shape, generator=generator) * true.float().std().clamp_min(1e-3)
                output_tensors = [serialize_torch_tensor(noise.to(true.dtype), proto.compression), *output_tensors[1:]]
            step += 1
            yield output_tensors, can_push

    handler.iterate_rpc_inference = iterate_rpc_inference
    print(f"petals-server: lies as {path} says", file=sys.stderr, flush=True)


def prompt_tuning_results(args: argparse.Namespace, dht_prefix: str, input_ids) -> dict:
    """Petals' deep prompt tuning: a `tuning_mode="deep_ptune"` model whose prompts are set from `--ptune_init` (a
    torch.save'd dict with `prompt_embeddings` [P, H] and `intermediate_prompt_embeddings` [P, L * H]), its loss
    for labels = input_ids and the gradients of both prompt tables."""
    import torch
    from petals import AutoDistributedModelForCausalLM

    init = torch.load(args.ptune_init)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model,
        initial_peers=args.initial_peers,
        dht_prefix=dht_prefix,
        max_retries=6,  # a fresh client p2pd in dial backoff to a server (seen once in the suite's busiest first minute)
        daemon_startup_timeout=30,
        request_timeout=30,
        torch_dtype=torch.float32,
        tuning_mode="deep_ptune",
        pre_seq_len=init["prompt_embeddings"].shape[0],
    )
    params = {name.rsplit(".", 2)[-2]: p for name, p in model.named_parameters() if "prompt_embeddings" in name}
    with torch.no_grad():
        for name, value in init.items():
            params[name].copy_(value)
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    results = {"ptune_loss": loss.detach()}
    results.update({f"ptune_{name}_grad": params[name].grad for name in init})
    closer = threading.Thread(target=model.model.layers.sequence_manager.dht.shutdown, daemon=True)
    closer.start()
    closer.join(10)  # bounded, as run_client's own teardown
    return results


def prefix_results(args: argparse.Namespace, dht_prefix: str, cases: list[str]) -> dict:
    """Forward logits, greedy generation, a multi-step inference session, a backward pass and deep prompt tuning's
    gradients (those of `cases`) through the servers of `dht_prefix`."""
    import torch
    from petals import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model,
        initial_peers=args.initial_peers,
        dht_prefix=dht_prefix,
        max_retries=6,  # a fresh client p2pd in dial backoff to a server (seen once in the suite's busiest first minute)
        daemon_startup_timeout=30,
        request_timeout=30,
        torch_dtype=torch.float32,
    ).eval()
    input_ids = torch.tensor([args.input_ids])  # [1, T]
    results: dict[str, torch.Tensor] = {"input_ids": input_ids}
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
    # petals' client teardown (DHT shutdown) sometimes hangs after all RPCs have finished: bounded
    closer = threading.Thread(target=model.model.layers.sequence_manager.dht.shutdown, daemon=True)
    closer.start()
    closer.join(10)
    if "ptune" in cases:
        results.update(prompt_tuning_results(args, dht_prefix, input_ids))
    return results


def run_client(args: argparse.Namespace) -> int:
    """Each `--run PREFIX=CASES` in turn, in one interpreter (one start-up of torch and petals for them all); saves
    `{prefix: results}`."""
    dump_s = float(os.environ.get("PETALS_DRIVER_DUMP_S", "0") or 0)
    if dump_s > 0:  # a hang leaves every thread's stack in the log (the caller kills us soon after)
        faulthandler.dump_traceback_later(dump_s, exit=False)
    started = time.monotonic()
    # Collections only here, on the main thread, between runs: stock Petals' session objects close themselves in
    # `__del__` through hivemind's `run_coroutine`, which waits on hivemind's event-loop thread; a collection that an
    # allocation triggered on that very thread ran such a finalizer there and waited on itself for good (seen in the
    # suite: the second model's backward hung in `add_done_callback` -> `InferenceSession.__del__`, twice in a row, as
    # the allocation counts repeat)
    gc.disable()
    import torch

    torch.set_num_threads(1)
    petals_server.loopback_client_dht()
    print(f"petals-client: imported in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    results = {}
    for run in args.run:
        prefix, cases = run.split("=", 1)
        results[prefix] = prefix_results(args, prefix, cases.split(","))
        gc.collect()  # the run's sessions finalized here, on the main thread (above)
        print(f"petals-client: {prefix} done at {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    torch.save(results, args.out)
    print("petals-client: done", flush=True)
    # leave without the interpreter's own teardown (hivemind threads can hang it); the caller kills our process
    # group, reaping the DHT and p2pd children
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    server = petals_server.add_server_args(sub.add_parser("server"), inference_max_length=256, ready_timeout_s=90.0)
    server.add_argument("--lie_file", default=None, help="lie in inference sessions as this file says (install_lie)")
    client = sub.add_parser("client")
    client.add_argument("--model", required=True)
    client.add_argument("--initial_peers", nargs="+", required=True)
    client.add_argument("--input_ids", type=int, nargs="+", required=True)
    client.add_argument("--new_tokens", type=int, default=6)
    client.add_argument("--run", action="append", required=True, help="PREFIX=CASES, e.g. tiny=forward,ptune")
    client.add_argument("--ptune_init", default=None, help="prompts for the ptune case (torch.save'd dict)")
    client.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.command == "client":
        return run_client(args)
    if args.lie_file is not None:
        install_lie(args.lie_file)
    return petals_server.serve(args, READY_PREFIX)


if __name__ == "__main__":
    sys.exit(main())
