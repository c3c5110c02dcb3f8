"""The span of blocks a server holds and the math it runs on them (in the runtime thread) outside the engine:
forwards and each block's forward and backward (training, with deep prompts and adapters), and long forwards' token
chunks through a temporary cache (`forward_chunks`)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from corolla.engine.spans.span_model import add_prompt
from corolla.models.block_base import using_adapter
from corolla.utils.logging import get_logger

if TYPE_CHECKING:
    from corolla.models.block_base import CorollaBlock

logger = get_logger(__name__)

DEFAULT_MAX_CHUNK_SIZE_BYTES = 256 * 2**20


class SpanBackend:
    """Blocks `{block_index: CorollaBlock}` on one device (or TP group), with frozen parameters.

    Every method takes `block_indices`: the blocks of one request, which must be served, contiguous and ascending.
    KV cache tensors are the block's own layout (from `cache_descriptors`), batch first (dim 0).
    """

    def __init__(
        self,
        blocks: Mapping[int, CorollaBlock],
        *,
        config: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        max_chunk_size_bytes: int = DEFAULT_MAX_CHUNK_SIZE_BYTES,
        adapters: Sequence[str] = (),
    ):
        if not blocks:
            raise ValueError("SpanBackend needs at least one block")
        if max_chunk_size_bytes < 1:
            raise ValueError(f"max_chunk_size_bytes must be >= 1, got {max_chunk_size_bytes}")
        self.blocks: dict[int, CorollaBlock] = dict(sorted(blocks.items()))
        self.config = config
        self.hidden_size: int = int(config.hidden_size)
        self.num_attention_heads: int = int(config.num_attention_heads)
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_chunk_size_bytes = max_chunk_size_bytes
        self.adapters: tuple[str, ...] = tuple(adapters)
        for block in self.blocks.values():
            block.requires_grad_(False)  # servers never train their own weights
            block.eval()

    @property
    def block_indices(self) -> list[int]:
        return list(self.blocks)

    # ---- validation

    def validate_block_indices(self, block_indices: Sequence[int]) -> list[int]:
        """Returns the indices as a list; ValueError unless they are served, contiguous and ascending."""
        indices = [int(i) for i in block_indices]
        if not indices:
            raise ValueError("A request must name at least one block")
        missing = [i for i in indices if i not in self.blocks]
        if missing:
            raise ValueError(f"Blocks {missing} are not served here; this server holds blocks {self._span_str()}")
        if any(b != a + 1 for a, b in zip(indices[:-1], indices[1:], strict=True)):
            raise ValueError(f"Blocks must be contiguous and ascending, got {indices}")
        return indices

    def _span_str(self) -> str:
        indices = self.block_indices
        contiguous = indices == list(range(indices[0], indices[-1] + 1))
        return f"{indices[0]}:{indices[-1] + 1}" if contiguous else str(indices)

    def check_hidden(self, hidden: torch.Tensor, what: str = "hidden_states") -> torch.Tensor:
        """`hidden` [B, T, H] on this backend's device and in its dtype; ValueError for another shape or dtype kind."""
        if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3 or hidden.shape[2] != self.hidden_size:
            shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ValueError(f"{what} must have shape [batch, length, {self.hidden_size}], got {shape}")
        if not hidden.is_floating_point():
            raise ValueError(f"{what} must be a floating-point tensor, got {hidden.dtype}")
        return hidden.to(self.device, self.dtype)

    def split_prompts(
        self, prompts: torch.Tensor | None, num_blocks: int, batch_size: int
    ) -> list[torch.Tensor | None]:
        """Splits deep prompts [num_blocks, B|1, P, H] into one [B|1, P, H] per block (None when absent)."""
        if prompts is None or prompts.numel() == 0:
            return [None] * num_blocks
        if (
            prompts.ndim != 4
            or prompts.shape[0] != num_blocks
            or prompts.shape[1] not in (1, batch_size)
            or prompts.shape[3] != self.hidden_size
        ):
            raise ValueError(
                f"prompts must have shape [{num_blocks} blocks, {batch_size} or 1, prefix, {self.hidden_size}], "
                f"got {tuple(prompts.shape)}"
            )
        if not prompts.is_floating_point():
            raise ValueError(f"prompts must be a floating-point tensor, got {prompts.dtype}")
        return list(prompts.to(self.device, self.dtype).unbind(0))

    def adapter_context(self, adapter: str) -> contextlib.AbstractContextManager:
        """Runs the blocks with `adapter` ("" for none); ValueError for an adapter this server does not have."""
        if adapter and adapter not in self.adapters:
            raise ValueError(f"Unknown adapter {adapter!r}; this server has adapters {list(self.adapters)}")
        return using_adapter(adapter)

    # ---- forward / backward

    def forward(
        self, block_indices: Sequence[int], hidden: torch.Tensor, prompts: torch.Tensor | None = None, adapter: str = ""
    ) -> torch.Tensor:
        """Runs the blocks over `hidden` [B, T, H] without cache; returns [B, T, H] on this backend's device."""
        indices = self.validate_block_indices(block_indices)
        hidden = self.check_hidden(hidden)
        per_block_prompts = self.split_prompts(prompts, len(indices), hidden.shape[0])
        with self.adapter_context(adapter):
            if hidden.shape[1] == 0:
                return hidden.clone()
            for index, prompt in zip(indices, per_block_prompts, strict=True):
                hidden = self.block_forward(index, hidden, prompt)
        return hidden

    def check_backward(
        self,
        block_indices: Sequence[int],
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor,
        prompts: torch.Tensor | None,
    ) -> tuple[list[int], torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
        """A backward's request checked once, for this backend and the training batcher alike: the block indices,
        `inputs` and `grad_outputs` [B, T, H] on this device (equal shapes), the deep prompts split per block."""
        indices = self.validate_block_indices(block_indices)
        inputs = self.check_hidden(inputs, "inputs")
        grad_outputs = self.check_hidden(grad_outputs, "grad_outputs")
        if grad_outputs.shape != inputs.shape:
            raise ValueError(
                f"grad_outputs shape {tuple(grad_outputs.shape)} must equal inputs shape {tuple(inputs.shape)}"
            )
        return indices, inputs, grad_outputs, self.split_prompts(prompts, len(indices), inputs.shape[0])

    def block_forward(self, index: int, hidden: torch.Tensor, prompt: torch.Tensor | None) -> torch.Tensor:
        """One served block over `hidden` [B, T, H] (plus its deep prompt [B|1, P, H] at positions < P), no cache,
        no autograd, under the caller's `adapter_context`: [B, T, H]. Inputs as `check_hidden`/`split_prompts` give."""
        # no_grad, not inference_mode: outputs and anything a block caches stay usable by later autograd passes
        with torch.no_grad():
            return self.blocks[index](add_prompt(hidden, prompt, 0))

    def block_backward(
        self, index: int, hidden: torch.Tensor, grad_output: torch.Tensor, prompt: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients of one block's output (weighted by `grad_output` [B, T, H]) w.r.t. its input `hidden` [B, T, H]
        and its deep prompt [B|1, P, H] if given, recomputing the block's activations (none are kept between the
        forward and the backward); the block's parameters get none. Under the caller's `adapter_context`."""
        block_input = hidden.detach().requires_grad_(True)
        if prompt is not None:
            prompt = prompt.detach().requires_grad_(True)
        with torch.enable_grad():
            output = self.blocks[index](add_prompt(block_input, prompt, 0))
            torch.autograd.backward(output, grad_output)
        return _filled_grad(block_input.grad), None if prompt is None else _filled_grad(prompt.grad)

    # ---- long forwards (`forward_chunks`)

    def cached_forward(
        self, index: int, hidden: torch.Tensor, cache: list[torch.Tensor], position: int
    ) -> torch.Tensor:
        """One served block over `hidden` [B, T, H] at positions [position, position + T): writes their keys and
        values into `cache` (the block's layout, `cache_descriptors`) and attends to the earlier ones there, in
        chunks whose attention scores stay under `max_chunk_size_bytes`, under the caller's `adapter_context` (none
        by default). Returns [B, T, H]."""
        hidden = self.check_hidden(hidden)
        block, num_tokens = self.blocks[index], hidden.shape[1]
        chunk_length = self._max_chunk_length(hidden.shape[0], position + num_tokens)
        with torch.inference_mode():
            if chunk_length >= num_tokens:
                return block(hidden, cache=cache, position=position)
            output = torch.empty_like(hidden)  # [B, T, H]
            for start in range(0, num_tokens, chunk_length):
                end = min(start + chunk_length, num_tokens)
                output[:, start:end] = block(hidden[:, start:end], cache=cache, position=position + start)
        return output

    def _max_chunk_length(self, batch_size: int, total_length: int) -> int:
        """Tokens per chunk so that attention scores [B, heads, chunk, total_length] fit `max_chunk_size_bytes`."""
        bytes_per_query = self.num_attention_heads * batch_size * total_length * self.dtype.itemsize
        return max(1, self.max_chunk_size_bytes // bytes_per_query)

    # ---- cache layout

    def cache_descriptors(self, block_indices: Sequence[int], batch_size: int, max_length: int) -> list[list[Any]]:
        """Descriptors of the KV tensors one session needs: one list per block, in `block_indices` order."""
        indices = self.validate_block_indices(block_indices)
        if batch_size < 1 or max_length < 0:
            raise ValueError(f"Need batch_size >= 1 and max_length >= 0, got {batch_size} and {max_length}")
        return [list(self.blocks[i].cache_descriptors(batch_size, max_length)) for i in indices]

    def cache_bytes_per_token(self, block_indices: Sequence[int] | None = None) -> int:
        """Bytes of keys + values for one token of one sequence, summed over `block_indices` (default: all)."""
        indices = self.block_indices if block_indices is None else self.validate_block_indices(block_indices)
        return sum(d.nbytes for i in indices for d in self.blocks[i].cache_descriptors(1, 1))


def _filled_grad(grad: torch.Tensor | None) -> torch.Tensor:
    """A gradient that autograd must have filled (it does for every leaf that took part in the forward)."""
    if grad is None:
        raise RuntimeError("autograd left an input of the span without a gradient")
    return grad
