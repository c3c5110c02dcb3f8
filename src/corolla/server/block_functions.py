"""From decoded requests to backend calls: validation of everything a client sends (uid chains, shapes, dtypes,
finiteness, sizes, lengths, adapters) before it touches the device, then forward / backward / inference steps
submitted to the runtime as one task per span. No networking here."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from corolla.protocol.codecs import check_castable
from corolla.protocol.packing import unpack_args_kwargs
from corolla.protocol.uids import parse_chain, parse_uid
from corolla.server.forward_chunks import run_forward_chunked
from corolla.server.task import (
    KIND_BACKWARD,
    KIND_FORWARD,
    KIND_INFERENCE,
    PRIORITY_BACKWARD,
    PRIORITY_FORWARD,
    PRIORITY_INFERENCE,
)

MAX_TENSORS_PER_REQUEST = 16
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class ServingLimits:
    """What the handler checks requests against."""

    dht_prefix: str
    start_block: int
    end_block: int  # exclusive
    hidden_size: int
    dtype: torch.dtype  # block dtype: inputs are cast to it, outputs are sent in it
    inference_max_length_tokens: int
    max_batch_size_tokens: int
    adapters: tuple[str, ...] = ()


def is_dummy(tensor: torch.Tensor) -> bool:
    return tensor.numel() == 0


_EXPONENT_MASKS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}  # all exponent bits set: inf or NaN


def all_finite(tensor: torch.Tensor) -> bool:
    """True if no value is NaN or infinite. Host tensors are checked through numpy (a few microseconds for one
    token's hidden states, against ~15 for torch's op dispatch); device tensors with torch."""
    if tensor.device.type != "cpu":
        return bool(torch.isfinite(tensor).all())
    mask = _EXPONENT_MASKS.get(tensor.dtype)
    if mask is not None:
        bits = tensor.detach().view(torch.int16).numpy()
        return not bool(((bits & mask) == mask).any())
    return bool(np.isfinite(tensor.detach().numpy()).all())


# ---- validation -------------------------------------------------------------------------------------------------


def resolve_chain(chain: str, limits: ServingLimits) -> list[int]:
    """`"p.3 p.4"` -> `[3, 4]`: every uid served here, same prefix, contiguous ascending; else ValueError."""
    if not isinstance(chain, str) or not chain:
        raise ValueError("request uid is empty: expected a chain of block uids like 'prefix.3 prefix.4'")
    indices = []
    for uid in parse_chain(chain):
        prefix, index = parse_uid(uid)
        if prefix != limits.dht_prefix or not limits.start_block <= index < limits.end_block:
            raise ValueError(
                f"Remote peer does not serve {uid}: this server holds {limits.dht_prefix}.{limits.start_block} to "
                f"{limits.dht_prefix}.{limits.end_block - 1}"
            )
        indices.append(index)
    for previous, current in zip(indices, indices[1:], strict=False):
        if current != previous + 1:
            raise ValueError(f"uid chain must list contiguous blocks in ascending order, got {chain!r:.200}")
    return indices


def validate_adapter(name: str, limits: ServingLimits) -> str:
    if name and name not in limits.adapters:
        raise ValueError(f"adapter {name!r} not found: this server has adapters {list(limits.adapters)}")
    return name


def validate_hidden_states(
    tensor: Any, limits: ServingLimits, *, name: str = "hidden_states", allow_empty_seq: bool = False
) -> torch.Tensor:
    """Checks a `[B, T, H]` float tensor with finite values and `B * T <= max_batch_size`; returns it cast to the
    block dtype."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be a float tensor (float32, float16 or bfloat16), got {tensor.dtype}")
    if tensor.ndim != 3:
        raise ValueError(f"{name} must have shape [batch, length, {limits.hidden_size}], got {list(tensor.shape)}")
    batch_size, length, hidden = tensor.shape
    if hidden != limits.hidden_size:
        raise ValueError(f"{name} last dimension must be hidden_size={limits.hidden_size}, got {list(tensor.shape)}")
    if batch_size < 1:
        raise ValueError(f"{name} batch size must be >= 1, got {list(tensor.shape)}")
    if length < 1 and not allow_empty_seq:
        raise ValueError(f"{name} must have at least one token, got {list(tensor.shape)}")
    if batch_size * length > limits.max_batch_size_tokens:
        raise ValueError(
            f"{name} has {batch_size} x {length} = {batch_size * length} tokens, more than the server's "
            f"max_batch_size of {limits.max_batch_size_tokens} tokens"
        )
    if not all_finite(tensor):
        raise ValueError(f"{name} contains NaN or infinite values")
    check_castable(tensor, limits.dtype, name=name, finite_checked=True)  # e.g. float64 1e300 -> inf in the block
    return tensor.to(limits.dtype)


def validate_prompts(
    prompts: Any, limits: ServingLimits, *, num_blocks: int, batch_size: int, length: int | None
) -> list[torch.Tensor | None]:
    """Deep prompts `[num_blocks, B|1, P, H]` (P <= length unless length is None) or a dummy -> one `[B|1, P, H]`
    prompt per block."""
    if prompts is None or (isinstance(prompts, torch.Tensor) and is_dummy(prompts)):
        return [None] * num_blocks
    if not isinstance(prompts, torch.Tensor):
        raise ValueError(f"prompts must be a tensor, got {type(prompts).__name__}")
    if prompts.dtype not in FLOAT_DTYPES:
        raise ValueError(f"prompts must be a float tensor, got {prompts.dtype}")
    shape = list(prompts.shape)
    if (
        prompts.ndim != 4
        or shape[0] != num_blocks
        or shape[1] not in (1, batch_size)
        or shape[3] != limits.hidden_size
        or (length is not None and shape[2] > length)
    ):
        raise ValueError(
            f"prompts must have shape [num_blocks={num_blocks}, batch={batch_size} or 1, prefix <= {length or 'any'}, "
            f"hidden={limits.hidden_size}], got {shape}"
        )
    if not all_finite(prompts):
        raise ValueError("prompts contain NaN or infinite values")
    check_castable(prompts, limits.dtype, name="prompts", finite_checked=True)
    prompts = prompts.to(limits.dtype)
    return [prompts[i] for i in range(num_blocks)]


def validate_hypo_ids(hypo_ids: Any, *, batch_size: int) -> torch.Tensor | None:
    """`int64 [B]` with values in `[0, B)`, or a dummy -> None."""
    if hypo_ids is None or (isinstance(hypo_ids, torch.Tensor) and is_dummy(hypo_ids)):
        return None
    if not isinstance(hypo_ids, torch.Tensor):
        raise ValueError(f"hypo_ids must be a tensor, got {type(hypo_ids).__name__}")
    if hypo_ids.dtype != torch.int64:
        raise ValueError(f"hypo_ids must be int64, got {hypo_ids.dtype}")
    if list(hypo_ids.shape) != [batch_size]:
        raise ValueError(f"hypo_ids must have shape [{batch_size}], got {list(hypo_ids.shape)}")
    if hypo_ids.numel() and (int(hypo_ids.min()) < 0 or int(hypo_ids.max()) >= batch_size):
        raise ValueError(f"hypo_ids values must be in [0, {batch_size}), got {hypo_ids.tolist()}")
    return hypo_ids


def unpack_request_args(tensors: Sequence[torch.Tensor], args_structure: Any) -> tuple[Any, ...]:
    """Positional args of a request: via `args_structure` if given, else the flat tensor list (kwargs ignored)."""
    if len(tensors) > MAX_TENSORS_PER_REQUEST:
        raise ValueError(f"request has {len(tensors)} tensors, more than the limit of {MAX_TENSORS_PER_REQUEST}")
    if args_structure is None:
        return tuple(tensors)
    args, _kwargs = unpack_args_kwargs(tensors, args_structure)
    return args


def _arg(args: Sequence[Any], index: int) -> Any:
    return args[index] if len(args) > index else None


@dataclass
class ForwardInputs:
    hidden_states: torch.Tensor  # [B, T, H] in block dtype
    prompts: list[torch.Tensor | None]


@dataclass
class BackwardInputs:
    hidden_states: torch.Tensor  # [B, T, H]
    grad_outputs: torch.Tensor  # [B, T, H]
    prompts: list[torch.Tensor | None]
    has_prompts: bool


def parse_forward_inputs(args: Sequence[Any], limits: ServingLimits, *, num_blocks: int) -> ForwardInputs:
    hidden = validate_hidden_states(_arg(args, 0), limits)
    batch_size, length, _ = hidden.shape
    prompts = validate_prompts(_arg(args, 1), limits, num_blocks=num_blocks, batch_size=batch_size, length=length)
    return ForwardInputs(hidden, prompts)


def parse_backward_inputs(args: Sequence[Any], limits: ServingLimits, *, num_blocks: int) -> BackwardInputs:
    hidden = validate_hidden_states(_arg(args, 0), limits)
    grads = validate_hidden_states(_arg(args, 1), limits, name="grad_outputs")
    if grads.shape != hidden.shape:
        raise ValueError(f"grad_outputs shape {list(grads.shape)} must equal inputs shape {list(hidden.shape)}")
    batch_size, length, _ = hidden.shape
    raw_prompts = _arg(args, 2)
    prompts = validate_prompts(raw_prompts, limits, num_blocks=num_blocks, batch_size=batch_size, length=length)
    return BackwardInputs(hidden, grads, prompts, any(p is not None for p in prompts))


# ---- compute (event loop side: submit one task per span) -----------------------------------------------------------


def _stack_prompts(prompts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Per-block prompts back to the backend's `[num_blocks, B|1, P, H]` (None when absent)."""
    if not prompts or prompts[0] is None:
        return None
    return torch.stack(prompts)  # type: ignore[arg-type]


def _measured(fn: Callable[[], Any], metrics: Any, kind: str, batch_size: int, num_tokens: int) -> Callable[[], Any]:
    """Wraps a runtime task so that it reports its queue wait, execution time, batch size and tokens."""
    if metrics is None:
        return fn
    submitted = time.perf_counter()

    def task() -> Any:
        started = time.perf_counter()
        metrics.queue_wait(started - submitted)
        result = fn()
        metrics.observe_step(time.perf_counter() - started)
        metrics.batch_size(batch_size)
        metrics.tokens(kind, num_tokens)
        return result

    return task


async def run_forward(
    backend: Any,
    runtime: Any,
    block_indices: list[int],
    inputs: ForwardInputs,
    *,
    active_adapter: str,
    metrics: Any = None,
    chunk_tokens: int = 0,
) -> torch.Tensor:
    """Hidden states after the blocks `block_indices`: `[B, T, H]`. With `chunk_tokens` > 0, as one runtime task
    per block and chunk of at most that many tokens (`forward_chunks`), so that inference steps run in between."""
    batch_size, length, _ = inputs.hidden_states.shape
    prompts = _stack_prompts(inputs.prompts)
    if chunk_tokens and (len(block_indices) > 1 or batch_size * length > chunk_tokens):
        return await run_forward_chunked(
            backend,
            runtime,
            block_indices,
            inputs.hidden_states,
            prompts,
            active_adapter=active_adapter,
            chunk_tokens=chunk_tokens,
            measured=lambda fn, num_tokens: _measured(fn, metrics, "forward", batch_size, num_tokens),
        )

    def task() -> torch.Tensor:
        return backend.forward(block_indices, inputs.hidden_states, prompts, active_adapter)

    return await runtime.submit(
        _measured(task, metrics, "forward", batch_size, batch_size * length),
        priority=PRIORITY_FORWARD,
        size_tokens=batch_size * length,
        kind=KIND_FORWARD,
    )


async def run_backward(
    backend: Any,
    runtime: Any,
    block_indices: list[int],
    inputs: BackwardInputs,
    *,
    active_adapter: str,
    metrics: Any = None,
) -> list[torch.Tensor]:
    """`[grad_inputs]` or, with deep prompts, `[grad_inputs, grad_prompts [num_blocks, B|1, P, H]]`."""
    batch_size, length, _ = inputs.hidden_states.shape
    prompts = _stack_prompts(inputs.prompts)

    def task() -> tuple[torch.Tensor, torch.Tensor | None]:
        return backend.backward(block_indices, inputs.hidden_states, inputs.grad_outputs, prompts, active_adapter)

    grad_inputs, grad_prompts = await runtime.submit(
        _measured(task, metrics, "backward", batch_size, batch_size * length),
        priority=PRIORITY_BACKWARD,
        size_tokens=batch_size * length,
        kind=KIND_BACKWARD,
    )
    if grad_prompts is None:
        return [grad_inputs]
    return [grad_inputs, grad_prompts]


async def run_inference_step(
    backend: Any,
    runtime: Any,
    memory_cache: Any,
    block_indices: list[int],
    hidden_states: torch.Tensor,
    *,
    cache_handles: Sequence[Sequence[int]],
    prefix_length: int,
    max_length: int,
    prompts: list[torch.Tensor | None],
    hypo_ids: torch.Tensor | None,
    active_adapter: str,
    metrics: Any = None,
    lone_session: bool = False,
) -> torch.Tensor:
    """One step of an inference session over the whole span, as one runtime task at inference priority.
    `lone_session`: no other session is open, so the fast path may run the step inline when its runtime is idle
    (nothing to batch it with; saves two thread hand-offs)."""
    batch_size, length, _ = hidden_states.shape
    stacked_prompts = _stack_prompts(prompts)
    if hasattr(backend, "submit_inference_step"):  # the GPU fast path merges steps of many sessions itself
        started = time.perf_counter()
        output = await backend.submit_inference_step(
            runtime,
            memory_cache,
            block_indices,
            hidden_states,
            cache_handles=cache_handles,
            prefix_length=prefix_length,
            max_length=max_length,
            prompts=stacked_prompts,
            hypo_ids=hypo_ids,
            active_adapter=active_adapter,
            inline=lone_session,
        )
        if metrics is not None:
            metrics.observe_step(time.perf_counter() - started)  # includes the queue wait here
            metrics.tokens("inference", batch_size * length)
        return output

    def task() -> torch.Tensor:
        cache_tensors = [memory_cache.use_cache(*handles) for handles in cache_handles]
        return backend.inference_step(
            block_indices,
            hidden_states,
            cache_tensors,
            prefix_length=prefix_length,
            max_length=max_length,
            hypo_ids=hypo_ids,
            prompts=stacked_prompts,
            adapter=active_adapter,
        )

    return await runtime.submit(
        _measured(task, metrics, "inference", batch_size, batch_size * length),
        priority=PRIORITY_INFERENCE,
        size_tokens=batch_size * max(length, 1),
        kind=KIND_INFERENCE,
    )
