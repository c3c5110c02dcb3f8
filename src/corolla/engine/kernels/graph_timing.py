"""Device timing of candidate kernels for the start-up tuners (DecodeOps, quant_choices): the median of a CUDA graph's
replays, per config over every layer's weights (distinct weights: no L2 flattery, no launch gaps)."""

from __future__ import annotations

import torch

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

# device index -> the side stream every timing warms up and captures on: cuBLAS keeps a workspace (32 MiB on Hopper)
# per stream it ran on, and a fresh stream per timing walked PyTorch's 32 pool streams (engine.graphs.cuda_graphs held 4
# such workspaces for 3 graph buckets before it kept one stream: benchmarks/RESULTS.md)
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream() -> torch.cuda.Stream:
    device = torch.cuda.current_device()
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def graph_median_ms(fn, reps: int) -> float:
    """Median device milliseconds of `fn` captured once as a CUDA graph and replayed."""
    stream = _side_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: compiles kernels, creates library handles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2]


def time_configs(configs, call, items: list, reps: int) -> dict:
    """{config: median ms of `call(config, w)` over every weight in `items`, one CUDA graph}; configs that do not
    compile or fit on this device are left out (logged)."""
    timings = {}
    for config in configs:
        try:
            timings[config] = graph_median_ms(lambda c=config: [call(c, w) for w in items], reps)
        except Exception as e:  # a config that does not compile or fit is skipped
            logger.warning(f"ops.tune_skipped(config={config}, error={type(e).__name__}: {str(e)[:200]})")
    return timings
