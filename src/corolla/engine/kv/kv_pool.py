"""A server-wide KV cache preallocated once: per layer, pages of `page_size_tokens` tokens of two per-token tensors
(a `KVLayout`: K and V heads for standard attention; MLA's compressed latent and shared rotary key), handed out to
sequences as block tables (lists of page ids), so sessions of any length share one pool. A sequence is promised its
pages when it opens (`allocate`: counted, no id taken) and takes them as its tokens arrive (`grow`), so a cache is
charged for the tokens a session holds while the promise still guarantees it its maximum length. A sequence over
layers [first, end) holds its page ids in those layers only (one block table for all of them): the same id stays free
in the other layers for sequences over other blocks. Page 0 is never handed out: padded batch rows write there.

Prefix caching (docs/decisions/0082): pages are counted per (layer, page) by the sequences that hold them; a sequence
may start with pages another one published in the `PrefixIndex` (`attach_prefix`), and a page it shares or published
is never written in place (`prepare_write` gives it its own copy first, out of its promise). Published pages stay
cached when their last holder lets go; a promise that finds too few free pages evicts the least recently used of
those (a held page is never taken), and an operator's cap (`prefix_cache_tokens` positions per layer) bounds the
cached pages no sequence holds: past it the least recently used go at once."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from corolla.engine.kv.prefix_index import PageBlock, PrefixIndex, PrefixKey
from corolla.utils.errors import AllocationFailed
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

TRASH_PAGE = 0


@dataclass(frozen=True)
class KVLayout:
    """What one token occupies in one layer's cache: the pool's tensor `k` holds `k_token_shape` per token and `v`
    holds `v_token_shape`. Standard attention: K and V heads, `(kv_heads, head_dim)` each. Multi-head latent
    attention: `k` the normalized latent `(1, kv_lora_rank)`, `v` the rotary key shared by all heads
    `(1, qk_rope_head_dim)` (never per-head K/V)."""

    k_token_shape: tuple[int, ...]
    v_token_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        for shape in (self.k_token_shape, self.v_token_shape):
            if not shape or any(int(d) < 1 for d in shape):
                raise ValueError(f"KVLayout token shapes must be non-empty and positive, got {shape}")

    @property
    def values_per_token(self) -> int:
        """Cache values one token takes in one layer (both tensors)."""
        return math.prod(self.k_token_shape) + math.prod(self.v_token_shape)

    def bytes_per_token(self, dtype: torch.dtype, num_layers: int = 1) -> int:
        """Bytes one token takes across `num_layers` layers in `dtype`."""
        return num_layers * self.values_per_token * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def heads(cls, num_kv_heads: int, head_dim: int) -> KVLayout:
        """Standard attention: K and V of `num_kv_heads` heads of `head_dim`."""
        return cls((num_kv_heads, head_dim), (num_kv_heads, head_dim))

    @classmethod
    def latent(cls, kv_lora_rank: int, rope_dim: int) -> KVLayout:
        """Multi-head latent attention: the latent and the shared rotary key."""
        return cls((1, kv_lora_rank), (1, rope_dim))


@dataclass(eq=False)
class SequenceSlot:
    """One sequence's pages (a block table, held in layers [first, end)) and a host copy of it padded to the pool's
    `max_pages_per_seq`: `pages` taken so far in position order, `promised_pages` more it may still take."""

    pages: list[int]
    table: torch.Tensor  # [max_pages_per_seq] int32, CPU; unused entries point to the trash page
    capacity_tokens: int  # the whole pages promised at open: the sequence's maximum length, rounded up
    layers: tuple[int, int]
    promised_pages: int = 0
    length_tokens: int = 0  # positions [0, length) hold valid keys/values
    freed: bool = field(default=False)
    # pages [0, shared_pages) may be held by other sequences too or published in the prefix index: a write there
    # goes through `KVPool.prepare_write` first (every later page is the sequence's own)
    shared_pages: int = 0
    # promised pages that growth to the full length won't need: one per page of an attached prefix, kept for its
    # copy on write (so that a session admitted for its length never waits for a page later)
    spare_pages: int = 0
    # `table`'s memory as numpy, made once: the pool writes page ids through it (no torch call on the device thread
    # each time a page fills: a tensor built and a copy dispatched, ~8 us on the dev VM, handing the GIL away)
    table_np: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.table_np = self.table.numpy()


class KVPool:
    """Cache storage `k` [num_layers, num_pages, page_size, *layout.k_token_shape] and `v` [..., *layout.v_token_shape]
    plus a free set per layer and a count per layer of pages promised but not yet taken.

    `allocate(num_sequences, max_length_tokens, layers)` promises whole pages in those layers (scarcity ->
    `AllocationFailed`, never a partial promise); `grow(slots, length_tokens)` takes promised pages as positions are
    written; `withdraw`/`restore` take a promise back (in part) and give it again (admission's levers against
    sessions that hold promises without using them); `free(slots)` returns what was taken and drops what was
    promised. Thread-safe.

    The promise is exact for sequences over one layer range (a server's sessions over its whole span): the pages free
    in all those layers never drop below the pages promised there. Sequences over different ranges may fragment the
    ids (free in each layer but not one id free in all of a range's layers): `allocate` then counts only the ids free
    in every layer of the range against the largest promise among them, and a `grow` that still finds no common id
    fails with AllocationFailed (the session ends; its client replays it elsewhere)."""

    def __init__(
        self,
        *,
        num_layers: int,
        layout: KVLayout,
        num_pages: int,
        page_size_tokens: int,
        max_pages_per_seq: int,
        dtype: torch.dtype,
        device: torch.device | str,
        prefix_cache_tokens: int | None = None,
    ):
        if num_pages < 2:
            raise ValueError(f"KVPool needs at least 2 pages (one is reserved), got {num_pages}")
        self.num_layers = num_layers
        self.layout = layout
        self.num_pages = num_pages
        self.page_size_tokens = page_size_tokens
        self.max_pages_per_seq = max_pages_per_seq
        self.dtype = dtype
        self.device = torch.device(device)
        pages = (num_layers, num_pages, page_size_tokens)
        # Filled with zeros once so that the trash page and unwritten slots never hold NaN/Inf garbage.
        self.k = torch.zeros((*pages, *layout.k_token_shape), dtype=dtype, device=self.device)
        self.v = torch.zeros((*pages, *layout.v_token_shape), dtype=dtype, device=self.device)
        self._free: list[set[int]] = [set(range(TRASH_PAGE + 1, num_pages)) for _ in range(num_layers)]
        self._free_everywhere = set(range(TRASH_PAGE + 1, num_pages))  # ids free in every layer (whole-span growth)
        self._free_layer_pages = num_layers * (num_pages - 1)  # free (layer, page) cells, all layers
        self._promised = [0] * num_layers  # pages promised to sequences and not yet taken, per layer
        self._promised_layer_pages = 0
        # sequences holding each (layer, page); a page none holds is free, or cached if the prefix index names it
        self._refs = np.zeros((num_layers, num_pages), dtype=np.int32)
        self.prefix_index = PrefixIndex()
        self.num_evictions = 0  # cached pages taken back for promises or over the operator's cap
        if prefix_cache_tokens is not None and prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0 or None, got {prefix_cache_tokens}")
        # the operator's cap on cached pages no sequence holds, in layer pages (None: as many as the pool has free)
        self.idle_cache_layer_pages = (
            None if prefix_cache_tokens is None else prefix_cache_tokens // page_size_tokens * num_layers
        )
        self._lock = threading.Lock()
        logger.info(
            f"kv_pool.create(pages={num_pages}, page_tokens={page_size_tokens}, layers={num_layers}, "
            f"bytes_per_token={layout.bytes_per_token(dtype, num_layers)}, "
            f"GiB={num_pages * self.page_bytes / 2**30:.2f}, device={self.device})"
        )

    @classmethod
    def bytes_per_page(cls, *, num_layers: int, layout: KVLayout, page_size_tokens: int, dtype: torch.dtype) -> int:
        """Bytes of one page over all layers (both tensors)."""
        return page_size_tokens * layout.bytes_per_token(dtype, num_layers)

    @property
    def page_bytes(self) -> int:
        """Bytes of one of this pool's pages over all its layers (both tensors)."""
        return self.bytes_per_page(
            num_layers=self.num_layers, layout=self.layout, page_size_tokens=self.page_size_tokens, dtype=self.dtype
        )

    @property
    def layer_page_bytes(self) -> int:
        """Bytes of one page in one layer (both tensors)."""
        return self.page_bytes // self.num_layers

    @property
    def layer_pages_free(self) -> int:
        """Pages neither held nor promised, summed over the layers (a page free in n layers counts n times): what
        new sequences may be promised (cached pages no sequence holds included: a promise evicts them)."""
        with self._lock:
            return self._free_layer_pages - self._promised_layer_pages + self.prefix_index.idle_layer_pages

    @property
    def layer_pages_taken(self) -> int:
        """Pages that hold some sequence's positions, summed over the layers (cached pages none holds excluded)."""
        with self._lock:
            idle = self.prefix_index.idle_layer_pages
            return self.num_layers * (self.num_pages - 1) - self._free_layer_pages - idle

    @property
    def layer_pages_cached(self) -> int:
        """Pages the prefix index names (held by sequences or idle), summed over their layers."""
        with self._lock:
            return self.prefix_index.layer_pages

    @property
    def cached_bytes(self) -> int:
        """Bytes of the pages the prefix index names."""
        return self.layer_pages_cached * self.layer_page_bytes

    @property
    def idle_cache_limit_bytes(self) -> int | None:
        """The operator's cap on cached pages no sequence holds, in bytes (None: no cap but the pool)."""
        cap = self.idle_cache_layer_pages
        return None if cap is None else cap * self.layer_page_bytes

    @property
    def pages_free(self) -> int:
        """Free pages in whole-pool units (all layers): `layer_pages_free // num_layers`."""
        return self.layer_pages_free // self.num_layers

    @property
    def pages_free_in_every_layer(self) -> int:
        """Pages a new sequence over every layer can still be promised: ids free in all layers less the largest
        promise of any layer, idle cached pages counted (a promise evicts them). Sequences over parts of the layers
        fill them unevenly, so this can be far below `pages_free` (the layers' mean): it is the room a server
        announces, since clients read its free cache as room for sessions over its span (decision 0036)."""
        with self._lock:
            common = self._common_free(0, self.num_layers) + self._evictable(0, self.num_layers)
            return max(0, common - max(self._promised))

    def check_layers(self, layers: tuple[int, int] | None) -> tuple[int, int]:
        """[first, end) of this pool's layers (default: all); ValueError for a bad range."""
        first, end = layers or (0, self.num_layers)
        if not 0 <= first < end <= self.num_layers:
            raise ValueError(f"layers must satisfy 0 <= first < end <= {self.num_layers}, got {(first, end)}")
        return first, end

    def pages_for(self, max_length_tokens: int) -> int:
        """Whole pages a sequence of `max_length_tokens` is promised (at least one)."""
        return max(1, -(-max_length_tokens // self.page_size_tokens))

    def allocate(
        self, num_sequences: int, max_length_tokens: int, layers: tuple[int, int] | None = None
    ) -> list[SequenceSlot]:
        """Promises `num_sequences` sequences of up to `max_length_tokens` each the pages of that length in layers
        [first, end) (default: all), all or nothing; no page is taken until `grow`. Where free pages are short,
        cached pages no sequence holds are evicted for it, least recently used first (none if even all of them
        would not do)."""
        if num_sequences < 1:
            raise ValueError(f"num_sequences must be >= 1, got {num_sequences}")
        if max_length_tokens < 0:
            raise ValueError(f"max_length_tokens must be >= 0, got {max_length_tokens}")
        first, end = self.check_layers(layers)
        per_seq = self.pages_for(max_length_tokens)
        if per_seq > self.max_pages_per_seq:
            raise ValueError(
                f"Cannot allocate KV cache for {max_length_tokens} tokens, max = "
                f"{self.max_pages_per_seq * self.page_size_tokens}"
            )
        needed = per_seq * num_sequences
        with self._lock:
            available = self._room(needed, first, end)
            if needed > available:
                raise AllocationFailed(
                    f"KV pool is full: need {needed} pages ({num_sequences} x {max_length_tokens} tokens), "
                    f"{max(0, available)} of {self.num_pages - 1} free in layers {first}:{end}"
                )
            for layer in range(first, end):
                self._promised[layer] += needed
            self._promised_layer_pages += needed * (end - first)
        capacity = per_seq * self.page_size_tokens
        return [
            SequenceSlot(
                pages=[],
                table=torch.full((self.max_pages_per_seq,), TRASH_PAGE, dtype=torch.int32),
                capacity_tokens=capacity,
                layers=(first, end),
                promised_pages=per_seq,
            )
            for _ in range(num_sequences)
        ]

    def grow(self, slots: Sequence[SequenceSlot], length_tokens: int) -> None:
        """Takes pages so that each slot holds positions [0, `length_tokens`): a no-op while the pages it has cover
        them (most steps). Promised pages first (never the spares kept for copies on write), then (a promise
        withdrawn in part: `withdraw`) pages nobody was promised. ValueError past a slot's capacity; AllocationFailed
        for a freed slot, a withdrawn promise that no free page covers, or where ids of sequences over other layer
        ranges left no page free in all of its layers."""
        size = self.page_size_tokens
        for slot in slots:
            need = -(-length_tokens // size) - len(slot.pages)
            if need <= 0:
                continue
            with self._lock:
                if slot.freed:
                    raise AllocationFailed("The sequence's pages were returned to the pool (its session ended)")
                if length_tokens > slot.capacity_tokens:
                    raise ValueError(
                        f"{length_tokens} tokens exceed the sequence's {slot.capacity_tokens} tokens promised at open"
                    )
                first, end = slot.layers
                promised = min(need, slot.promised_pages - slot.spare_pages)
                unpromised = need - promised
                if unpromised and unpromised > self._room(unpromised, first, end):
                    raise AllocationFailed(
                        f"KV cache is full: this session needs {unpromised} more pages and the rest of its "
                        f"promise went to another session while it processed no token; replay it here later "
                        f"or elsewhere"
                    )
                taken = self._take(need, first, end)
                start = len(slot.pages)
                slot.pages.extend(taken)
                slot.table_np[start : start + need] = taken
                self._unpromise(slot, promised)

    def withdraw(self, slots: Sequence[SequenceSlot], pages_per_slot: int) -> int:
        """Drops up to `pages_per_slot` of each slot's promise (pages not yet taken, spares for copies on write last;
        they go to whoever is promised them next); returns the pages withdrawn. The slots keep the pages they
        hold."""
        withdrawn = 0
        with self._lock:
            for slot in slots:
                if not slot.freed:
                    count = min(pages_per_slot, slot.promised_pages)
                    self._unpromise(slot, count)
                    slot.spare_pages = min(slot.spare_pages, slot.promised_pages)
                    withdrawn += count
        return withdrawn

    def restore(self, slots: Sequence[SequenceSlot]) -> bool:
        """Promises each slot again the pages up to its capacity that it neither holds nor is promised (and the
        spares it still keeps), all or nothing; False (nothing changed) where the pool can't promise them now."""
        with self._lock:
            if any(slot.freed for slot in slots):
                return False
            missing = [
                max(0, self.pages_for(slot.capacity_tokens) - len(slot.pages) + slot.spare_pages - slot.promised_pages)
                for slot in slots
            ]
            needed = sum(missing)
            if needed == 0:
                return True
            first, end = slots[0].layers
            if needed > self._unpromised(first, end):
                return False
            for slot, count in zip(slots, missing, strict=True):
                self._unpromise(slot, -count)
        return True

    def _unpromise(self, slot: SequenceSlot, count: int) -> None:
        """`count` of the slot's promised pages are taken or dropped (negative: promised again); under the lock."""
        first, end = slot.layers
        slot.promised_pages -= count
        for layer in range(first, end):
            self._promised[layer] -= count
        self._promised_layer_pages -= count * (end - first)

    def _evictable(self, first: int, end: int) -> int:
        """Ids not free in all of [first, end) now that would be if every idle cached page were evicted."""
        ranges = self.prefix_index.idle_by_layers
        if all(b_first <= first and end <= b_end for b_first, b_end in ranges):
            return sum(ranges.values())  # (the usual case, one span: no page to look at) each frees its id in all
        covered: dict[int, set[int]] = {}  # page -> layers of [first, end) where an idle block holds it
        for (b_first, b_end), page in self.prefix_index.idle_blocks():
            if b_first < end and first < b_end:
                covered.setdefault(page, set()).update(range(max(first, b_first), min(end, b_end)))
        free = self._free
        return sum(
            all(layer in layers or page in free[layer] for layer in range(first, end))
            for page, layers in covered.items()
        )

    def _unpromised(self, first: int, end: int) -> int:
        """Ids free in every layer of [first, end) beyond the largest promise there (under the lock)."""
        return self._common_free(first, end) - max(self._promised[first:end])

    def _room(self, needed: int, first: int, end: int) -> int:
        """What may be promised over [first, end), after evicting idle cached pages, least recently used first, until
        `needed` pages fit where evicting them all would make them fit (under the lock)."""
        available = self._unpromised(first, end)
        if not available < needed <= available + self._evictable(first, end):
            return available
        while needed > available:
            self._evict_one((first, end))
            available = self._unpromised(first, end)
        logger.debug(f"kv_pool.evicted(total={self.num_evictions}, layers={first}:{end})")
        return available

    def _evict_one(self, layers: tuple[int, int]) -> None:
        """The least recently used idle cached page over `layers` goes back to the free sets (under the lock)."""
        block = self.prefix_index.evict(layers)
        assert block is not None, "idle pages are counted"
        self._return_block(block)
        self.num_evictions += 1

    def _return_block(self, block: PageBlock) -> None:
        """A page no sequence holds and no key names goes back to the free sets (under the lock)."""
        (first, end), page = block
        for layer in range(first, end):
            self._free[layer].add(page)
        self._free_layer_pages += end - first
        if end - first == self.num_layers or all(page in f for f in self._free):
            self._free_everywhere.add(page)

    def _release(self, layers: tuple[int, int], page: int) -> None:
        """One holder lets go of a page: with none left it is cached (idle) if the prefix index names it, else
        free (under the lock)."""
        first, end = layers
        self._refs[first:end, page] -= 1
        left = int(self._refs[first, page])
        assert left >= 0, f"page {page} of layers {first}:{end} let go more often than held"
        if left == 0:
            block = (layers, page)
            if self.prefix_index.key_of(block) is not None:
                self.prefix_index.set_idle(block)
                self._evict_over_cap()
            else:
                self._return_block(block)

    def _evict_over_cap(self) -> None:
        """Evicts idle cached pages, least recently used first, while they exceed the operator's cap (under the
        lock)."""
        cap = self.idle_cache_layer_pages
        while cap is not None and self.prefix_index.idle_layer_pages > cap:
            self._evict_one((0, self.num_layers))

    def _common_free(self, first: int, end: int) -> int:
        """Ids free in every layer of [first, end) (under the lock)."""
        if end - first == self.num_layers:
            return len(self._free_everywhere)
        if end - first == 1:
            return len(self._free[first])
        return len(set.intersection(*self._free[first:end]))

    def _take(self, count: int, first: int, end: int) -> list[int]:
        """`count` ids free in every layer of [first, end), marked taken there (under the lock). A sub-range takes
        ids already taken in other layers first, leaving whole free columns to sequences over every layer."""
        if end - first == self.num_layers:
            candidates = self._free_everywhere
            if len(candidates) < count:
                raise AllocationFailed(f"KV pool is full: need {count} pages, {len(candidates)} free in all layers")
            taken = [candidates.pop() for _ in range(count)]
        else:
            others, everywhere = self._free[first + 1 : end], self._free_everywhere
            packed = (p for p in self._free[first] if p not in everywhere and all(p in f for f in others))
            taken = list(itertools.islice(packed, count))
            if len(taken) < count:
                taken += itertools.islice(everywhere, count - len(taken))
            if len(taken) < count:
                raise AllocationFailed(
                    f"KV pool is fragmented: need {count} pages free in all of layers {first}:{end}, found "
                    f"{len(taken)}; the session ends and its client replays it"
                )
            self._free_everywhere.difference_update(taken)
        for layer in range(first, end):
            self._free[layer].difference_update(taken)
        self._free_layer_pages -= count * (end - first)
        self._refs[first:end, taken] = 1
        return taken

    def free(self, slots: Sequence[SequenceSlot]) -> None:
        """Lets go of the slots' pages and drops what they were still promised (idempotent per slot): a page the
        prefix index names stays cached once no sequence holds it, the others are free again."""
        with self._lock:
            for slot in slots:
                if slot.freed:
                    continue
                slot.freed = True
                first, end = slot.layers
                self._unpromise(slot, slot.promised_pages)
                if not slot.shared_pages:  # every page its own and unpublished: one update for all
                    self._refs[first:end, slot.pages] = 0
                    for layer in range(first, end):
                        self._free[layer].update(slot.pages)
                    self._free_layer_pages += len(slot.pages) * (end - first)
                    if end - first == self.num_layers:
                        self._free_everywhere.update(slot.pages)
                    else:
                        free = self._free
                        self._free_everywhere.update(p for p in slot.pages if all(p in f for f in free))
                    continue
                for page in slot.pages:
                    self._release(slot.layers, page)

    # ---- prefix caching: attach, publish, copy on write

    def attach_prefix(self, slot: SequenceSlot, keys: Sequence[PrefixKey]) -> int:
        """Makes the longest run of indexed pages named by `keys` (`keys[i]` names the page that ends at position
        `(i + 1) * page_size_tokens`) the first pages of a fresh sequence; returns how many. The sequence's length
        becomes their positions; its promise keeps one spare page per attached page for a copy on write."""
        if slot.pages or slot.length_tokens or slot.freed:
            raise ValueError("a prefix is attached only to a fresh sequence (no page taken, length 0)")
        first, end = slot.layers
        capacity = slot.capacity_tokens // self.page_size_tokens
        with self._lock:
            for key in keys[:capacity]:
                page = self.prefix_index.get(key)
                if page is None or key.layers != slot.layers:
                    break
                if self.prefix_index.is_idle((slot.layers, page)):
                    self.prefix_index.set_held((slot.layers, page))
                self._refs[first:end, page] += 1
                slot.table_np[len(slot.pages)] = page
                slot.pages.append(page)
            attached = len(slot.pages)
            slot.shared_pages = slot.spare_pages = attached
            slot.length_tokens = attached * self.page_size_tokens
        return attached

    def publish(self, slot: SequenceSlot, index: int, key: PrefixKey) -> bool:
        """Indexes page `index` of the sequence under `key`; False (nothing changes) if the key or the page is
        indexed already or the page's positions are not all computed (a rewrite may have cut the length meanwhile).
        The sequence then writes that page no more in place."""
        if key.layers != slot.layers:
            raise ValueError(f"a key of layers {key.layers} can't name a page of a sequence over {slot.layers}")
        with self._lock:  # (the length is read under the lock: `prepare_write` cuts it there before a rewrite)
            if (index + 1) * self.page_size_tokens > slot.length_tokens or index >= len(slot.pages):
                return False
            if slot.freed or not self.prefix_index.insert(key, slot.pages[index]):
                return False
            slot.shared_pages = max(slot.shared_pages, index + 1)
        return True

    @torch.no_grad()
    def prepare_write(self, slot: SequenceSlot, start: int) -> None:
        """Before a write of positions from `start` on: the sequence's length drops to `start` if it was longer
        (positions from there on are being rewritten: none of their pages may be published meanwhile), and every
        page from the one holding `start` to the end of the shared run becomes the sequence's own. A page others hold too is replaced by a new one (copied if it holds
        positions before `start`; later positions lie past the sequence's new length), taken from the promise's
        spares or else from the free pages (AllocationFailed if none, the sequence unchanged); a published page only
        this sequence holds is replaced the same way while spares last (its cached copy stays valid), else leaves the
        index and is written in place. Runs on the thread that writes the pages (the device thread)."""
        size = self.page_size_tokens
        start_index = start // size
        if start >= slot.length_tokens and start_index >= slot.shared_pages:
            return  # the usual step: it appends, and nothing at or after `start` is shared
        if start_index >= slot.shared_pages:
            with self._lock:
                slot.length_tokens = min(slot.length_tokens, start)
            return
        first, end = slot.layers
        copies: list[tuple[int, int]] = []  # (shared page, own page): copied before the shared one is let go
        replaced: list[int] = []
        with self._lock:
            replace: list[int] = []  # table indices that get a page of their own
            unpublish: list[int] = []  # pages only this sequence holds that leave the index
            for index in range(start_index, min(slot.shared_pages, len(slot.pages))):
                page = slot.pages[index]
                indexed = self.prefix_index.key_of((slot.layers, page)) is not None
                if int(self._refs[first, page]) > 1 or (indexed and len(replace) < slot.spare_pages):
                    replace.append(index)
                elif indexed:
                    unpublish.append(page)
            from_spares = min(len(replace), slot.spare_pages)
            extra = len(replace) - from_spares
            if extra and extra > (available := self._room(extra, first, end)):  # pages no promise counts on
                raise AllocationFailed(
                    f"KV pool is full: a write into {extra} shared pages needs pages of its own, "
                    f"{max(0, available)} free in layers {first}:{end}"
                )
            taken = self._take(len(replace), first, end) if replace else []
            self._unpromise(slot, from_spares)
            slot.spare_pages -= from_spares
            for page in unpublish:
                self.prefix_index.remove((slot.layers, page))
            for index, own in zip(replace, taken, strict=True):
                page = slot.pages[index]
                if index == start_index and start % size:
                    copies.append((page, own))
                slot.pages[index] = own
                slot.table_np[index] = own
                replaced.append(page)
            slot.shared_pages = start_index
            slot.length_tokens = min(slot.length_tokens, start)
        for shared, own in copies:  # still held by this sequence until released below: nobody takes it meanwhile
            self.k[first:end, own] = self.k[first:end, shared]
            self.v[first:end, own] = self.v[first:end, shared]
        if replaced:
            with self._lock:
                for page in replaced:
                    self._release(slot.layers, page)

    @torch.no_grad()
    def reorder(self, slots: Sequence[SequenceSlot], hypo_ids: torch.Tensor) -> None:
        """Beam-search reordering: sequence i takes the keys/values (and length) of sequence `hypo_ids[i]` (int64
        [len(slots)] in [0, len(slots)): checked by `SpanEngine.check_inputs`)."""
        order = hypo_ids.tolist()
        if order == list(range(len(slots))):
            return
        # beams never attach or publish (prefix keys name one sequence): the pages written in place are their own
        assert not any(s.shared_pages for s in slots), "reorder of sequences that share pages"
        used = max(self.pages_for(max(s.length_tokens for s in slots)), 1)
        src = torch.tensor([slots[i].pages[:used] for i in order], dtype=torch.long).flatten()
        dst = torch.tensor([s.pages[:used] for s in slots], dtype=torch.long).flatten()
        src, dst = src.to(self.device), dst.to(self.device)
        first, end = slots[0].layers  # one session's rows: other layers' pages may belong to other sessions
        # the right side is gathered into a new tensor first: no overlap hazard
        self.k[first:end, dst] = self.k[first:end, src]
        self.v[first:end, dst] = self.v[first:end, src]
        lengths = [slots[i].length_tokens for i in order]
        for slot, length in zip(slots, lengths, strict=True):
            slot.length_tokens = length
