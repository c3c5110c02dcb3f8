"""The typed records that cross the front-to-core seam and the core's seam to the device (`engine_executor`). Everything
that crosses was validated where it entered (`block_functions`): an executor trusts shapes, dtypes, lengths and
positions and only enforces what it alone knows (free cache)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from corolla.utils.tensor_bytes import HiddenRows, view_bytes

# how the engine runs a span (reported, not chosen by the operator): fused kernels, or the family's blocks eagerly
PATH_FUSED = "fused"
PATH_EAGER = "eager"
# the runtime task kind of the engine's inference steps (`EngineExecutor.step_task`), merged into one forward
KIND_ENGINE_INFERENCE = "engine_inference"


@dataclass(frozen=True)
class SessionSpec:
    """What one inference session reserves: `batch_size` sequences of up to `max_length_tokens` over the
    contiguous ascending `block_indices` (validated against the span by the handler)."""

    block_indices: tuple[int, ...]
    batch_size: int
    max_length_tokens: int  # > 0; a max_length=0 probe opens no cache at all
    shadow: bool = False  # a client's mirror of another server's session (`protocol.shadow`): its steps go last

    @property
    def num_blocks(self) -> int:
        return len(self.block_indices)


@dataclass(frozen=True)
class SessionOpen:
    """A front's request to open a session (`span_core.CoreClient.open_session`): `spec` for `peer`, waiting up to
    `alloc_timeout_s` for cache; pushes for `session_id` reach the session while it is open; `opening_tokens`: what
    its opening request brings (its prefill or an imported cache's positions; None unknown, 0 none: no wait in line)."""

    peer: str
    spec: SessionSpec
    alloc_timeout_s: float | None = None
    session_id: str | None = None
    opening_tokens: int | None = None


class StepInputs(NamedTuple):
    """One validated inference step of one session (immutable; a NamedTuple rather than a frozen dataclass: it is
    built per decode step in the handler and the device process, where a frozen dataclass's init costs ~1.7 us
    more)."""

    # [B, T, H] in the block dtype, finite; T >= 1 (the handler answers T = 0 itself). None only where
    # `hidden_bytes` and `hidden_meta` carry them (a device channel's step: no tensor is built unless an executor
    # needs one); `tensor()` gives them either way
    hidden_states: torch.Tensor | None
    prefix_length: int  # the step writes positions [prefix_length, prefix_length + T) (rollback if < length)
    prompts: torch.Tensor | None  # deep prompts [num_blocks, B|1, P, H] in the block dtype, or None
    hypo_ids: torch.Tensor | None  # int64 [B] with values in [0, B): reorder the cache first; None = keep
    adapter: str  # "" = the base model
    lone_session: bool  # no other session is open: an idle runtime may run the step inline
    # the hidden states' bytes in C order, flat, where the caller holds them (a device channel's frame copy, which
    # `hidden_states` views if given): the fast path stages a launched forward's rows from them with one memcpy each
    hidden_bytes: memoryview | None = None
    hidden_meta: tuple[torch.dtype, tuple[int, ...]] | None = None  # `hidden_bytes`' dtype and shape [B, T, H]
    # `hidden_bytes` as row `index` of a frame's steps in one buffer (`StepRequest.hidden_rows`), where so
    hidden_rows: tuple[HiddenRows, int] | None = None

    def tensor(self) -> torch.Tensor:
        """The hidden states [B, T, H]: `hidden_states`, or a new tensor viewing `hidden_bytes` (writable)."""
        if self.hidden_states is not None:
            return self.hidden_states
        if self.hidden_bytes is None or self.hidden_meta is None:
            raise ValueError("a step needs its hidden states: a tensor, or their bytes with a dtype and a shape")
        return view_bytes(self.hidden_bytes, *self.hidden_meta)


@dataclass(frozen=True)
class ForwardInputs:
    """A validated forward (no cache)."""

    hidden_states: torch.Tensor  # [B, T, H] in the block dtype
    prompts: torch.Tensor | None  # [num_blocks, B|1, P, H] with P <= T, or None
    adapter: str
    owner: str = ""  # the peer it came from (set by the core): whose backward may reuse its activations


@dataclass(frozen=True)
class BackwardInputs:
    """A validated backward."""

    hidden_states: torch.Tensor  # [B, T, H] in the block dtype
    grad_outputs: torch.Tensor  # [B, T, H] in the block dtype
    prompts: torch.Tensor | None  # [num_blocks, B|1, P, H] with P <= T, or None
    adapter: str
    owner: str = ""  # the peer it came from (set by the core): whose forward's activations it may reuse

    @property
    def has_prompts(self) -> bool:
        return self.prompts is not None


class SessionCache:
    """An open session's KV cache, as an executor hands it out (`EngineExecutor.open_session`). Each executor
    subclasses it with what it needs; an executor refuses (TypeError) a cache of another executor."""

    def __init__(self, spec: SessionSpec):
        self.spec = spec


@dataclass(frozen=True)
class PrefixCacheStats:
    """The prefix cache of one executor: bytes of the pages its index names (held by sessions or idle), cached
    pages evicted so far (for new sessions or past the operator's cap) and that cap in bytes."""

    cached_bytes: int = 0
    evictions: int = 0
    limit_bytes: int | None = None  # the operator's cap on cached pages no session holds (None: none but the cache)


class HandoffUnsupported(ValueError):
    """This executor's cache can't be exported or imported (a layout it can't express, a cache past a handler
    channel's frame, a server with hand-off off): the client replays."""
