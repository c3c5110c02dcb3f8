"""The seam between `SpanEngine` and one kind of fused span: a `SpanModel` runs a batched single-token decode step
over ragged positions (CUDA-graph safe) and a chunked prefill of one sequence over a paged `KVPool`, and its `spec`
says what one token takes in that pool per layer (`KVLayout`). Implemented by `fast_llama.FastLlamaSpan`
(llama-family attention: K/V heads), `fast_mla.FastMlaSpan` (DeepSeek-V3: latent + rotary key) and
`fast_dense.FastDenseSpan` (Falcon, BLOOM: K/V heads, rotary or ALiBi)."""

from __future__ import annotations

from typing import Protocol

import torch

from corolla.engine.kv.kv_pool import KVLayout, KVPool, SequenceSlot


class SpanSpec(Protocol):
    """The shape facts of a span the engine reads (`LlamaSpec`, `MlaSpec`)."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def sliding_window_tokens(self) -> int | None: ...

    @property
    def kv_layout(self) -> KVLayout: ...


class SpanModel(Protocol):
    """Consecutive fused decoder layers the engine drives (see the module docstring)."""

    @property
    def spec(self) -> SpanSpec: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def max_positions(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    def weight_bytes(self) -> int:
        """Bytes of all layers' weights (what a batch-1 decode step of a dense span reads)."""
        ...

    def tune(self) -> dict:
        """Picks kernels by timing them on this device (may be a no-op); returns the timings."""
        ...

    def decode(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        pool: KVPool,
        layers: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """hidden [B, H], positions [B] long, block_tables [B, maxp] int32 -> [B, H]; static shapes, no host sync."""
        ...

    def prefill(
        self,
        hidden: torch.Tensor,
        start: int,
        slot: SequenceSlot,
        pool: KVPool,
        *,
        chunk_tokens: int,
        layers: tuple[int, int] | None = None,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One sequence: hidden [T, H] at positions [start, start + T); prompts [n_layers, P, H] -> [T, H]."""
        ...


def row_slots(block_tables: torch.Tensor, positions: torch.Tensor, page: int) -> torch.Tensor:
    """The flat cache slot [N] long of each row's position: block_tables [N, maxp] int32, positions [N] long."""
    pages = block_tables.gather(1, (positions // page)[:, None]).squeeze(1).long()
    return pages * page + positions % page


class ChunkedPrefill:
    """The `prefill` every span type shares: the sequence in chunks of at most `chunk_tokens` tokens, each run by the
    span's own `_prefill_chunk(chunk [t, H], chunk_start, slot, pool, (first, last), prompts) -> [t, H]`."""

    @property
    def num_layers(self) -> int:
        raise NotImplementedError

    def _prefill_chunk(
        self,
        hidden: torch.Tensor,
        start: int,
        slot: SequenceSlot,
        pool: KVPool,
        layers: tuple[int, int],
        prompts: torch.Tensor | None,
    ) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def prefill(
        self,
        hidden: torch.Tensor,
        start: int,
        slot: SequenceSlot,
        pool: KVPool,
        *,
        chunk_tokens: int,
        layers: tuple[int, int] | None = None,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One sequence through layers [first, last) (default: all): hidden [T, H] at positions [start, start + T)
        attending causally to [0, start + T); `prompts` [n_layers, P, H] (deep prompts) are added to the input of
        each layer at positions < P. Runs in chunks of `chunk_tokens` tokens. Returns [T, H]."""
        span = layers or (0, self.num_layers)
        outputs = [
            self._prefill_chunk(hidden[offset : offset + chunk_tokens], start + offset, slot, pool, span, prompts)
            for offset in range(0, hidden.shape[0], chunk_tokens)
        ]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
