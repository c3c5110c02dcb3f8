"""`python -m benchmarks.step_files [--transports p2p,socket]`: which files of `server/` a lone decode step runs
code in (issue 31's target: at most 8 in every topology). One in-process server (one front) on the demo checkpoint,
corolla's client over each transport; every thread is profiled from before the server starts
(`threading.setprofile`), and a file counts where it ran during each of `--steps` traced steps (each in its own
window, so that a periodic task that happens to wake in one window is not counted). Run inside loopback-only. Handler
processes (`--num_handlers` > 1) are not covered: their code runs in other processes."""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
import time
from types import FrameType
from typing import Any

import torch

from corolla.client import AutoDistributedModelForCausalLM
from corolla.client.config import ClientConfig
from corolla.demo.assets import DEMO_CHECKPOINT_DIR
from corolla.server.config import ServerConfig
from corolla.server.server import Server

SERVER_DIR = "/corolla/server/"


class StepProfile:
    """Records the `server/` functions called in every thread while on."""

    def __init__(self) -> None:
        self.on = False
        self.seen: collections.Counter[str] = collections.Counter()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.on and event == "call" and SERVER_DIR in frame.f_code.co_filename:
            self.seen[f"{frame.f_code.co_filename.split(SERVER_DIR)[1]}:{frame.f_code.co_name}"] += 1

    def window(self) -> set[str]:
        """The functions seen since the last window."""
        names = set(self.seen)
        self.seen.clear()
        return names


def traced_steps(model: Any, profile: StepProfile, steps: int) -> list[set[str]]:
    """A session's prefill and 3 warm-up steps, then `steps` steps each traced in its own window."""
    hidden = model.config.hidden_size
    windows = []
    with model.inference_session(max_length=64) as session:
        session.step(torch.randn(1, 4, hidden))
        for _ in range(3):
            session.step(torch.randn(1, 1, hidden))
        for _ in range(steps):
            time.sleep(0.1)
            profile.window()
            profile.on = True
            session.step(torch.randn(1, 1, hidden))
            time.sleep(0.1)  # what runs after the reply left (accounting, metrics)
            profile.on = False
            windows.append(profile.window())
    return windows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_files", description=__doc__)
    p.add_argument("--transports", default="p2p,socket")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    profile = StepProfile()
    threading.setprofile(profile)
    sys.setprofile(profile)
    config = ServerConfig(model_name_or_path=str(DEMO_CHECKPOINT_DIR), new_swarm=True, throughput=1.0, num_blocks=4,
                          torch_dtype="float32", cache_dir=tempfile.mkdtemp(prefix="corolla-step-files-"))  # fmt: skip
    server = Server(config).start(timeout_s=120)
    try:
        for transport in args.transports.split(","):
            client = ClientConfig(local_transport=transport == "socket", direct_transport=transport == "direct")
            model = AutoDistributedModelForCausalLM.from_pretrained(
                DEMO_CHECKPOINT_DIR, initial_peers=server.join_maddrs, client_config=client
            )
            windows = traced_steps(model, profile, args.steps)
            model.shutdown()
            functions = set.intersection(*windows)
            files = sorted({name.split(":")[0] for name in functions})
            print(f"{transport}: {len(files)} files of server/ in every traced step: {', '.join(files)}")
            for name in sorted(functions):
                print(f"  {name}")
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        sys.setprofile(None)
        server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
