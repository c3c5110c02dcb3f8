"""The client's host CPU per decode step, through the real transport, without a GPU (issue 31: on the card's 64
sessions the client processes spent 591-659 us of CPU a step, more than the server's loop): `python -m
benchmarks.users.client_cpu`.

The server side runs in this process as the many-users bench's (`users.server.BenchServer`: hivemind P2P on
loopback, the `rpc_inference` handler, the same-host socket, the core) over the simulated device of
`users.device_cpu` (one Llama-3-8B-wide layer whose decode forward is a timed no-op, `--forward_ms` each), so a
reply is a real server's reply (bf16 [1, 1, 4096]) at a card's pace and costs this machine little.

The client is one spawned process as one of the users bench's client processes (`users.clients.CorollaStream`):
`--sessions` sessions of corolla's client over `--transport` (the same-host socket, or p2p through a p2pd of its
own), each prefilled on the loop, then decoding `--steps` tokens in its own thread (`SpanSession.step_here`: build
the request, send, wait in poll(2), parse and check the reply, record the history). Timed over the decode phase:
the stepping threads' own CPU clocks (`time.thread_time`) summed per step (the client's CPU a step, what the card's
client processes spend beside their loop and p2pd), the whole process's CPU per step, and the wall per step;
`--repeats` runs after one untimed warm-up, each a fresh server and client process, medians over runs.
`--split`: one more run whose stepping threads' CPU is split by function (each timed with the thread's CPU clock,
inclusive of what it calls, ~1 us a call: reported apart). Compare two trees by running this file from each
(`PYTHONPATH=<tree>/src`), alternated."""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import importlib
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks.common.measure import cpu_timed
from benchmarks.field.verify_cost import standin_backend
from benchmarks.users.device_cpu import SPEC, simulated_engine
from benchmarks.users.server import BenchServer
from corolla.protocol import local_stream as ls
from corolla.server.core.engine_executor import EngineExecutor
from corolla.server.core.runtime import Runtime

# (module, owner attribute or "", function): timed by `--split` in the client process, where the tree has them
SPLIT_FUNCTIONS = (
    ("benchmarks.users.clients", "CorollaStream", "step_sync"),
    ("benchmarks.users.clients", "CorollaStream", "_step_args"),
    ("corolla.client.session.span_session", "SpanSession", "step_here"),
    ("corolla.client.session.span_session", "SpanSession", "build_request"),
    ("corolla.client.session.span_session", "SpanSession", "build_payload"),
    ("corolla.client.session.span_session", "SpanSession", "_request_parts"),
    ("corolla.client.session.span_session", "SpanSession", "can_step_here"),
    ("corolla.client.session.forwarding", "StepForwarding", "take_step_id"),
    ("corolla.client.session.forwarding", "StepForwarding", "request_extra"),
    ("corolla.client.routing.sequence_manager", "RemoteSequenceManager", "request_metadata"),
    ("corolla.client.session.stalls", "StepClock", "deadline_s"),
    ("corolla.client.session.stalls", "StepClock", "late_left_s"),
    ("corolla.client.session.span_session", "", "step_payload"),
    ("corolla.client.session.span_session", "", "serialize_activations"),
    ("corolla.client.session.span_session", "", "encode_metadata"),
    ("corolla.client.session.span_session", "SpanSession", "accept_reply"),
    ("corolla.client.session.span_session", "", "deserialize_tensor"),
    ("corolla.client.session.span_session", "", "check_outputs"),
    ("corolla.client.session.span_session", "", "read_output"),
    ("corolla.client.session.span_session", "", "reply_flags"),
    ("corolla.client.session.span_session", "SpanSession", "_record"),
    ("corolla.client.session.span_session", "SpanSession", "time_step"),
    ("corolla.client.transport.framed_socket", "FramedSocketStream", "exchange"),
    ("corolla.client.transport.framed_socket", "FramedSocketStream", "_parse_frame"),
    ("corolla.client.transport.p2p_stream", "P2PInferenceStream", "_request_frame"),
    ("corolla.client.transport.p2p_stream", "P2PInferenceStream", "_response"),
    ("corolla.client.transport.local_transport", "LocalInferenceStream", "_request_frame"),
    ("corolla.client.transport.local_transport", "LocalInferenceStream", "_response"),
)
NUM_LAYERS = 1  # the simulated span's blocks (the wire does not depend on it)


class Split:
    """`--split`'s timers: each stepping thread's CPU nanoseconds by function (inclusive), summed at the end."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._all: list[collections.Counter[str]] = []
        self._lock = threading.Lock()
        for module_name, owner_name, name in SPLIT_FUNCTIONS:
            with contextlib.suppress(ModuleNotFoundError):
                module = importlib.import_module(module_name)
                owner: Any = getattr(module, owner_name, None) if owner_name else module
                if owner is not None and name in vars(owner):
                    label = f"{owner_name or module_name}.{name}"
                    setattr(owner, name, cpu_timed(vars(owner)[name], label, self._counter, lambda: self.on))

    def _counter(self) -> collections.Counter[str]:
        counter = getattr(self._local, "counter", None)
        if counter is None:
            counter = self._local.counter = collections.Counter()
            with self._lock:
                self._all.append(counter)
        return counter

    on = False

    def report(self, steps: int) -> dict[str, float]:
        total: collections.Counter[str] = collections.Counter()
        for counter in self._all:
            total.update(counter)
        return {k: round(v / steps / 1e3, 2) for k, v in total.most_common()}


def client_main(args: dict, maddrs: list[str], peer_id: str, results: multiprocessing.Queue) -> None:
    """The spawned client process (the module docstring): its figures, or an error, to `results`."""
    try:
        results.put(asyncio.run(_client(args, maddrs, peer_id)))
    except BaseException as e:
        results.put({"error": repr(e)[:500]})


async def _client(args: dict, maddrs: list[str], peer_id: str) -> dict:
    from hivemind.p2p import P2P

    from benchmarks.users.clients import CorollaStream
    from benchmarks.users.server import DHT_PREFIX

    split = Split() if args["split"] else None
    sessions, steps, prompt = args["sessions"], args["steps"], args["prompt"]
    torch.manual_seed(0)
    prefix = torch.randn(1, prompt, SPEC.hidden_size).to(torch.bfloat16)
    tokens = [torch.randn(1, 1, SPEC.hidden_size).to(torch.bfloat16) for _ in range(8)]
    p2p = await P2P.create(
        initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False,
        use_relay=False, use_auto_relay=False,
    )  # fmt: skip
    try:
        streams = [
            await CorollaStream(
                p2p, peer_id, NUM_LAYERS, prompt + steps + 8, args["transport"], DHT_PREFIX, 60.0
            ).open()
            for _ in range(sessions)
        ]
        for stream in streams:
            await stream.step(prefix, 0)
        cpu_s = [0.0] * sessions
        barrier = threading.Barrier(sessions + 1)

        def decode(i: int) -> None:
            stream = streams[i]
            barrier.wait()
            began = time.thread_time()
            for step in range(steps):
                out = stream.step_sync(tokens[step % len(tokens)], prompt + step)
                if out.shape != (1, 1, SPEC.hidden_size):
                    raise ValueError(f"a reply of shape {tuple(out.shape)}")
            cpu_s[i] = time.thread_time() - began

        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(max_workers=sessions) as threads:
            running = [loop.run_in_executor(threads, decode, i) for i in range(sessions)]
            await asyncio.to_thread(barrier.wait)
            if split is not None:
                split.on = True
            wall0, process0 = time.perf_counter(), time.process_time()
            await asyncio.gather(*running)
            wall1, process1 = time.perf_counter(), time.process_time()
            if split is not None:
                split.on = False
        for stream in streams:
            await stream.close()
    finally:
        await p2p.shutdown()
    total = sessions * steps
    result = {
        "client_us_per_step": 1e6 * sum(cpu_s) / total,
        "process_us_per_step": 1e6 * (process1 - process0) / total,
        "wall_ms_per_step": 1e3 * (wall1 - wall0) / steps,
    }
    if split is not None:
        result["split_us_per_step"] = split.report(total)
    return result


def run_once(args: argparse.Namespace, split: bool) -> dict:
    """One fresh server side and client process; the decode phase's figures."""
    engine = simulated_engine(args.sessions, args.prompt + args.steps + 9, args.forward_ms / 1e3)
    backend = standin_backend(SPEC, NUM_LAYERS, torch.device("cpu"))
    stream = engine.graphs.stream  # type: ignore[union-attr]
    with (
        tempfile.TemporaryDirectory(prefix="client-cpu-") as directory,
        mock.patch.dict(os.environ, {ls.SOCKET_DIR_ENV: directory}),
        mock.patch.object(torch.cuda, "current_stream", lambda device=None: stream),  # (as device_cpu)
    ):
        os.chmod(directory, 0o700)
        executor = EngineExecutor(backend, engine, Runtime(max_batch_size_tokens=4096, device="cpu"))  # type: ignore[arg-type]
        server = BenchServer(
            executor, hidden_size=SPEC.hidden_size, num_layers=NUM_LAYERS, dtype=torch.bfloat16,
            device=torch.device("cpu"),
        )  # fmt: skip
        with server.running():
            context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited loop or daemon
            results = context.Queue()
            job = {"sessions": args.sessions, "steps": args.steps, "prompt": args.prompt,
                   "transport": args.transport, "split": split}  # fmt: skip
            process = context.Process(target=client_main, args=(job, server.maddrs, server.peer_id_b58, results))
            process.start()
            try:
                result = results.get(timeout=300)
            finally:
                process.join(30)
    if "error" in result:
        raise RuntimeError(f"the client process failed: {result['error']}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=8, help="sessions of the client process (the card's: 8)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--forward_ms", type=float, default=4.0, help="the simulated device's time per forward")
    p.add_argument("--transport", choices=("socket", "p2p"), default="p2p")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--split", action="store_true", help="one more run, its client CPU split by function")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    run_once(args, split=False)  # warm-up
    runs = [run_once(args, split=False) for _ in range(args.repeats)]
    keys = ("client_us_per_step", "process_us_per_step", "wall_ms_per_step")
    result: dict = {
        "transport": args.transport, "sessions": args.sessions, "steps": args.steps, "forward_ms": args.forward_ms,
        **{k: round(statistics.median(r[k] for r in runs), 2) for k in keys},
        "runs": {k: [round(r[k], 2) for r in runs] for k in keys},
    }  # fmt: skip
    if args.split:
        run = run_once(args, split=True)
        result["split"] = {"client_us_per_step": round(run["client_us_per_step"], 2), **run["split_us_per_step"]}
    print(json.dumps(result), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"client_cpu_{args.transport}.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
