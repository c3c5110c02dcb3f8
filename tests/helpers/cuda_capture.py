"""A call captured in a CUDA graph for the kernel tests that replay it with new inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(fn: Callable[..., torch.Tensor], *args: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`fn(*args)` run once on a side stream (its kernels compiled outside the capture), then captured: (the graph,
    the output tensor each replay writes)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out
