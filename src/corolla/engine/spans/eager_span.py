"""A `SpanModel` for the families the engine has no fused kernels for (Gemma, Phi-3, gpt-oss, quantized
DeepSeek-V3, tensor-parallel spans, adapters outside the llama family...): it runs the family's own blocks
(`models/<family>/block.py`) eagerly over the engine's paged `KVPool`. Per layer and step, the positions a block will
read are gathered from the session's pages into the contiguous cache the block expects (`CorollaBlock.forward`'s
`cache`), the block runs, and the positions it wrote are scattered back into the pages.

Every layer keeps every position in the pool (sliding-window layers too: their block gets a ring as long as the
sequence), so beams, rollbacks, KV hand-off and shared pages work the same for every family. Costs one copy of the
read positions per step (the attention reads them anyway), gathered for all layers at once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from corolla.engine.kv.kv_pool import KVLayout, KVPool, SequenceSlot
from corolla.engine.spans.adapter_rows import AdapterRows
from corolla.engine.spans.span_model import SpanModel, add_prompt
from corolla.models.block_base import TensorDescriptor, using_adapter

PROBE_LENGTH_TOKENS = 1 << 30  # descriptors for a sequence this long show a sliding layer's ring capacity
RING_STATE_FIELDS = 2  # a sliding layer's ring state [B, 2] int64: (first held position, end of the written prefix)


@dataclass(frozen=True)
class KVPart:
    """One K/V tensor pair of a block's cache (one per tensor-parallel shard): heads [head_start, head_end) of the
    pool's token shape, on `device`."""

    head_start: int
    head_end: int
    device: torch.device


@runtime_checkable
class CachingBlock(Protocol):
    """What an eager span reads of a block (the `models.block_base.CorollaBlock` contract): its width and the cache
    tensors it keeps for `batch_size` sequences of up to `max_length` tokens."""

    hidden_size: int

    def cache_descriptors(self, batch_size: int, max_length: int) -> list[TensorDescriptor]: ...


@dataclass(frozen=True)
class LayerCacheMap:
    """How one block's contiguous cache (`cache_descriptors`: K and V `[B, heads, length, dim]` per part, then a
    ring state `[B, 2]` int64 for sliding-window layers) maps onto the pool's pages. `ring_capacity_tokens`: the
    positions a sliding layer's ring holds (None: a full-attention layer)."""

    parts: tuple[KVPart, ...]
    ring_capacity_tokens: int | None

    @classmethod
    def of_block(cls, block: CachingBlock) -> tuple[LayerCacheMap, KVLayout]:
        """The map of `block` and the pool layout it needs; ValueError for a cache the pool can't page."""
        descriptors = list(block.cache_descriptors(1, PROBE_LENGTH_TOKENS))
        ring = None
        if descriptors and len(descriptors[-1].shape) == 2:  # a sliding layer's ring state
            state = descriptors.pop()
            if tuple(state.shape) != (1, RING_STATE_FIELDS) or state.dtype != torch.int64:
                raise ValueError(f"The engine can't page a cache tensor of shape {tuple(state.shape)}")
            ring = int(descriptors[0].shape[2])
        if not descriptors or len(descriptors) % 2 or any(len(d.shape) != 4 for d in descriptors):
            raise ValueError("The engine pages caches of K and V [B, heads, length, dim] pairs only")
        parts, heads = [], 0
        k_dim, v_dim = int(descriptors[0].shape[3]), int(descriptors[1].shape[3])
        for k, v in zip(descriptors[::2], descriptors[1::2], strict=True):
            if k.shape[1] != v.shape[1] or (k.shape[3], v.shape[3]) != (k_dim, v_dim):
                raise ValueError("The engine pages K/V pairs of one head count and one head size per layer")
            parts.append(KVPart(heads, heads + int(k.shape[1]), torch.device(k.device)))
            heads += int(k.shape[1])
        layout = KVLayout((heads, k_dim), (heads, v_dim))
        return cls(tuple(parts), ring), layout


@dataclass(frozen=True)
class EagerSpec:
    """The shape facts the engine reads (`span_model.SpanSpec`): windows are the blocks' own business."""

    hidden_size: int
    kv_layout: KVLayout
    sliding_window_tokens: int | None = None


class EagerSpan(SpanModel):
    """Consecutive loaded blocks run one by one over the pool (see the module docstring)."""

    spec: EagerSpec

    supports_graphs = False  # gathers of data-dependent length: no CUDA-graph capture

    def __init__(self, blocks: Sequence[torch.nn.Module], *, max_positions: int):
        if not blocks:
            raise ValueError("An eager span needs at least one block")
        caching = [block for block in blocks if isinstance(block, CachingBlock)]
        if len(caching) != len(blocks):
            raise ValueError("An eager span runs blocks that describe their caches (models.block_base.CorollaBlock)")
        self.layers = list(blocks)  # the blocks themselves
        maps = [LayerCacheMap.of_block(block) for block in caching]
        layouts = {layout for _, layout in maps}
        if len(layouts) != 1:
            raise ValueError(
                f"The blocks of a span must share one KV layout per token, got {sorted(map(str, layouts))}"
            )
        self.maps = [cache_map for cache_map, _ in maps]
        first = caching[0]
        self.spec = EagerSpec(hidden_size=int(first.hidden_size), kv_layout=layouts.pop())
        self.dtype: torch.dtype = first.cache_descriptors(1, 1)[0].dtype  # the pool holds what the blocks cache
        self.device = self.maps[0].parts[0].device  # the pool's (a tensor-parallel span: the first shard's)
        self.max_positions = max_positions
        names = sorted(set().union(*(getattr(b, "adapter_names", set()) for b in self.layers)))
        self.adapters = AdapterRows(names, torch.device("cpu")) if names else None

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for b in self.layers for p in b.parameters())

    # ---- steps

    @torch.inference_mode()
    def decode(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        pool: KVPool,
        layers: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """hidden [B, H] at `positions` [B] -> [B, H]: rows at one position (and adapter) run as one batch, the
        batches in position order (rows of one sequence at consecutive positions, `StepRequest.is_decode`: each
        attends to the keys the rows before it wrote)."""
        span = layers or (0, self.num_layers)
        rows = hidden.shape[0]
        adapters = self.adapters
        ids = [0] * rows if adapters is None or not adapters.decode_enabled else adapters.row_ids[:rows].tolist()
        groups: dict[tuple[int, int], list[int]] = {}
        for row, (position, adapter) in enumerate(zip(positions.tolist(), ids, strict=True)):
            groups.setdefault((position, adapter), []).append(row)
        if len(groups) == 1:
            ((position, adapter),) = groups
            return self._run(hidden[:, None], position, block_tables, pool, span, None, adapter)[:, 0]
        out = torch.empty_like(hidden)  # [B, H]
        tables = block_tables.cpu()
        for (position, adapter), members in sorted(groups.items()):
            index = torch.tensor(members, dtype=torch.long)
            result = self._run(
                hidden[index.to(hidden.device), None], position, tables[index], pool, span, None, adapter
            )
            out[index.to(out.device)] = result[:, 0]
        return out

    def _prefill_chunk(
        self,
        hidden: torch.Tensor,
        start: int,
        slot: SequenceSlot,
        pool: KVPool,
        layers: tuple[int, int],
        prompts: torch.Tensor | None,
    ) -> torch.Tensor:
        """One sequence's chunk: hidden [T, H] at [start, start + T); prompts [n_layers, P, H] -> [T, H]."""
        adapter = 0 if self.adapters is None else self.adapters.prefill_index
        return self._run(hidden[None], start, slot.table[None], pool, layers, prompts, adapter)[0]

    def _run(
        self,
        hidden: torch.Tensor,
        position: int,
        tables: torch.Tensor,
        pool: KVPool,
        layers: tuple[int, int],
        prompts: torch.Tensor | None,
        adapter: int,
    ) -> torch.Tensor:
        """Rows `hidden` [n, T, H] all at `position`, their block tables [n, maxp], through layers [first, end).
        Each layer only reads and writes its own pages, so every layer's positions are gathered before the first
        block runs and the new ones written back after the last (a few ops per step, not per layer)."""
        name = "" if self.adapters is None else self.adapters.name_of(adapter)
        first, end = layers
        num_tokens = hidden.shape[1]
        # flat slot ids of positions [0, position + T) of each row, position-major (the same in every layer):
        # [P + T, n]
        slots = page_slots(tables.cpu().long(), 0, position + num_tokens, pool.page_size_tokens).t().contiguous()
        slots = slots.to(pool.device)
        buffers = [gather_layers(pages[first:end], slots, position) for pages in (pool.k, pool.v)]
        with using_adapter(name):
            for j, i in enumerate(range(first, end)):
                hidden = add_prompt(hidden, None if prompts is None else prompts[j][None], position)
                cache = self._cache_views(i, buffers[0][j], buffers[1][j], position)
                hidden = self.layers[i](hidden, cache=cache, position=position)
                self._collect(i, cache, buffers[0][j], buffers[1][j], position, num_tokens, pool.device)
        new = slots[position:].reshape(-1)  # [T n]
        for pages, buffer in zip((pool.k, pool.v), buffers, strict=True):
            flat = pages[first:end].view(end - first, -1, *pages.shape[3:])  # [layers, pages * page, heads, dim]
            flat.index_copy_(1, new, buffer[:, position:].reshape(end - first, -1, *pages.shape[3:]))
        return hidden

    def _cache_views(self, layer: int, k: torch.Tensor, v: torch.Tensor, position: int) -> list[torch.Tensor]:
        """The contiguous cache block `layer` expects, as views of its gathered K and V [P + T, n, heads, dim]: per
        part [n, heads_p, P + T, dim] (copied to the part's device where it sits elsewhere), then a sliding
        layer's ring state (a ring as long as the sequence: slot p holds position p, every earlier one held)."""
        cache_map = self.maps[layer]
        cache = []
        for part in cache_map.parts:
            for buffer in (k, v):
                view = buffer[:, :, part.head_start : part.head_end].permute(1, 2, 0, 3)  # [n, heads_p, L, dim]
                cache.append(view if part.device == buffer.device else view.to(part.device))
        if cache_map.ring_capacity_tokens is not None:
            state = torch.tensor([[0, position]], dtype=torch.int64, device=cache_map.parts[0].device)
            cache.append(state.expand(k.shape[1], RING_STATE_FIELDS).contiguous())
        return cache

    def _collect(
        self, layer: int, cache: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor, position: int, num_tokens: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        """Brings the positions a part on another device wrote into its copy back into the gathered K and V."""
        end = position + num_tokens
        for p, part in enumerate(self.maps[layer].parts):
            if part.device == device:
                continue  # the block wrote into views of the buffers themselves
            for buffer, written in ((k, cache[2 * p]), (v, cache[2 * p + 1])):
                new = written[:, :, position:end].permute(2, 0, 1, 3)  # [T, n, heads_p, dim]
                buffer[position:end, :, part.head_start : part.head_end] = new.to(device)


def gather_layers(pages: torch.Tensor, slots: torch.Tensor, position: int) -> torch.Tensor:
    """Positions [0, position) of every row from the pages of some layers [layers, pages, page, heads, dim] (`slots`
    [P + T, n] flat slot ids), in a new [layers, P + T, n, heads, dim] whose last T positions are left for the
    blocks to write."""
    num_layers, (length, n) = pages.shape[0], slots.shape
    token = pages.shape[3:]
    flat = pages.view(num_layers, -1, *token)  # [layers, pages * page, heads, dim]
    held = torch.index_select(flat, 1, slots[:position].reshape(-1)).view(num_layers, position, n, *token)
    fresh = torch.empty((num_layers, length - position, n, *token), dtype=pages.dtype, device=pages.device)
    return torch.cat([held, fresh], dim=1)


def page_slots(tables: torch.Tensor, start: int, end: int, page_size: int) -> torch.Tensor:
    """Flat slot ids (page * page_size + offset) of positions [start, end) of each row: [n, end - start] long."""
    positions = torch.arange(start, end)  # [L]
    pages = tables[:, positions // page_size]  # [n, L]
    return pages * page_size + positions % page_size


def read_positions(layer_cache: torch.Tensor, tables: torch.Tensor, start: int, end: int, page_size: int):
    """Positions [start, end) of each row from one layer's pages [pages, page, *token]: [n, end - start, *token]."""
    flat = layer_cache.view(-1, *layer_cache.shape[2:])  # [pages * page, *token]
    return flat[page_slots(tables, start, end, page_size).to(flat.device)]


def write_positions(layer_cache: torch.Tensor, tables: torch.Tensor, start: int, values: torch.Tensor, page_size: int):
    """Stores `values` [n, T, *token] at positions [start, start + T) of each row in one layer's pages."""
    flat = layer_cache.view(-1, *layer_cache.shape[2:])
    slots = page_slots(tables, start, start + values.shape[1], page_size).to(flat.device)
    flat[slots] = values.to(flat.dtype)
