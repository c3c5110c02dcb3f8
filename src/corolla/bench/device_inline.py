"""The device process's CPU per decode step without threads or sockets: the same work as `bench.device_steps` (real
`FrameIntake`s of the fast executor, the runtime's pop / execute / complete, reply frames encoded) driven in ONE
thread, so that no GIL hand-off, no other thread and no handler process shares the measured clock. Each round
builds every channel's STEP_BATCH frame beforehand; the timed part hands each frame to its intake (parse, checks,
one task per frame), then runs the runtime's batches as its device thread would (`TaskQueue.pop_batch`,
`Runtime._execute`, `Runtime._complete`: replies queued and encoded by `step_frames.reply_frames`, not sent). The
model's forward (`FastLlamaSpan.decode`) is timed apart and left out; the figure is the best of `repeats` runs (the
least disturbed by other work on a shared machine), for before/after pairs of device-side changes.

Run: `python -m corolla.bench.device_inline --sessions 64 --rounds 60`; against another tree's code, run this file
by path with that tree first on PYTHONPATH (a tree whose `bench.device_steps` has `ForwardClock` and
`tiny_fast_executor`, which both benches share)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from corolla.server import proxy_wire as wire
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class DeviceInlineConfig:
    sessions: int = 64
    channels: int = 4
    rounds: int = 60
    repeats: int = 5
    prefix_tokens: int = 16
    hidden_size: int = 64
    num_layers: int = 2
    cache_mib: int = 256  # the engine's KV pool


@dataclass
class DeviceInlineResult:
    config: DeviceInlineConfig
    steps: int  # per repeat
    non_forward_us_per_step: float  # best repeat: everything but the model's forward
    forward_us_per_step: float  # that repeat's forward


def run(cfg: DeviceInlineConfig) -> DeviceInlineResult:
    from corolla.bench.device_steps import ForwardClock, tiny_fast_executor
    from corolla.server import step_frames
    from corolla.server.admission import SessionAdmission, SessionTicket
    from corolla.server.executor import SessionCache, SessionSpec
    from corolla.server.fast_executor import FastSessionCache
    from corolla.server.frame_steps import FrameIntake, StepReply
    from corolla.server.limits import PeerLimits

    h = cfg.hidden_size
    executor = tiny_fast_executor(h, cfg.num_layers, cfg.cache_mib)
    runtime, engine = executor.runtime, executor.engine

    head = bytes(24)  # the device's state in every reply (three u64)

    class _Channel:
        """What a device channel gives its intake: sessions by handle, an outbox that `flush` encodes."""

        def __init__(self) -> None:
            self.caches: dict[int, tuple[SessionCache, SessionTicket | None]] = {}
            self.outbox: list[StepReply] = []
            self.refused = 0

        def held(self, handle: int) -> tuple[SessionCache, SessionTicket | None]:
            return self.caches[handle]

        def queue(self, replies: list[StepReply]) -> None:
            self.outbox.extend(replies)

        def flush(self) -> None:
            replies, self.outbox = self.outbox, []
            self.refused += sum(isinstance(r, BaseException) for _, r, _ in replies)
            if replies:
                step_frames.reply_frames(replies, head, 64 << 20)

    channels = [_Channel() for _ in range(cfg.channels)]
    admission = SessionAdmission(PeerLimits(), executor)
    intakes = [FrameIntake(executor, admission, c.held, c.queue, c.flush) for c in channels]
    token = torch.randn(1, 1, h)  # [1, 1, H]
    steps = cfg.sessions * cfg.rounds
    best: tuple[float, float] | None = None
    with ForwardClock() as clock:  # the forward runs on this thread only
        for _ in range(cfg.repeats):
            for channel in channels:
                for cache, _ in channel.caches.values():
                    assert isinstance(cache, FastSessionCache)
                    cache.session.close()
                channel.caches.clear()
            for i in range(cfg.sessions):
                session = engine.open_session(1, cfg.prefix_tokens + cfg.rounds + 1)
                engine.step(session, torch.randn(1, cfg.prefix_tokens, h), 0)  # [1, T, H] prefill
                spec = SessionSpec(tuple(range(cfg.num_layers)), 1, cfg.prefix_tokens + cfg.rounds + 1)
                channels[i % cfg.channels].caches[i + 1] = (FastSessionCache(spec, session), None)
            frames = [[(intake, _frame(channel.caches, token, cfg.prefix_tokens + r))
                       for channel, intake in zip(channels, intakes, strict=True)] for r in range(cfg.rounds)]  # fmt: skip
            clock.seconds = 0.0
            started = time.thread_time()
            for round_frames in frames:
                for intake, payload in round_frames:
                    intake.submit(wire.STEP_BATCH, 0, payload)
                queue = runtime._queue
                while len(queue):
                    batch = queue.pop_batch(max_batch_tokens=runtime.max_batch_size_tokens,
                                            mergeable_kinds=runtime._batch_executors.keys(),
                                            merge_limits=runtime._merge_limits, timeout_s=0.0)  # fmt: skip
                    if not batch:
                        break
                    runtime._complete(batch, runtime._execute(batch))
            elapsed_s = time.thread_time() - started
            non_forward = (elapsed_s - clock.seconds) / steps * 1e6
            if best is None or non_forward < best[0]:
                best = (non_forward, clock.seconds / steps * 1e6)
    refused = sum(c.refused for c in channels)
    if refused:
        raise RuntimeError(f"{refused} steps refused: the measure would not be of served steps")
    assert best is not None
    return DeviceInlineResult(cfg, steps, best[0], best[1])


def _frame(handles: Iterable[int], token: torch.Tensor, position: int) -> memoryview:
    """A STEP_BATCH payload stepping every session of a channel once at `position`."""
    items = [
        (
            wire.STEP,
            i + 1,
            wire.Writer().u32(handle).u32(position).u8(0).text("").tensor(token).tensor(None).tensor(None),
        )
        for i, handle in enumerate(handles)
    ]
    return memoryview(bytearray(b"".join(wire.batch(items).parts)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    for name, default in asdict(DeviceInlineConfig()).items():
        parser.add_argument(f"--{name}", type=type(default), default=default)
    result = run(DeviceInlineConfig(**vars(parser.parse_args(argv))))
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(result).items()
                      if k != "config"}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
