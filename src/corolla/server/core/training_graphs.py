"""Training block calls as CUDA graphs (docs/decisions/0057): a block's forward, or its recomputed forward and backward,
captured once per (phase, block, rows, length) and replayed with the call's inputs copied into static buffers, where the
eager call holds the device thread ~2.5-5 ms launching kernels. Only calls with no deep prompt and no adapter are
captured; the graphs share one memory pool (a replay's output is copied out at once). Bounded by `MAX_HELD_BYTES` and
the sizing's autograd reserve: a call past them, or one that fails to capture, runs eagerly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from corolla.server.backend import SpanBackend
from corolla.server.core.training_activations import device_free_bytes
from corolla.server.sizing import autograd_reserve_bytes
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

# the most bytes of the graphs' outputs (each graph keeps its own; 32 blocks x both phases x 1-4 rows of 512 tokens
# of hidden 4096 in bf16, the merged shapes of 8 clients' 512-token steps: 2.5 GiB) and static inputs (one set per
# phase and shape, shared by the blocks' graphs)
MAX_HELD_BYTES = 4 * 2**30

# the graphs' keys: (backward?, block, rows, length)
GraphKey = tuple[bool, int, int, int]


@dataclass(eq=False, slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # [B, T, H] the block's output (forward) or its input's gradient (backward), in the pool


class TrainingGraphs:
    """The captured block calls of one span (`forward`, `backward`: the call's result, or None where the call is not
    captured and runs eagerly). Used by the device thread only."""

    def __init__(self, backend: SpanBackend) -> None:
        if backend.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA span")
        self.backend = backend
        self._pool = torch.cuda.graph_pool_handle()
        # one side stream for every warm-up and capture (cuBLAS keeps a workspace per stream it ran on)
        self._stream = torch.cuda.Stream(device=backend.device)
        self._graphs: dict[GraphKey, _Graph] = {}
        # static inputs, shared by the graphs of every block: (backward?, rows, length) -> hidden [B, T, H] and, for a
        # backward, the output's gradient [B, T, H]
        self._inputs: dict[tuple[bool, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._eager: set[GraphKey] = set()  # calls that failed to capture, or found the device too full
        self._reserve_bytes = autograd_reserve_bytes(backend.config)
        self._element_bytes = torch.empty(0, dtype=backend.dtype).element_size()
        self.held_bytes = 0  # the captured graphs' outputs and their static inputs
        self.num_captured = 0
        self.num_replays = 0

    def forward(self, index: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """Block `index` over `hidden` [B, T, H] (no prompt, no adapter) as `SpanBackend.block_forward` computes it:
        [B, T, H], or None (not captured: run it eagerly)."""
        return self._run((False, index, *hidden.shape[:2]), hidden, None)

    def backward(self, index: int, hidden: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor | None:
        """The gradient of block `index`'s output (weighted by `grad_output` [B, T, H]) w.r.t. its input `hidden`
        [B, T, H] (no prompt, no adapter), as `SpanBackend.block_backward` computes it, or None (run it eagerly)."""
        return self._run((True, index, *hidden.shape[:2]), hidden, grad_output)

    def _run(self, key: GraphKey, hidden: torch.Tensor, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        if key in self._eager:
            return None
        backward, _, rows, length = key
        captured = self._graphs.get(key)
        if captured is None and not self._room_for(key, hidden):
            return None
        static_hidden, static_grad = self._static_inputs(backward, rows, length)
        static_hidden.copy_(hidden)
        if grad_output is not None:
            static_grad.copy_(grad_output)
        if captured is None:
            captured = self._capture(key, static_hidden, static_grad)
            if captured is None:
                return None
        captured.graph.replay()
        self.num_replays += 1
        return captured.output.clone()  # before any other replay may write the pool's memory under it

    def _static_inputs(self, backward: bool, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (backward, rows, length)
        inputs = self._inputs.get(key)
        if inputs is None:
            backend = self.backend
            shape = (rows, length, backend.hidden_size)
            hidden = torch.zeros(shape, dtype=backend.dtype, device=backend.device)
            grad = torch.zeros(shape, dtype=backend.dtype, device=backend.device) if backward else hidden
            inputs = self._inputs[key] = (hidden, grad)
            self.held_bytes += _nbytes(hidden) * (2 if backward else 1)
        return inputs

    def _room_for(self, key: GraphKey, hidden: torch.Tensor) -> bool:
        """Whether a graph of `key` (its output, and its static inputs where its shape has none yet) fits under
        `MAX_HELD_BYTES` and the device's free memory; where not, `key` runs eagerly from now on, nothing allocated."""
        backward, index, rows, length = key
        output_bytes = hidden.numel() * self._element_bytes  # (in the span's dtype, as the buffers are)
        inputs_bytes = 0 if (backward, rows, length) in self._inputs else output_bytes * (2 if backward else 1)
        if (
            self.held_bytes + output_bytes + inputs_bytes <= MAX_HELD_BYTES
            and device_free_bytes(self.backend.device) >= self._reserve_bytes + 4 * output_bytes
        ):
            return True
        self._eager.add(key)
        logger.info(f"training_graphs.eager(block={index}, backward={backward}, rows={rows}, length={length}): "
                    f"graphs hold {self.held_bytes} bytes, or the device is short of memory")  # fmt: skip
        return False

    def _capture(self, key: GraphKey, hidden: torch.Tensor, grad_output: torch.Tensor) -> _Graph | None:
        """Warms the call up on the side stream, then captures it there (the inputs already hold the call's values,
        `_room_for` found room for it); None (and eager from then on) where it fails."""
        backward, index, rows, length = key
        call = self._call(index, hidden, grad_output if backward else None)
        stream, current = self._stream, torch.cuda.current_stream(self.backend.device)
        graph = torch.cuda.CUDAGraph()
        try:
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                call()  # warm-up: kernels chosen and workspaces made outside the capture
                # thread_local: the serving loop's own copies to and from the device go on during the capture
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    output = call()
                finally:
                    graph.capture_end()
            current.wait_stream(stream)
        except Exception as e:
            current.wait_stream(stream)
            self._eager.add(key)
            logger.warning(f"training_graphs.capture_failed(block={index}, backward={backward}, rows={rows}, "
                           f"length={length}, error={e!r}): eager from now on")  # fmt: skip
            return None
        captured = self._graphs[key] = _Graph(graph, output)
        self.held_bytes += _nbytes(output)
        self.num_captured += 1
        logger.debug(f"training_graphs.capture(block={index}, backward={backward}, rows={rows}, length={length})")
        return captured

    def _call(self, index: int, hidden: torch.Tensor, grad_output: torch.Tensor | None) -> Callable[[], torch.Tensor]:
        block = self.backend.blocks[index]
        if grad_output is None:

            def forward() -> torch.Tensor:
                with torch.no_grad():
                    return block(hidden)  # [B, T, H]

            return forward

        def backward() -> torch.Tensor:
            block_input = hidden.detach().requires_grad_(True)
            with torch.enable_grad():
                torch.autograd.backward(block(block_input), grad_output)
            assert block_input.grad is not None, "a block's output depends on its input"
            return block_input.grad  # [B, T, H]

        return backward


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
