"""The same span run locally by `transformers` (the baseline a client with the whole model would have): a
`LlamaModel` with frozen weights over `inputs_embeds` [B, T, H] that require grad, forward then backward with a fixed
gradient of the outputs (its activations kept by autograd: no recomputation); tokens/s of forward+backward."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import LlamaModel


def local_tokens_per_s(model: LlamaModel, rows: int, length: int, steps: int, *, warmup: int = 2) -> float:
    """Forward+backward tokens/s of `model` (frozen) at `rows` x `length` tokens per step, after `warmup` steps."""
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype
    hidden_size = int(model.config.hidden_size)
    torch.manual_seed(2)
    inputs = torch.randn(rows, length, hidden_size, device=device, dtype=dtype)  # [B, T, H]
    grad_outputs = torch.randn(rows, length, hidden_size, device=device, dtype=dtype) * 1e-3

    def step() -> None:
        x = inputs.detach().requires_grad_(True)
        outputs = model(inputs_embeds=x, use_cache=False).last_hidden_state  # [B, T, H]
        torch.autograd.backward(outputs, grad_outputs)
        assert x.grad is not None

    for _ in range(warmup):
        step()
    _sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return rows * length * steps / (time.perf_counter() - started)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
