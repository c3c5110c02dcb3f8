"""The span of blocks a server holds and the math it runs on them (in the runtime thread): `forward`, `backward`
and `inference_step` over a contiguous chain of block indices, with deep prompts, adapters, KV reordering and chunking."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from corolla.models.lora import using_adapter
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
        self,
        block_indices: Sequence[int],
        hidden: torch.Tensor,
        prompts: torch.Tensor | None = None,
        adapter: str = "",
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

    def backward(
        self,
        block_indices: Sequence[int],
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor,
        prompts: torch.Tensor | None = None,
        adapter: str = "",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients of the span's outputs (weighted by `grad_outputs`) w.r.t. `inputs` [B, T, H] and, if given,
        `prompts` [n_blocks, B|1, P, H]. Recomputes activations one block at a time; parameters get no gradients."""
        indices, inputs, grad_outputs, per_block_prompts = self.check_backward(
            block_indices, inputs, grad_outputs, prompts
        )
        has_prompts = per_block_prompts[0] is not None
        if inputs.shape[1] == 0:  # nothing flows back
            present = [p for p in per_block_prompts if p is not None]  # all or none: see split_prompts
            empty_prompts = torch.zeros_like(torch.stack(present)) if has_prompts else None
            return torch.zeros_like(inputs), empty_prompts
        with self.adapter_context(adapter):
            # inputs of every block, without keeping activations: [B, T, H] each
            block_inputs = [inputs]
            for index, prompt in zip(indices[:-1], per_block_prompts[:-1], strict=True):
                block_inputs.append(self.block_forward(index, block_inputs[-1], prompt))
            grad = grad_outputs
            grad_prompts: list[torch.Tensor | None] = [None] * len(indices)
            for i in reversed(range(len(indices))):
                grad, grad_prompts[i] = self.block_backward(indices[i], block_inputs[i], grad, per_block_prompts[i])
        grads_prompts = torch.stack([_filled_grad(g) for g in grad_prompts]) if has_prompts else None
        # grads_prompts: [n_blocks, B|1, P, H]
        return grad, grads_prompts

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
            return self.blocks[index](_add_prompt(hidden, prompt, position=0))

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
            output = self.blocks[index](_add_prompt(block_input, prompt, position=0))
            torch.autograd.backward(output, grad_output)
        return _filled_grad(block_input.grad), None if prompt is None else _filled_grad(prompt.grad)

    # ---- inference

    def inference_step(
        self,
        block_indices: Sequence[int],
        hidden: torch.Tensor,
        cache_tensors: Sequence[Sequence[torch.Tensor]],
        *,
        prefix_length: int,
        max_length: int,
        hypo_ids: torch.Tensor | None = None,
        prompts: torch.Tensor | None = None,
        adapter: str = "",
    ) -> torch.Tensor:
        """Processes T new tokens `hidden` [B, T, H] at positions [prefix_length, prefix_length + T): reorders each
        block's cache by `hypo_ids` [B] first, writes the new keys/values and returns [B, T, H]. Earlier cache
        contents past `prefix_length` are overwritten (rollback). Long inputs run in chunks whose attention scores
        stay under `max_chunk_size_bytes`. Zero-token steps only reorder and return [B, 0, H]."""
        indices = self.validate_block_indices(block_indices)
        hidden = self.check_hidden(hidden)
        batch_size, num_tokens, _ = hidden.shape
        if len(cache_tensors) != len(indices):
            raise ValueError(f"Got cache tensors for {len(cache_tensors)} blocks, expected {len(indices)}")
        cache_batch = {int(t.shape[0]) for tensors in cache_tensors for t in tensors}
        if cache_batch != {batch_size}:
            raise ValueError(
                f"hidden_states batch size {batch_size} does not match the session's cache batch size "
                f"{sorted(cache_batch)}"
            )
        if isinstance(prefix_length, bool) or not isinstance(prefix_length, int) or prefix_length < 0:
            raise ValueError(f"prefix_length must be an int >= 0, got {prefix_length!r}")
        if prefix_length + num_tokens > max_length:
            raise ValueError(
                f"Maximum length exceeded: prefix_length {prefix_length} + {num_tokens} new tokens > "
                f"max_length {max_length} allocated for this session"
            )
        hypo_ids = self._check_hypo_ids(hypo_ids, batch_size)
        per_block_prompts = self.split_prompts(prompts, len(indices), batch_size)

        with torch.inference_mode(), self.adapter_context(adapter):
            if hypo_ids is not None:
                ids_on: dict[torch.device, torch.Tensor] = {}  # tensor-parallel caches live on several devices
                for tensors in cache_tensors:
                    for tensor in tensors:
                        ids = ids_on.setdefault(tensor.device, hypo_ids.to(tensor.device))
                        tensor.copy_(tensor.index_select(0, ids))  # whole cache, all positions
            if num_tokens == 0:
                return hidden.clone()
            chunk_length = self._max_chunk_length(batch_size, prefix_length + num_tokens)
            for index, cache, prompt in zip(indices, cache_tensors, per_block_prompts, strict=True):
                block, cache = self.blocks[index], list(cache)
                hidden = _add_prompt(hidden, prompt, position=prefix_length)
                if chunk_length >= num_tokens:
                    hidden = block(hidden, cache=cache, position=prefix_length)
                    continue
                output = torch.empty_like(hidden)  # [B, T, H]
                for start, end in _chunks(num_tokens, chunk_length):
                    output[:, start:end] = block(hidden[:, start:end], cache=cache, position=prefix_length + start)
                hidden = output
        return hidden

    def _check_hypo_ids(self, hypo_ids: torch.Tensor | None, batch_size: int) -> torch.Tensor | None:
        if hypo_ids is None or hypo_ids.numel() == 0:
            return None
        if hypo_ids.dtype != torch.int64 or hypo_ids.ndim != 1 or hypo_ids.shape[0] != batch_size:
            raise ValueError(
                f"hypo_ids must be an int64 tensor of shape [{batch_size}], got {hypo_ids.dtype} "
                f"{tuple(hypo_ids.shape)}"
            )
        low, high = int(hypo_ids.min()), int(hypo_ids.max())
        if low < 0 or high >= batch_size:
            raise ValueError(f"hypo_ids must be in [0, {batch_size}), got values in [{low}, {high}]")
        return hypo_ids

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
        return sum(
            math.prod(d.shape) * d.dtype.itemsize for i in indices for d in self.blocks[i].cache_descriptors(1, 1)
        )


def _filled_grad(grad: torch.Tensor | None) -> torch.Tensor:
    """A gradient that autograd must have filled (it does for every leaf that took part in the forward)."""
    if grad is None:
        raise RuntimeError("autograd left an input of the span without a gradient")
    return grad


def _add_prompt(hidden: torch.Tensor, prompt: torch.Tensor | None, *, position: int) -> torch.Tensor:
    """Adds a deep prompt [B|1, P, H] to the tokens at absolute positions < P; `hidden` [B, T, H] starts at
    `position`. Returns a new tensor (autograd-friendly); the input is never modified."""
    if prompt is None:
        return hidden
    num_tokens, prompt_length = hidden.shape[1], prompt.shape[1]
    overlap = min(prompt_length - position, num_tokens)
    if overlap <= 0:
        return hidden
    head = hidden[:, :overlap] + prompt[:, position : position + overlap]  # [B, overlap, H]
    return torch.cat([head, hidden[:, overlap:]], dim=1)


def _chunks(length: int, chunk_length: int) -> Iterator[tuple[int, int]]:
    for start in range(0, length, chunk_length):
        yield start, min(start + chunk_length, length)
