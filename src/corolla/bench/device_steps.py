"""The device process's CPU per decode step, alone: real `DeviceChannel`s, the real runtime and fast executor, fed
by scripted handler processes that speak the channel's frames (`proxy_wire`) over socketpairs and do nothing else.

Each scripted handler holds `sessions / channels` sessions (OPEN, one prefill step), then steps all of them once per
round in one STEP_BATCH frame and waits for all their replies (REPLY_BATCH or single replies) before the next round,
as a handler process whose clients answer at once would. The device side's threads are timed by their own CPU
clocks over the decode rounds only: the runtime thread (with the model's forward timed apart, since on the CPU it is
the tiny model's compute that a GPU would run as a graph replay) and the channels' intake thread. Without p2p
daemons, clients and handler processes on the same cores, the figures are far steadier than the `multi_user`
bench's on a small shared machine: they are for before/after pairs of device-side changes.

Run: `python -m corolla.bench.device_steps --sessions 64 --channels 4 --rounds 200` (loopback-only is not needed:
nothing leaves the process but socketpairs, yet it is harmless)."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from corolla.server import proxy_wire as wire
from corolla.utils.logging import get_logger

if TYPE_CHECKING:
    from corolla.server.fast_executor import FastExecutor

logger = get_logger(__name__)

MAX_FRAME_BYTES = 64 << 20


@dataclass(frozen=True)
class DeviceStepsConfig:
    sessions: int = 64
    channels: int = 4
    rounds: int = 200
    prefix_tokens: int = 16
    hidden_size: int = 64
    num_layers: int = 2
    cache_mib: int = 64  # the engine's KV pool
    timeout_s: float = 300.0


@dataclass
class DeviceStepsResult:
    config: DeviceStepsConfig
    steps: int
    wall_s: float
    runtime_us_per_step: float  # the runtime thread's CPU, the forward included
    forward_us_per_step: float  # of which the model's forward (FastLlamaSpan.decode) on this thread
    channel_us_per_step: float  # the channels' intake thread (and any writer threads)
    steps_per_merged_forward: float


def _handler(sock: socket.socket, num_sessions: int, cfg: DeviceStepsConfig, barrier: mp.synchronize.Barrier) -> None:
    """A scripted handler process: opens its sessions, prefills them, then steps them in rounds (module docstring)."""
    torch.set_num_threads(1)
    io_ = _Frames(sock)
    io_.expect_until({wire.HELLO})
    handles = []
    for request_id in range(1, num_sessions + 1):
        body = wire.Writer().u32(0).u32(cfg.num_layers).u32(1).u32(cfg.prefix_tokens + cfg.rounds + 1)
        body.f64(5.0).u8(0).text("").text("")
        io_.send(body.frame(wire.OPEN, request_id))
        fields = io_.expect_until({wire.REPLY_OPEN})
        fields.u64(), fields.u64(), fields.u64()  # the device's state
        handles.append(fields.u32())
    generator = torch.Generator().manual_seed(len(handles))
    prefix = torch.randn(1, cfg.prefix_tokens, cfg.hidden_size, generator=generator)  # [1, T, H]
    token = torch.randn(1, 1, cfg.hidden_size, generator=generator)  # [1, 1, H]
    io_.round(handles, prefix, 0)
    barrier.wait(cfg.timeout_s)  # every session prefilled
    barrier.wait(cfg.timeout_s)  # the device side has sampled its clocks: the decode window starts
    for step in range(cfg.rounds):
        io_.round(handles, token, cfg.prefix_tokens + step)
    barrier.wait(cfg.timeout_s)
    sock.close()


class _Frames:
    """The scripted handler's blocking frame I/O."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.file = sock.makefile("rb")

    def send(self, frame: bytes) -> None:
        self.sock.sendall(frame)

    def recv(self) -> tuple[int, int, bytes]:
        header = self.file.read(wire.HEADER_BYTES)
        if len(header) < wire.HEADER_BYTES:
            raise wire.ChannelClosed("device closed the channel")
        length, kind, request_id = wire.HEADER.unpack(header)
        return kind, request_id, self.file.read(length)

    def expect_until(self, kinds: set[int]) -> wire.Reader:
        while True:
            kind, _, payload = self.recv()
            if kind == wire.REPLY_ERROR:
                raise RuntimeError(f"device refused: {payload!r}")
            if kind in kinds:
                return wire.Reader(payload)

    def round(self, handles: list[int], hidden: torch.Tensor, position: int) -> None:
        """One STEP_BATCH of every session's step, then every reply."""
        items = []
        for i, handle in enumerate(handles):
            body = wire.Writer().u32(handle).u32(position).u8(0).text("").tensor(hidden).tensor(None).tensor(None)
            items.append((wire.STEP, i + 1, body))
        self.send(wire.batch(items).frame(wire.STEP_BATCH, 0))
        waiting = set(range(1, len(handles) + 1))
        while waiting:
            kind, request_id, payload = self.recv()
            if kind == wire.REPLY_BATCH:
                fields = wire.Reader(payload)
                fields.u64(), fields.u64(), fields.u64()
                replies = [(k, rid) for k, rid, _ in wire.split_batch(fields, wire.REPLY_BATCH)]
            elif kind in (wire.REPLY_TENSORS, wire.REPLY_ERROR):
                replies = [(kind, request_id)]
            else:
                continue
            for k, rid in replies:
                if k == wire.REPLY_ERROR:
                    raise RuntimeError(f"device refused step {rid}")
                waiting.discard(rid)


class ForwardClock:
    """While entered, `FastLlamaSpan.decode` (the model's forward) adds each call's thread CPU time to `seconds`:
    only calls on the thread `ident` once it is set, any thread's while it is None. The benches of the device
    process's per-step work time the forward apart, since on the CPU it is the tiny model's compute that a GPU
    would run as a graph replay."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.ident: int | None = None
        self._decode: Callable[..., torch.Tensor] | None = None

    def __enter__(self) -> ForwardClock:
        from corolla.engine.fast_llama import FastLlamaSpan

        decode = self._decode = FastLlamaSpan.decode
        clock = self

        def timed_decode(span: FastLlamaSpan, *args: object, **kwargs: object) -> torch.Tensor:
            started = time.thread_time()
            try:
                return decode(span, *args, **kwargs)  # type: ignore[arg-type]
            finally:
                if clock.ident is None or threading.get_ident() == clock.ident:
                    clock.seconds += time.thread_time() - started

        FastLlamaSpan.decode = timed_decode  # type: ignore[assignment,method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from corolla.engine.fast_llama import FastLlamaSpan

        FastLlamaSpan.decode = self._decode  # type: ignore[assignment,method-assign]


def tiny_fast_executor(hidden_size: int, num_layers: int, cache_mib: int) -> FastExecutor:
    """The fast executor of a tiny random float32 Llama span on the CPU (4 heads, 2 KV heads, MLP 2 x hidden),
    one torch thread: the device side the per-step benches drive."""
    from corolla.bench.model import ModelShape
    from corolla.bench.multi_user import build_executor
    from corolla.server.fast_executor import FastExecutor

    torch.set_num_threads(1)
    shape = ModelShape(hidden_size=hidden_size, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                       intermediate_size=2 * hidden_size)  # fmt: skip
    executor = build_executor(shape, torch.float32, torch.device("cpu"), num_layers=num_layers,
                              serving_path="fast", cache_bytes=cache_mib << 20)  # fmt: skip
    if not isinstance(executor, FastExecutor):
        raise TypeError("the per-step benches measure the fast executor")
    return executor


def run(cfg: DeviceStepsConfig) -> DeviceStepsResult:
    from corolla.server.admission import SessionAdmission
    from corolla.server.channel_intake import ChannelIntake
    from corolla.server.device_channel import DeviceChannel, DeviceSessionRegistry, PushRouter
    from corolla.server.fast_executor import KIND_ENGINE_INFERENCE
    from corolla.server.limits import PeerLimits

    executor = tiny_fast_executor(cfg.hidden_size, cfg.num_layers, cfg.cache_mib)
    clock = ForwardClock()
    clock.ident = -1  # no thread's forward counts until the runtime thread is known
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(cfg.channels + 1)
    pairs = [socket.socketpair() for _ in range(cfg.channels)]
    split = [cfg.sessions // cfg.channels + (i < cfg.sessions % cfg.channels) for i in range(cfg.channels)]
    handlers = [ctx.Process(target=_handler, args=(pairs[i][1], split[i], cfg, barrier), daemon=True)
                for i in range(cfg.channels)]  # fmt: skip
    for process in handlers:  # forked before any thread of this process starts
        process.start()
    for _, handler_end in pairs:
        handler_end.close()
    clock.__enter__()
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, name="device-steps-loop", daemon=True)
    runtime = executor.runtime
    intake = ChannelIntake()  # one reader of every channel, as the server's handler pool has
    try:
        with runtime, intake:
            clock.ident = runtime.thread.ident if runtime.thread is not None else -1
            loop_thread.start()
            admission = SessionAdmission(PeerLimits(), executor)
            router = PushRouter(DeviceSessionRegistry())
            channels = [
                DeviceChannel(i, pairs[i][0], executor=executor, admission=admission, router=router,
                              span=tuple(range(cfg.num_layers)), max_frame_bytes=MAX_FRAME_BYTES, intake=intake)
                for i in range(cfg.channels)
            ]  # fmt: skip
            serving = [asyncio.run_coroutine_threadsafe(c.serve(), loop) for c in channels]
            barrier.wait(cfg.timeout_s)  # every session opened and prefilled
            before = _sample(runtime.thread), clock.seconds, runtime.stats().get(KIND_ENGINE_INFERENCE)
            barrier.wait(cfg.timeout_s)  # sampled: the handlers start their decode rounds only now
            started = time.monotonic()
            barrier.wait(cfg.timeout_s)  # every decode round answered
            wall_s = time.monotonic() - started
            after = _sample(runtime.thread), clock.seconds, runtime.stats().get(KIND_ENGINE_INFERENCE)
            for future in serving:
                future.result(cfg.timeout_s)
    finally:
        clock.__exit__()
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(10)
        for process in handlers:
            process.join(10)
    steps = cfg.sessions * cfg.rounds
    merged = after[2].since(before[2]) if after[2] is not None and before[2] is not None else None
    return DeviceStepsResult(
        config=cfg,
        steps=steps,
        wall_s=wall_s,
        runtime_us_per_step=(after[0][0] - before[0][0]) / steps * 1e6,
        forward_us_per_step=(after[1] - before[1]) / steps * 1e6,
        channel_us_per_step=(after[0][1] - before[0][1]) / steps * 1e6,
        steps_per_merged_forward=merged.tasks_per_batch if merged is not None else 0.0,
    )


def _sample(runtime_thread: threading.Thread | None) -> tuple[float, float]:
    """(runtime thread CPU s, the channel intake (and writer) threads' CPU s): their own clocks."""

    def cpu(thread: threading.Thread) -> float:
        if thread.ident is None or not thread.is_alive():
            return 0.0
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))

    channels = sum(cpu(t) for t in threading.enumerate() if t.name.startswith("corolla-channel-"))
    return (cpu(runtime_thread) if runtime_thread is not None else 0.0), channels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in asdict(DeviceStepsConfig()).items():
        parser.add_argument(f"--{name}", type=type(default), default=default)
    cfg = DeviceStepsConfig(**vars(parser.parse_args(argv)))
    result = run(cfg)
    print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in asdict(result).items()
                      if k != "config"}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
