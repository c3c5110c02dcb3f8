"""The seam between `SpanEngine` and one kind of span: a `SpanModel` runs a batched single-token decode step over
ragged positions (CUDA-graph safe) and a chunked prefill of one sequence over a paged `KVPool`, and its `spec` says
what one token takes in that pool per layer (`KVLayout`). Its kinds: `fast_llama.FastLlamaSpan` (llama-family
attention: K/V heads), `fast_mla.FastMlaSpan` (DeepSeek-V3: latent + rotary key), `fast_dense.FastDenseSpan`
(Falcon, BLOOM: K/V heads, rotary or ALiBi) and `eager_span.EagerSpan` (any family's own blocks)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from corolla.engine.kv.kv_pool import KVLayout, KVPool, SequenceSlot
from corolla.engine.quant.quant_weights import Int8Weight, NF4Weight
from corolla.models.positions import RotaryEmbedding


class SpanSpec(Protocol):
    """The shape facts of a span the engine reads (`LlamaSpec`, `MlaSpec`)."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def sliding_window_tokens(self) -> int | None: ...

    @property
    def kv_layout(self) -> KVLayout: ...


def table_slots(table: torch.Tensor, positions: torch.Tensor, page: int) -> torch.Tensor:
    """The flat cache slot [N] long of each of `positions` [N] long in a sequence whose pages `table` [maxp] int32
    names."""
    return table.index_select(0, positions // page).long() * page + positions % page


def static_rotary(rotary: object, max_positions: int, device: torch.device) -> tuple[torch.Tensor, float]:
    """A block's `rotary` as fixed tables of `max_positions` positions: its frequencies [D/2] fp32 and the factor of
    its cos and sin (ValueError for no rotary embedding, or one whose frequencies change inside that range: dynamic
    NTK past `max_position_embeddings`, LongRoPE's long factors past `original_max_position_embeddings`)."""
    if not isinstance(rotary, RotaryEmbedding):
        raise ValueError("The fast path needs rotary position embeddings")
    if rotary.switch_length is not None and max_positions > rotary.switch_length:
        raise ValueError(
            f"{rotary.rope_type} rope changes its frequencies past {rotary.switch_length} positions; "
            f"lower max_seq_len_tokens"
        )
    return rotary.inv_freq(device, 0), rotary.attention_scaling


def tensors_nbytes(values: Iterable[object]) -> int:
    """Bytes of the tensors and quantized weights (`nbytes()`, as stored) among `values` (a layer's fields)."""
    total = 0
    for t in values:
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
        elif isinstance(t, NF4Weight | Int8Weight):
            total += t.nbytes()
    return total


def add_prompt(hidden: torch.Tensor, prompt: torch.Tensor | None, position: int) -> torch.Tensor:
    """`hidden` [n, T, H] at [position, position + T) plus a deep prompt [1, P, H] where positions < P."""
    if prompt is None:
        return hidden
    overlap = min(prompt.shape[1] - position, hidden.shape[1])
    if overlap <= 0:
        return hidden
    head = hidden[:, :overlap] + prompt[:, position : position + overlap].to(hidden.dtype)  # [n, overlap, H]
    return torch.cat([head, hidden[:, overlap:]], dim=1)


@dataclass(frozen=True)
class PrefillChunk:
    """Where one prefill chunk of a sequence sits: its T tokens at [start, start + T) attend to the L = start + T
    keys at `key_positions` [L] long, whose flat cache slots are `key_slots` [L] long."""

    start: int
    key_positions: torch.Tensor  # [L]
    key_slots: torch.Tensor  # [L]

    @property
    def positions(self) -> torch.Tensor:
        return self.key_positions[self.start :]  # [T]

    @property
    def slots(self) -> torch.Tensor:
        return self.key_slots[self.start :]  # [T]


class SpanModel:
    """Consecutive decoder layers the engine drives (see the module docstring), the base of every kind of span: its
    `layers` (each with `nbytes()`, or the span counts their bytes itself), the batched `decode` step each kind
    implements, and the `prefill` that runs a sequence in chunks of at most `chunk_tokens` tokens, each by
    `_prefill_chunk`: for the fused spans the chunk's positions and cache slots once (`PrefillChunk`), what each layer
    of the chunk reads besides (`_chunk_state`: adapters, ALiBi's bias), then per layer its deep prompt and the span's
    `_prefill_layer`."""

    spec: SpanSpec
    layers: list
    device: torch.device
    dtype: torch.dtype
    max_positions: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def weight_bytes(self) -> int:
        """Bytes of all layers' weights (what a batch-1 decode step of a dense span reads)."""
        return sum(layer.nbytes() for layer in self.layers)

    def tune(self) -> dict:
        """Picks kernels by timing them on this device (default: nothing to pick); returns the timings."""
        return {}

    def decode(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        pool: KVPool,
        layers: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """One token per row through layers [start, end) (default: all): hidden [B, H]; positions [B] long (row b
        writes at positions[b] and attends to [0, positions[b]]); block_tables [B, maxp] int32. Returns [B, H].
        Static shapes, no host sync (the fused kinds)."""
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
        """One sequence's chunk: hidden [T, H] at [start, start + T) through layers [first, last); prompts
        [n_layers, P, H] -> [T, H]."""
        keys = torch.arange(start + hidden.shape[0], device=self.device)  # [L]
        table = slot.table.to(self.device, non_blocking=True)  # [maxp]
        chunk = PrefillChunk(start, keys, table_slots(table, keys, pool.page_size_tokens))
        state = self._chunk_state(chunk)
        h = hidden
        for j, i in enumerate(range(*layers)):
            if prompts is not None:
                h = add_prompt(h[None], prompts[j][None], start)[0]  # [T, H]
            h = self._prefill_layer(i, h, chunk, pool, state)
        return h

    def _chunk_state(self, chunk: PrefillChunk) -> Any:
        """What every layer of `chunk` reads besides its positions (None: nothing)."""
        return None

    def _prefill_layer(self, i: int, h: torch.Tensor, chunk: PrefillChunk, pool: KVPool, state: Any) -> torch.Tensor:
        """Layer i over a chunk's hidden states h [T, H] (its keys and values written to `pool`) -> [T, H]."""
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
