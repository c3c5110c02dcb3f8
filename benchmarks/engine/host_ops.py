"""The host's microseconds per call of each CUDA operation a decode step issues around its graph replay (issue 35:
the step's host part before the replay): `python -m benchmarks.engine.host_ops --out DIR`.

Each operation is called `--calls` times on the current stream, timed alone and synchronized after each call
(outside the timing): the median of the host's microseconds per call onto an idle device. Writes a JSON and a log
under --out."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common.report import log

WARM_CALLS = 20


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Median host microseconds of one call of `fn`, each issued onto an idle device (synchronized after it, outside
    the timing), as a decode step issues its operations after the last step's synchronization."""
    for _ in range(WARM_CALLS):  # allocator blocks, events, the dispatcher's caches
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--hidden_size", type=int, default=4096)
    args = parser.parse_args()
    dev = torch.device("cuda")
    h = args.hidden_size
    pinned = torch.zeros(64 << 10, dtype=torch.uint8, pin_memory=True)
    pageable = torch.zeros(512, dtype=torch.uint8)
    block = torch.zeros(64 << 10, dtype=torch.uint8, device=dev)
    head, graph_head = pinned[:512], block[:512]
    step_bytes = 512 + 2 * h  # the head + one bf16 row of H: a batch-1 step's one copy
    if step_bytes > pinned.numel():
        parser.error(f"--hidden_size {h}: one row does not fit the {pinned.numel()}-byte block")
    rows_in, rows_out = pinned[:step_bytes], block[:step_bytes]
    step_label = f"H2D copy_ {step_bytes / 1024:.1f} KiB pinned, non_blocking"  # 8.5 KiB at H 4096
    x = torch.randn(1, 1, h, device=dev).to(torch.bfloat16)
    graph_rows = torch.zeros(1, 1, h, device=dev, dtype=torch.bfloat16)
    static_out = torch.zeros(64, h, device=dev, dtype=torch.bfloat16)
    out_pinned = torch.zeros(1, h, dtype=torch.bfloat16, pin_memory=True)
    event = torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream(dev)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(dev)
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        y = static_out[:1] * 2
    stream.wait_stream(side)
    with torch.cuda.graph(graph, stream=side):
        for _ in range(256):  # a decode step's graph has a few hundred kernels (32 layers x ~8)
            y.mul_(1.0)
    ops: dict[str, Callable[[], object]] = {
        "torch.cuda.current_stream(dev)": lambda: torch.cuda.current_stream(dev),
        "event.record(stream)": lambda: event.record(stream),
        "event.synchronize() (passed)": event.synchronize,
        "H2D copy_ 512 B pinned, non_blocking": lambda: graph_head.copy_(head, non_blocking=True),
        "H2D copy_ 512 B pageable, non_blocking": lambda: graph_head.copy_(pageable, non_blocking=True),
        step_label: lambda: rows_out.copy_(rows_in, non_blocking=True),
        "D2D copy_ [1, 1, H] bf16": lambda: graph_rows.copy_(x),
        "x.reshape(-1, H).to(dev, bf16)": lambda: x.reshape(-1, h).to(dev, torch.bfloat16),
        "torch.cat([x.reshape(-1, H)])": lambda: torch.cat([x.reshape(-1, h)]),
        "static_out[:1]": lambda: static_out[:1],
        "static_out[:1].clone()": lambda: static_out[:1].clone(),
        "static_out.split([1, 63])": lambda: static_out.split([1, 63]),
        "D2H copy_ [1, H] bf16 pinned, non_blocking": lambda: out_pinned.copy_(static_out[:1], non_blocking=True),
        "graph.replay() (256 small kernels)": graph.replay,
    }
    name = torch.cuda.get_device_name(dev)
    lines: list[str] = []
    log(lines, f"device {name}; torch {torch.__version__}; host us per call, median of {args.calls} calls")
    results: dict = {"device": name, "torch": torch.__version__, "us_per_call": {}}
    for label, fn in ops.items():
        us = per_call_us(fn, args.calls)
        results["us_per_call"][label] = us
        log(lines, f"  {us:7.2f} us  {label}")
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    base = args.out / f"host-ops-{name.lower().replace(' ', '-')}-{stamp}"
    base.with_suffix(".json").write_text(json.dumps(results, indent=1))
    base.with_suffix(".log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
