"""The block contract shared by every family: `CorollaBlock` (one decoder layer, our own code), the
`TensorDescriptor` of its KV cache, and `TensorTarget`, the map from checkpoint tensor names to our parameters."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from corolla.utils.errors import ConfigurationError
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class TensorDescriptor:
    """Shape, dtype and device of one tensor to allocate (used for KV caches)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def numel(self) -> int:
        return math.prod(int(s) for s in self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def make_zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)


@dataclass(frozen=True)
class TensorTarget:
    """Where a checkpoint tensor goes: `param` (our dotted parameter name) and, for fused projections,
    `rows`: checkpoint row i is written to row `rows[i]` of our parameter (None = the whole parameter)."""

    param: str
    rows: torch.Tensor | None = None


def same_names(*names: str) -> dict[str, TensorTarget]:
    """Checkpoint tensors stored under our parameter names (`norm.weight` -> `norm.weight`)."""
    return {name: TensorTarget(name) for name in names}


# The adapter selected for the current request (`using_adapter`); "" means none.
_ACTIVE_ADAPTER: contextvars.ContextVar[str] = contextvars.ContextVar("corolla_active_adapter", default="")


def active_adapter() -> str:
    return _ACTIVE_ADAPTER.get()


@contextlib.contextmanager
def using_adapter(name: str | None) -> Iterator[None]:
    """Makes `name` the active adapter in this thread/task for the duration ("" or None = none). Blocks raise
    `KeyError` listing theirs when asked for one they lack."""
    token = _ACTIVE_ADAPTER.set(name or "")
    try:
        yield
    finally:
        _ACTIVE_ADAPTER.reset(token)


class BlockAttention(nn.Module):
    """What a block's `attn` is (plain, windowed, latent or tensor-parallel attention): the module that owns the
    block's KV cache and describes it."""

    def cache_descriptors(self, batch_size: int, max_length: int, dtype: torch.dtype) -> list[TensorDescriptor]:
        raise NotImplementedError


class CorollaBlock(nn.Module):
    """One decoder layer. Subclasses build `self.attn` (an `attention.Attention` or its tensor-parallel
    replacement) and implement `checkpoint_layout`; `_forward` is the pre-norm residual layer of Llama and most
    families (over `input_layernorm` and `post_attention_layernorm`), else the subclass's own.

    forward(hidden_states [B,T,H], *, cache=None, position=0) -> [B,T,H]:
      * with `cache` (the tensors described by `cache_descriptors`: K and V `[B, kv_heads, max_length, head_dim]`
        per attention shard; MLA blocks: latent and rotary key `[B, 1, max_length, dim]`), writes this step's keys/values at `[position, position+T)` and attends causally
        over `[0, position+T)`; rolling back is calling again with a smaller `position`;
      * without `cache`: causal attention over the T tokens (positions start at `position`); supports autograd.
    """

    attn: BlockAttention
    mlp: nn.Module
    # the pre-norm blocks' norms (each family's own class: callers that read their weights know which)
    input_layernorm: Any
    post_attention_layernorm: Any
    # The devices `tensor_parallel.make_tensor_parallel` split this block over (empty: not split).
    tensor_parallel_devices: tuple[torch.device, ...] = ()

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size: int = config.hidden_size
        self.adapter_names: set[str] = set()

    # --- the contract -------------------------------------------------------------------------------------
    def forward(
        self, hidden_states: torch.Tensor, *, cache: list[torch.Tensor] | None = None, position: int = 0
    ) -> torch.Tensor:
        if hidden_states.ndim != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [batch, tokens, {self.hidden_size}], got {tuple(hidden_states.shape)}"
            )
        position = int(position)
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        name = active_adapter()
        if name and name not in self.adapter_names:
            raise KeyError(f"Unknown adapter {name!r}; this block has {sorted(self.adapter_names) or 'none'}")
        return self._forward(hidden_states, cache=cache, position=position)

    def _forward(self, hidden_states: torch.Tensor, *, cache: list[torch.Tensor] | None, position: int) -> torch.Tensor:
        x = hidden_states  # [B, T, H]
        x = x + self.attn(self.input_layernorm(x), cache, position)  # [B, T, H]
        return x + self.mlp(self.post_attention_layernorm(x))  # [B, T, H]

    def cache_descriptors(self, batch_size: int, max_length: int) -> list[TensorDescriptor]:
        """The attention's cache tensors (K and V `[batch, kv_heads, max_length, head_dim]` per shard; MLA: latent
        and rotary key), in the block's dtype/device."""
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"batch_size and max_length must be >= 1, got {batch_size}, {max_length}")
        return self.attn.cache_descriptors(batch_size, max_length, self.dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: that of the norms (never quantized)."""
        for p in self.parameters():
            if p.dtype in (torch.float32, torch.float16, torch.bfloat16):
                return p.dtype
        return torch.bfloat16

    # --- weights --------------------------------------------------------------------------------------------
    def checkpoint_layout(self) -> dict[str, TensorTarget]:
        """Checkpoint tensor names (relative to the layer prefix) -> where they go in this (unsplit) block."""
        raise NotImplementedError

    def normalize_checkpoint_names(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Maps alternative spellings of the checkpoint names (e.g. newer transformers layouts) onto
        `checkpoint_layout` names. Default: unchanged."""
        return dict(state_dict)

    def expected_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        params = dict(self.named_parameters())
        shapes = {}
        for name, target in self.checkpoint_layout().items():
            shape = tuple(params[target.param].shape)
            if target.rows is not None:
                shape = (len(target.rows), *shape[1:])
            shapes[name] = shape
        return shapes

    @torch.no_grad()
    def load_hf_state_dict(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        source: str = "state_dict",
        origin: Mapping[str, str] | None = None,
    ) -> None:
        """Copies checkpoint tensors (names relative to the layer prefix, e.g. `self_attn.q_proj.weight`) into
        this block, casting floats to the block's dtype. Missing or mis-shaped tensors raise `ConfigurationError`
        naming the tensor and `source` (or the file `origin` says it came from); unknown names are ignored with a
        log line."""
        state_dict, origin = self.normalize_checkpoint_names(state_dict), origin or {}
        layout = self.checkpoint_layout()
        shapes = self.expected_checkpoint_shapes()
        params = dict(self.named_parameters())
        missing = sorted(set(layout) - set(state_dict))
        if missing:
            raise ConfigurationError(
                f"Tensor {missing[0]!r} of block {self.layer_idx} is missing from {source} (looked in "
                f"{sorted(set(origin.values())) or source}): missing {missing}"
            )
        unknown = sorted(set(state_dict) - set(layout))
        if unknown:
            logger.info("load_hf_state_dict.ignored(layer=%d, names=%s)", self.layer_idx, unknown)
        for name, target in layout.items():
            value = state_dict[name]
            if tuple(value.shape) != shapes[name]:
                raise ConfigurationError(
                    f"Tensor {name!r} of block {self.layer_idx} in {origin.get(name, source)} has shape "
                    f"{tuple(value.shape)}, expected {shapes[name]}"
                )
            param = params[target.param]
            value = value.to(device=param.device, dtype=param.dtype if value.is_floating_point() else value.dtype)
            if target.rows is None:
                param.copy_(value)
            else:
                param[target.rows.to(param.device)] = value
