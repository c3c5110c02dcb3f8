"""`python -m benchmarks.step_files [--transports p2p,socket] [--num_handlers N]`: which files of `server/` a lone
decode step runs code in (issue 31's target: at most 8 in every topology). One server on the demo checkpoint,
corolla's client over each transport; every thread is profiled from before the server starts
(`threading.setprofile`), and a file counts where it ran during each of `--steps` traced steps (each in its own
window, so that a periodic task that happens to wake in one window is not counted). With `--num_handlers` N > 1 the
handler processes are profiled too: their forkserver imports a `sitecustomize` this program writes (on PYTHONPATH),
which profiles every thread of every process forked from it, reads the window from a shared mapped byte and appends
what it sees to a file per process; a step's files are the union over the processes. Run inside loopback-only."""

from __future__ import annotations

import argparse
import collections
import mmap
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from corolla.client import AutoDistributedModelForCausalLM
from corolla.client.config import ClientConfig
from corolla.demo.checkpoint import DEMO_CHECKPOINT_DIR
from corolla.server.config import ServerConfig
from corolla.server.server import Server

SERVER_DIR = "/corolla/server/"
WINDOW_ENV = "COROLLA_STEP_FILES_WINDOW"  # the mapped file whose first byte is the window being traced (0: none)
# the handler processes' profile: imported by their forkserver at start (sitecustomize), active in every fork
CHILD_PROFILE = f"""
import mmap, os, sys, threading
_path = os.environ.get({WINDOW_ENV!r})
if _path:
    _mm = mmap.mmap(os.open(_path, os.O_RDONLY), 1, prot=mmap.PROT_READ)
    _seen, _out = set(), {{}}

    def _profile(frame, event, arg):
        window = _mm[0]
        if window and event == "call" and {SERVER_DIR!r} in frame.f_code.co_filename:
            key = (window, frame.f_code.co_filename.split({SERVER_DIR!r})[1] + ":" + frame.f_code.co_name)
            if key not in _seen:
                _seen.add(key)
                out = _out.get(os.getpid())  # (a forked process writes its own file)
                if out is None:
                    out = _out[os.getpid()] = open(f"{{_path}}.{{os.getpid()}}", "a", buffering=1)
                out.write(f"{{key[0]}} {{key[1]}}\\n")

    threading.setprofile(_profile)
    sys.setprofile(_profile)
"""


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


class ChildWindows:
    """The handler processes' side: the shared window byte and the files their profiles append to."""

    def __init__(self, directory: Path):
        self.path = directory / "window"
        self.path.write_bytes(b"\0")
        self._mm = mmap.mmap(os.open(self.path, os.O_RDWR), 1)
        self.window = 0

    def open(self, window: int) -> None:
        self.window = window
        self._mm[0] = window

    def close(self) -> None:
        self._mm[0] = 0

    def seen(self, window: int) -> set[str]:
        """What every handler process saw in `window`."""
        names = set()
        for path in self.path.parent.glob("window.*"):
            for line in path.read_text().splitlines():
                at, _, name = line.partition(" ")
                if int(at) == window:
                    names.add(name)
        return names


def traced_steps(model: Any, profile: StepProfile, steps: int, children: ChildWindows | None) -> list[set[str]]:
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
            window = (children.window % 255 + 1) if children is not None else 0
            if children is not None:
                children.open(window)
            profile.on = True
            session.step(torch.randn(1, 1, hidden))
            time.sleep(0.1)  # what runs after the reply left (accounting, metrics)
            profile.on = False
            if children is not None:
                children.close()
            time.sleep(0.05 if children is not None else 0.0)  # their last lines written
            windows.append(profile.window() | (children.seen(window) if children is not None else set()))
    return windows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_files", description=__doc__)
    p.add_argument("--transports", default="p2p,socket")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--num_handlers", type=int, default=1, help="handler processes of the server (> 1: traced too)")
    args = p.parse_args(argv)
    children = None
    if args.num_handlers > 1:  # before the server starts the handler processes' forkserver
        directory = Path(tempfile.mkdtemp(prefix="corolla-step-files-"))
        (directory / "sitecustomize.py").write_text(CHILD_PROFILE)
        children = ChildWindows(directory)
        os.environ[WINDOW_ENV] = str(children.path)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))
    profile = StepProfile()
    threading.setprofile(profile)
    sys.setprofile(profile)
    config = ServerConfig(model_name_or_path=str(DEMO_CHECKPOINT_DIR), new_swarm=True, throughput=1.0, num_blocks=4,
                          torch_dtype="float32", cache_dir=tempfile.mkdtemp(prefix="corolla-step-files-"),
                          num_handlers=args.num_handlers)  # fmt: skip
    server = Server(config).start(timeout_s=120)
    try:
        for transport in args.transports.split(","):
            client = ClientConfig(local_transport=transport == "socket", direct_transport=transport == "direct")
            model = AutoDistributedModelForCausalLM.from_pretrained(
                DEMO_CHECKPOINT_DIR, initial_peers=server.join_maddrs, client_config=client
            )
            windows = traced_steps(model, profile, args.steps, children)
            model.shutdown()
            functions = set.intersection(*windows)
            files = sorted({name.split(":")[0] for name in functions})
            print(
                f"{transport}, {args.num_handlers} handler process(es): {len(files)} files of server/ in every traced "
                f"step: {', '.join(files)}"
            )
            for name in sorted(functions):
                print(f"  {name}")
    finally:
        threading.setprofile(None)
        sys.setprofile(None)
        server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
