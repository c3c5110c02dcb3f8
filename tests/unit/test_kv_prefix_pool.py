"""The pool's prefix caching: pages counted per holder, a published page reused by a later sequence, copy on write
where a sequence writes into a page it shares or published, and least-recently-used eviction of cached pages no
sequence holds (a held or promised page is never taken), under memory pressure or past the operator's cap."""

from __future__ import annotations

import pytest
import torch

from corolla.engine.kv.kv_pool import KVLayout, KVPool, SequenceSlot
from corolla.engine.kv.prefix_index import PrefixKey
from corolla.engine.spans.eager_span import read_positions, write_positions
from corolla.utils.errors import AllocationFailed

PAGE = 16


def make_pool(usable_pages: int, num_layers: int = 2) -> KVPool:
    return KVPool(num_layers=num_layers, layout=KVLayout.heads(1, 2), num_pages=usable_pages + 1,
                  page_size_tokens=PAGE, max_pages_per_seq=usable_pages, dtype=torch.float32, device="cpu")  # fmt: skip


def key(i: int, layers: tuple[int, int] = (0, 2), namespace: str = "peer") -> PrefixKey:
    return PrefixKey(namespace, layers, bytes([i]) * 16)


def fill(pool: KVPool, slot: SequenceSlot, start: int, values: torch.Tensor) -> None:
    """What the engine does for a step: `values` [T] (one per position, every layer and head) written at
    [start, start + T) after copy on write and growth; the length follows."""
    pool.prepare_write(slot, start)
    pool.grow([slot], start + len(values))
    table = slot.table[None].long()
    for layer in range(*slot.layers):
        token = values[None, :, None, None].expand(1, -1, 1, 2)  # [1, T, heads, dim]
        write_positions(pool.k[layer], table, start, token, PAGE)
        write_positions(pool.v[layer], table, start, -token, PAGE)
    slot.length_tokens = start + len(values)


def held(pool: KVPool, slot: SequenceSlot, end: int, layer: int = 0) -> torch.Tensor:
    return read_positions(pool.k[layer], slot.table[None].long(), 0, end, PAGE)[0, :, 0, 0]


def test_published_pages_outlive_their_session_and_attach_to_the_next() -> None:
    pool = make_pool(12)
    (a,) = pool.allocate(1, 4 * PAGE)
    history = torch.arange(3 * PAGE, dtype=torch.float32)
    fill(pool, a, 0, history)
    assert [pool.publish(a, i, key(i)) for i in range(3)] == [True, True, True]
    assert not pool.publish(a, 0, key(0))  # a key names its first page
    assert not pool.publish(a, 3, key(3))  # not fully computed
    published = list(a.pages)
    pool.free([a])
    assert pool.pages_free == 12  # cached pages nobody holds may still be promised: a promise evicts them
    assert pool.layer_pages_cached == 3 * 2 and pool.cached_bytes == 3 * pool.page_bytes
    assert pool.layer_pages_taken == 0

    (b,) = pool.allocate(1, 5 * PAGE)
    assert pool.attach_prefix(b, [key(0), key(1), key(9), key(2)]) == 2  # the run stops at the first miss
    assert b.pages == published[:2] and b.length_tokens == 2 * PAGE and b.spare_pages == 2 and b.shared_pages == 2
    assert torch.equal(held(pool, b, 2 * PAGE), history[: 2 * PAGE])
    assert pool.layer_pages_taken == 2 * 2  # the attached pages are held again, by b
    (c,) = pool.allocate(1, 2 * PAGE)
    assert pool.attach_prefix(c, [key(0)]) == 1 and c.pages[0] == b.pages[0]  # two holders of one page
    (d,) = pool.allocate(1, PAGE)
    assert pool.attach_prefix(d, [key(0, layers=(0, 1))]) == 0  # another layer span: no match
    assert pool.attach_prefix(*pool.allocate(1, PAGE), [key(0, namespace="other")]) == 0  # another identity
    with pytest.raises(ValueError, match="fresh sequence"):
        pool.attach_prefix(b, [key(0)])
    pool.free([b, c])
    assert pool.layer_pages_cached == 6 and pool.layer_pages_taken == 0


def test_a_write_into_a_shared_page_copies_it_first() -> None:
    pool = make_pool(10)
    (a,) = pool.allocate(1, 3 * PAGE)
    history = torch.arange(2 * PAGE, dtype=torch.float32)
    fill(pool, a, 0, history)
    pool.publish(a, 0, key(0))
    pool.publish(a, 1, key(1))
    (b,) = pool.allocate(1, 3 * PAGE)
    assert pool.attach_prefix(b, [key(0), key(1)]) == 2
    shared = list(b.pages)
    # b rolls back into its second page (the client resends from there): that page is copied, the first stays shared
    fill(pool, b, PAGE + 4, torch.full((8,), -1.0))
    assert b.pages[0] == shared[0] and b.pages[1] != shared[1] and b.shared_pages == 1 and b.spare_pages == 1
    assert torch.equal(held(pool, b, PAGE + 4), history[: PAGE + 4])  # positions before the write were copied
    assert torch.equal(held(pool, b, PAGE + 12)[PAGE + 4 :], torch.full((8,), -1.0))
    assert torch.equal(held(pool, a, 2 * PAGE), history)  # the sharer and the cached page are untouched
    # a rollback to a page boundary replaces the pages without copying: their positions are all rewritten
    (c,) = pool.allocate(1, 3 * PAGE)
    pool.attach_prefix(c, [key(0), key(1)])
    fill(pool, c, PAGE, torch.full((PAGE + 1,), 7.0))
    assert c.pages[1] not in shared and len(c.pages) == 3 and torch.equal(held(pool, a, 2 * PAGE), history)
    pool.free([a, b, c])
    assert pool.pages_free == 10 and pool.layer_pages_cached == 4 and pool.layer_pages_taken == 0


def test_an_own_published_page_is_copied_or_leaves_the_index_when_its_sequence_rewrites_it() -> None:
    pool = make_pool(4)
    (a,) = pool.allocate(1, 2 * PAGE)
    fill(pool, a, 0, torch.arange(2 * PAGE, dtype=torch.float32))
    pool.publish(a, 0, key(0))
    pool.publish(a, 1, key(1))
    page = a.pages[1]
    fill(pool, a, PAGE + 3, torch.zeros(1))  # no other holder, no spare: written in place, its key dropped
    assert a.pages[1] == page and pool.prefix_index.get(key(1)) is None and pool.prefix_index.get(key(0)) is not None
    pool.free([a])
    assert pool.layer_pages_cached == 2
    (b,) = pool.allocate(1, 2 * PAGE)
    pool.attach_prefix(b, [key(0)])
    fill(pool, b, PAGE, torch.ones(PAGE))
    pool.publish(b, 1, key(1))
    fill(pool, b, 3, torch.ones(1))  # the attached page is copied out of the spare; the published one stays b's
    assert pool.prefix_index.get(key(0)) not in b.pages and pool.prefix_index.get(key(1)) is None
    pool.free([b])


def test_a_held_shared_page_needs_a_free_page_past_the_promise() -> None:
    pool = make_pool(3)
    (a,) = pool.allocate(1, PAGE)
    fill(pool, a, 0, torch.ones(PAGE))
    pool.publish(a, 0, key(0))
    (b,) = pool.allocate(1, PAGE)
    pool.attach_prefix(b, [key(0)])  # a and b hold page 1; b's promise keeps a spare for it
    (c,) = pool.allocate(1, PAGE)  # the last page, promised
    with pytest.raises(AllocationFailed, match="shared pages"):
        fill(pool, a, 2, torch.zeros(1))  # a's own published page, held by b too: a has no spare, none is free
    assert a.shared_pages == 1 and a.pages == b.pages  # unchanged
    pool.free([c])
    fill(pool, a, 2, torch.zeros(1))
    assert a.pages != b.pages and torch.equal(held(pool, b, PAGE), torch.ones(PAGE))
    pool.free([a, b])


def test_eviction_takes_idle_cached_pages_least_recently_used_first_and_never_held_ones() -> None:
    pool = make_pool(4)
    for i in range(3):  # three one-page sessions, each published and closed in turn: 0 is the oldest
        (s,) = pool.allocate(1, PAGE)
        fill(pool, s, 0, torch.full((PAGE,), float(i)))
        pool.publish(s, 0, key(i))
        pool.free([s])
    (reuse,) = pool.allocate(1, PAGE)  # the one free page is promised: nothing evicted
    assert pool.num_evictions == 0
    assert pool.attach_prefix(reuse, [key(0)]) == 1  # key 0 is held now (its promised page a spare)
    (s,) = pool.allocate(1, PAGE)  # no free page: the least recently used idle one (key 1) goes
    assert pool.num_evictions == 1 and pool.prefix_index.get(key(1)) is None and pool.prefix_index.get(key(2))
    with pytest.raises(AllocationFailed, match="KV pool is full"):
        pool.allocate(1, 2 * PAGE)  # one idle page is not enough: nothing is evicted for a failing promise
    assert pool.num_evictions == 1 and pool.prefix_index.get(key(2)) is not None
    pool.free([reuse])  # key 0 is idle again, more recently used than key 2
    pool.free([s])
    pool.allocate(1, 2 * PAGE)  # the two free pages
    pool.allocate(1, PAGE)
    assert pool.prefix_index.get(key(2)) is None and pool.prefix_index.get(key(0)) is not None
    pool.allocate(1, PAGE)
    assert pool.prefix_index.get(key(0)) is None and pool.num_evictions == 3
    with pytest.raises(AllocationFailed):
        pool.allocate(1, PAGE)


def test_eviction_over_layer_spans() -> None:
    pool = make_pool(2, num_layers=2)
    (low,) = pool.allocate(1, PAGE, (0, 1))
    fill(pool, low, 0, torch.ones(PAGE))
    pool.publish(low, 0, key(0, layers=(0, 1)))
    cached = low.pages[0]
    pool.free([low])
    (whole,) = pool.allocate(1, PAGE)
    pool.grow([whole], 1)  # the page free in both layers
    (upper,) = pool.allocate(1, PAGE, (1, 2))
    pool.grow([upper], 1)  # the cached page's id, free in layer 1
    assert upper.pages == [cached] and pool.num_evictions == 0
    with pytest.raises(AllocationFailed):
        pool.allocate(1, PAGE)  # evicting from layer 0 would not free the id in layer 1: nothing is evicted
    assert pool.prefix_index.get(key(0, layers=(0, 1))) == cached
    pool.free([upper])
    pool.allocate(1, PAGE)
    assert pool.num_evictions == 1 and pool.prefix_index.get(key(0, layers=(0, 1))) is None


def test_the_operators_cap_bounds_idle_cached_pages_least_recently_used_first() -> None:
    pool = KVPool(num_layers=2, layout=KVLayout.heads(1, 2), num_pages=13, page_size_tokens=PAGE,
                  max_pages_per_seq=12, dtype=torch.float32, device="cpu", prefix_cache_tokens=2 * PAGE + 5)  # fmt: skip
    assert pool.idle_cache_layer_pages == 2 * 2 and pool.idle_cache_limit_bytes == 2 * pool.page_bytes
    slots = []
    for n in range(3):  # three sequences of 2 published pages each
        (s,) = pool.allocate(1, 2 * PAGE)
        fill(pool, s, 0, torch.full((2 * PAGE,), float(n)))
        assert pool.publish(s, 0, key(2 * n)) and pool.publish(s, 1, key(2 * n + 1))
        slots.append(s)
    assert pool.layer_pages_cached == 6 * 2  # held pages count against no cap
    pool.free([slots[0]])
    pool.free([slots[1]])
    assert pool.num_evictions == 2 and pool.layer_pages_cached == 4 * 2  # the first sequence's pages went
    (again,) = pool.allocate(1, 2 * PAGE)
    assert pool.attach_prefix(again, [key(0)]) == 0 and pool.attach_prefix(again, [key(2), key(3)]) == 2
    pool.free([slots[2]])  # two more idle pages: the cap keeps the two most recently let go
    assert pool.num_evictions == 2  # the attached ones are held again, so nothing else was over the cap
    pool.free([again])
    assert pool.num_evictions == 4 and pool.layer_pages_cached == 2 * 2
    (last,) = pool.allocate(1, 2 * PAGE)
    assert pool.attach_prefix(last, [key(2)]) == 1  # let go last, kept: key(4) and key(5) were let go earlier
    assert pool.attach_prefix(pool.allocate(1, PAGE)[0], [key(4)]) == 0

    zero = KVPool(num_layers=1, layout=KVLayout.heads(1, 2), num_pages=3, page_size_tokens=PAGE,
                  max_pages_per_seq=2, dtype=torch.float32, device="cpu", prefix_cache_tokens=0)  # fmt: skip
    (s,) = zero.allocate(1, PAGE)
    fill(zero, s, 0, torch.ones(PAGE))
    assert zero.publish(s, 0, key(0, (0, 1)))
    zero.free([s])
    assert zero.layer_pages_cached == 0 and zero.pages_free == 2  # 0: nothing stays cached once let go
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        KVPool(num_layers=1, layout=KVLayout.heads(1, 2), num_pages=3, page_size_tokens=PAGE, max_pages_per_seq=2,
               dtype=torch.float32, device="cpu", prefix_cache_tokens=-1)  # fmt: skip
