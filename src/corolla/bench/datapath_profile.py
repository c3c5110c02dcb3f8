"""Where a decode step's time goes on the RPC data path: one local server (hivemind P2P on loopback, our handler,
runtime and fast path) and one client stream in this process, with `perf_counter_ns` markers at each hand-off.
`python -m corolla.bench.datapath_profile [--cuda] [--hidden_size N] [--layers N] [--steps N]`."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections import defaultdict
from typing import Any

import torch

from corolla.bench.measure import median
from corolla.bench.model import ModelShape, build_hf_model

_P2P_FLAGS = dict(nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
_LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]

# marker order along one step; each interval is reported as the median over steps
MARKERS = (
    "client_start",  # client: before packing / serializing
    "client_sent",  # client: request queued to the stream
    "server_received",  # server: the request came out of the p2p stream
    "handler_step",  # server: _inference_step entered (metadata decoded, step de-duplicated)
    "validated",  # server: request decoded and validated, step coroutine created
    "step_started",  # server: the step coroutine started running
    "submitted",  # server: request decoded and validated, runtime.submit called
    "runtime_start",  # runtime thread: the batch executor starts
    "runtime_end",  # runtime thread: results ready on the host
    "resolved",  # server loop: the step's future resolved
    "handler_done",  # server: output serialized, response about to be yielded
    "client_received",  # client: response message came out of the stream
    "client_done",  # client: output tensor decoded
)


class _Marks:
    def __init__(self) -> None:
        self.current: dict[str, int] = {}
        self.steps: list[dict[str, int]] = []

    def mark(self, name: str) -> None:
        self.current.setdefault(name, time.perf_counter_ns())

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.current = {}


def _instrument(marks: _Marks, fast_backend: Any) -> None:
    """Wraps the hand-off points of the handler, runtime and fast path (this process only)."""
    from corolla.server import handler as handler_module
    from corolla.server import runtime as runtime_module
    from corolla.server.fast_executor import KIND_ENGINE_INFERENCE

    executor = fast_backend._execute_tasks

    def timed_executor(tasks):
        marks.mark("runtime_start")
        out = executor(tasks)
        marks.mark("runtime_end")
        return out

    fast_backend.runtime.register_batch_executor(KIND_ENGINE_INFERENCE, timed_executor, inline_when_idle=True)

    cls = handler_module.TransformerConnectionHandler
    original_step = cls._inference_step

    async def inference_step(self, *args, **kwargs):
        marks.mark("handler_step")
        out = await original_step(self, *args, **kwargs)
        marks.mark("handler_done")
        return out

    cls._inference_step = inference_step
    original_iterate = handler_module.iterate_steps

    async def iterate_steps(first, requests, *args, **kwargs):
        async def stamped():
            async for request in requests:
                marks.mark("server_received")
                yield request

        async for item in original_iterate(first, stamped(), *args, **kwargs):
            yield item

    handler_module.iterate_steps = iterate_steps

    from corolla.server import block_functions as bf_module

    original_run_step = bf_module.run_inference_step

    def run_inference_step(*args, **kwargs):
        marks.mark("validated")

        async def started():
            marks.mark("step_started")
            return await original_run_step(*args, **kwargs)

        return started()

    bf_module.run_inference_step = run_inference_step
    original_submit = runtime_module.Runtime.submit

    def submit(self, *args, **kwargs):
        marks.mark("submitted")
        future = original_submit(self, *args, **kwargs)
        future.add_done_callback(lambda _f: marks.mark("resolved"))
        return future

    runtime_module.Runtime.submit = submit


def run(args: argparse.Namespace) -> dict:
    from hivemind.p2p import P2P
    from hivemind.proto import runtime_pb2

    from corolla.bench.rpc_bench import build_blocks
    from corolla.protocol.codecs import deserialize_tensor, serialize_tensor
    from corolla.protocol.metadata import encode_metadata
    from corolla.protocol.packing import pack_args_kwargs
    from corolla.protocol.rpc import get_stub
    from corolla.protocol.uids import make_chain
    from corolla.server.backend import SpanBackend
    from corolla.server.block_functions import ServingLimits
    from corolla.server.fast_executor import build_fast_executor
    from corolla.server.runtime import Runtime
    from corolla.server.server import SpanService
    from corolla.server.sessions import SessionTimeouts

    device = torch.device("cuda", torch.cuda.current_device()) if args.cuda else torch.device("cpu")
    dtype = torch.bfloat16
    shape = ModelShape(
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=max(1, args.hidden_size // 64),
        num_kv_heads=max(1, args.hidden_size // 256),
        intermediate_size=args.hidden_size * 2,
    )
    model = build_hf_model(shape, dtype, device)
    blocks = build_blocks(model, shape, dtype, device, args.layers)
    backend = SpanBackend(blocks, config=shape.hf_config(), dtype=dtype, device=device)
    runtime = Runtime(max_batch_size_tokens=8192, device=device)
    fast_backend = build_fast_executor(
        backend, runtime, kv_pool_bytes=64 << 20, max_seq_len_tokens=1024, max_batch_rows=8, warmup=False
    )
    marks = _Marks()
    _instrument(marks, fast_backend)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="profile-server-loop", daemon=True)
    thread.start()

    def on_server(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    limits = ServingLimits("prof", 0, args.layers, shape.hidden_size, dtype, 1024, 8192)
    timeouts = SessionTimeouts(step_timeout_s=60, session_timeout_s=600, request_timeout_s=60)
    server_p2p = on_server(P2P.create(host_maddrs=_LOOPBACK, **_P2P_FLAGS))
    service = SpanService(executor=fast_backend, limits=limits, timeouts=timeouts)
    on_server(service.start(server_p2p))
    awake = threading.Event()
    if args.keep_awake:  # a callback always ready: the loop never sleeps in epoll, so no wake-up latency

        async def spin() -> None:
            while not awake.is_set():
                await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(spin(), loop)
    maddrs = [str(m) for m in on_server(server_p2p.get_visible_maddrs())]

    async def client() -> dict:
        p2p = await P2P.create(initial_peers=maddrs, host_maddrs=_LOOPBACK, **_P2P_FLAGS)
        try:
            stub = get_stub(p2p, server_p2p.peer_id)
            queue: asyncio.Queue = asyncio.Queue()

            async def requests():
                while (item := await queue.get()) is not None:
                    yield item

            responses = (await stub.rpc_inference(requests())).__aiter__()
            h = shape.hidden_size
            empty_prompts, empty_hypo = torch.empty(0), torch.empty(0, dtype=torch.int64)

            async def step(hidden: torch.Tensor, position: int, first: bool = False) -> torch.Tensor:
                marks.mark("client_start")
                tensors, structure = pack_args_kwargs(hidden, empty_prompts, empty_hypo)
                meta = {"session_id": "prof", "step_id": f"s{len(marks.steps)}", "start_from_position": position}
                meta["args_structure"] = structure
                if first:
                    meta["max_length"] = 1024
                request = runtime_pb2.ExpertRequest(
                    uid=make_chain("prof", 0, args.layers),
                    tensors=[serialize_tensor(t) for t in tensors],
                    metadata=encode_metadata(meta),
                )
                await queue.put(request)
                marks.mark("client_sent")
                response = await responses.__anext__()
                marks.mark("client_received")
                out = deserialize_tensor(response.tensors[0])
                marks.mark("client_done")
                marks.end_step()
                return out

            await step(torch.randn(1, 16, h).to(dtype), 0, first=True)
            position = 16
            for _ in range(args.steps):
                await step(torch.randn(1, 1, h).to(dtype), position)
                position += 1
            decode_steps = marks.steps[10:]
            empty = torch.empty(1, 0, h, dtype=dtype)
            for _ in range(args.steps):
                await step(empty, position)
            empty_steps = marks.steps[-args.steps + 5 :]
            idle_s = median([(m["client_done"] - m["client_start"]) / 1e9 for m in decode_steps])
            for _ in range(args.steps):  # as above after an idle wait as long as a real step: threads go to sleep
                await asyncio.sleep(idle_s)
                await step(empty, position)
            idle_steps = marks.steps[-args.steps + 5 :]
            await queue.put(None)
            return {"decode": decode_steps, "empty": empty_steps, "empty_after_idle": idle_steps}
        finally:
            await p2p.shutdown()

    try:
        raw = asyncio.run(client())
    finally:
        awake.set()
        on_server(service.stop())
        on_server(server_p2p.shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    return summarize(raw)


def summarize(raw: dict) -> dict:
    out: dict[str, Any] = {}
    for kind, steps in raw.items():
        intervals: dict[str, list[float]] = defaultdict(list)
        totals = []
        for marks in steps:
            present = [m for m in MARKERS if m in marks]
            for a, b in zip(present, present[1:], strict=False):
                intervals[f"{a} -> {b}"].append((marks[b] - marks[a]) / 1e3)
            totals.append((marks["client_done"] - marks["client_start"]) / 1e3)
        out[kind] = {"total_us": median(totals), **{k: round(median(v), 1) for k, v in intervals.items()}}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--keep_awake", action="store_true", help="keep the server loop busy (tests wake-up latency)")
    args = p.parse_args(argv)
    result = run(args)  # not under inference_mode: the engine's pinned buffers are written from the runtime thread
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
