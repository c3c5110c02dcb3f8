"""The reference the executors and the training batcher are checked against, on a `SpanBackend`'s blocks:
`inference_step` (a session's step through contiguous per-block caches: beam reordering, deep prompts at absolute
positions, adapters, rollback, the limits) and `backward` (block by block, recomputing activations)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from corolla.engine.spans.span_model import add_prompt
from corolla.server.backend import SpanBackend


def inference_step(
    backend: SpanBackend,
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
    """T new tokens `hidden` [B, T, H] at positions [prefix_length, prefix_length + T): reorders each block's cache
    by `hypo_ids` [B] first, writes the new keys/values and returns [B, T, H]. Earlier cache contents past
    `prefix_length` are overwritten (rollback). Zero-token steps only reorder and return [B, 0, H]."""
    indices = backend.validate_block_indices(block_indices)
    hidden = backend.check_hidden(hidden)
    batch_size, num_tokens, _ = hidden.shape
    if len(cache_tensors) != len(indices):
        raise ValueError(f"Got cache tensors for {len(cache_tensors)} blocks, expected {len(indices)}")
    cache_batch = {int(t.shape[0]) for tensors in cache_tensors for t in tensors}
    if cache_batch != {batch_size}:
        raise ValueError(
            f"hidden_states batch size {batch_size} does not match the session's cache batch size {sorted(cache_batch)}"
        )
    if isinstance(prefix_length, bool) or not isinstance(prefix_length, int) or prefix_length < 0:
        raise ValueError(f"prefix_length must be an int >= 0, got {prefix_length!r}")
    if prefix_length + num_tokens > max_length:
        raise ValueError(
            f"Maximum length exceeded: prefix_length {prefix_length} + {num_tokens} new tokens > "
            f"max_length {max_length} allocated for this session"
        )
    hypo_ids = _check_hypo_ids(hypo_ids, batch_size)
    per_block_prompts = backend.split_prompts(prompts, len(indices), batch_size)
    with torch.inference_mode(), backend.adapter_context(adapter):
        if hypo_ids is not None:
            ids_on: dict[torch.device, torch.Tensor] = {}  # tensor-parallel caches live on several devices
            for tensors in cache_tensors:
                for tensor in tensors:
                    ids = ids_on.setdefault(tensor.device, hypo_ids.to(tensor.device))
                    tensor.copy_(tensor.index_select(0, ids))  # whole cache, all positions
        if num_tokens == 0:
            return hidden.clone()
        for index, cache, prompt in zip(indices, cache_tensors, per_block_prompts, strict=True):
            hidden = backend.cached_forward(
                index, add_prompt(hidden, prompt, prefix_length), list(cache), prefix_length
            )
    return hidden


def _check_hypo_ids(hypo_ids: torch.Tensor | None, batch_size: int) -> torch.Tensor | None:
    if hypo_ids is None or hypo_ids.numel() == 0:
        return None
    if hypo_ids.dtype != torch.int64 or hypo_ids.ndim != 1 or hypo_ids.shape[0] != batch_size:
        raise ValueError(
            f"hypo_ids must be an int64 tensor of shape [{batch_size}], got {hypo_ids.dtype} {tuple(hypo_ids.shape)}"
        )
    low, high = int(hypo_ids.min()), int(hypo_ids.max())
    if low < 0 or high >= batch_size:
        raise ValueError(f"hypo_ids must be in [0, {batch_size}), got values in [{low}, {high}]")
    return hypo_ids


def backward(
    backend: SpanBackend,
    block_indices: Sequence[int],
    inputs: torch.Tensor,
    grad_outputs: torch.Tensor,
    prompts: torch.Tensor | None = None,
    adapter: str = "",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of the span's outputs (weighted by `grad_outputs`) w.r.t. `inputs` [B, T, H] and, if given,
    `prompts` [n_blocks, B|1, P, H]. Recomputes activations one block at a time; parameters get no gradients."""
    indices, inputs, grad_outputs, per_block_prompts = backend.check_backward(
        block_indices, inputs, grad_outputs, prompts
    )
    has_prompts = per_block_prompts[0] is not None
    if inputs.shape[1] == 0:  # nothing flows back
        present = [p for p in per_block_prompts if p is not None]
        return torch.zeros_like(inputs), torch.zeros_like(torch.stack(present)) if has_prompts else None
    with backend.adapter_context(adapter):
        block_inputs = [inputs]  # [B, T, H] each, without keeping activations
        for index, prompt in zip(indices[:-1], per_block_prompts[:-1], strict=True):
            block_inputs.append(backend.block_forward(index, block_inputs[-1], prompt))
        grad = grad_outputs
        grad_prompts: list[torch.Tensor | None] = [None] * len(indices)
        for i in reversed(range(len(indices))):
            grad, grad_prompts[i] = backend.block_backward(indices[i], block_inputs[i], grad, per_block_prompts[i])
    return grad, torch.stack([g for g in grad_prompts if g is not None]) if has_prompts else None
