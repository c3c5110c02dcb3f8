"""The pool's prefix caching under random traffic: sessions that share conversations open, attach what is cached,
append, roll back (into shared pages too), publish and close in random order on a small pool (so promises evict
cached pages), and after every operation every live sequence reads exactly what its own tokens wrote, every cached
page holds what its key names, and every page is free, held or idle cached, exactly once, with free pages >= pages
promised."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

import pytest
import torch

from corolla.engine.kv.kv_pool import TRASH_PAGE, KVLayout, KVPool, SequenceSlot
from corolla.engine.kv.prefix_index import PrefixKey
from corolla.engine.spans.eager_span import read_positions, write_positions
from corolla.utils.errors import AllocationFailed

PAGE = 16
LAYERS = (0, 2)


def value(tokens: list[int]) -> float:
    """What a position holds: a function of every token up to it (as attention states are)."""
    digest = hashlib.blake2b(repr(tokens).encode(), digest_size=4).digest()
    return float(int.from_bytes(digest, "little") % 100003)


def key_of(tokens: list[int]) -> PrefixKey:
    return PrefixKey("peer", LAYERS, hashlib.blake2b(repr(tokens).encode(), digest_size=16).digest())


@dataclass
class Sequence:
    slot: SequenceSlot
    tokens: list[int] = field(default_factory=list)  # tokens of positions [0, length)
    published: int = 0


class Traffic:
    def __init__(self, seed: int, pages: int):
        self.rng = random.Random(seed)
        self.pool = KVPool(num_layers=2, layout=KVLayout.heads(1, 1), num_pages=pages + 1, page_size_tokens=PAGE,
                           max_pages_per_seq=pages, dtype=torch.float64, device="cpu")  # fmt: skip
        self.live: list[Sequence] = []
        self.named: dict[PrefixKey, list[int]] = {}  # every key ever published -> its tokens
        self.conversations = [[self.rng.randrange(50) for _ in range(80)] for _ in range(3)]

    def tokens(self, n: int, after: list[int]) -> list[int]:
        """Mostly a shared conversation's next tokens (so prefixes repeat), sometimes new ones."""
        base = self.conversations[self.rng.randrange(3)]
        if self.rng.random() < 0.7 and base[: len(after)] == after and len(after) + n <= len(base):
            return base[len(after) : len(after) + n]
        return [self.rng.randrange(50) for _ in range(n)]

    def open(self) -> None:
        try:
            (slot,) = self.pool.allocate(1, self.rng.randrange(1, 5) * PAGE)
        except AllocationFailed:
            return
        seq = Sequence(slot)
        if self.rng.random() < 0.8:
            planned = self.tokens(slot.capacity_tokens, [])
            keys = [key_of(planned[: (i + 1) * PAGE]) for i in range(len(planned) // PAGE)]
            attached = self.pool.attach_prefix(slot, keys)
            seq.tokens, seq.published = planned[: attached * PAGE], attached
        self.live.append(seq)

    def write(self, seq: Sequence) -> None:
        slot = seq.slot
        start = len(seq.tokens) if self.rng.random() < 0.6 else self.rng.randrange(len(seq.tokens) + 1)
        room = slot.capacity_tokens - start
        if room <= 0:
            return
        new = self.tokens(self.rng.randrange(1, room + 1), seq.tokens[:start])
        try:
            self.pool.prepare_write(slot, start)
            self.pool.grow([slot], start + len(new))
        except AllocationFailed:
            return  # no page for a copy beyond the promise: the step fails, the sequence is unchanged
        tokens = seq.tokens[:start] + new
        values = torch.tensor([value(tokens[: p + 1]) for p in range(start, len(tokens))], dtype=torch.float64)
        for layer in range(*slot.layers):
            write_positions(self.pool.k[layer], slot.table[None].long(), start, values.view(1, -1, 1, 1), PAGE)
        slot.length_tokens, seq.tokens = len(tokens), tokens
        seq.published = min(seq.published, start // PAGE)
        while (seq.published + 1) * PAGE <= len(seq.tokens) and self.rng.random() < 0.8:
            named = seq.tokens[: (seq.published + 1) * PAGE]
            if self.pool.publish(slot, seq.published, key_of(named)):
                self.named[key_of(named)] = named
            seq.published += 1

    def step(self) -> None:
        action = self.rng.random()
        if action < 0.3 or not self.live:
            self.open()
        elif action < 0.8:
            self.write(self.rng.choice(self.live))
        else:
            seq = self.live.pop(self.rng.randrange(len(self.live)))
            self.pool.free([seq.slot])

    def check(self) -> None:
        pool = self.pool
        for seq in self.live:  # a sequence reads exactly what its own tokens wrote, shared pages or not
            held = read_positions(pool.k[0], seq.slot.table[None].long(), 0, len(seq.tokens), PAGE)[0, :, 0, 0]
            expected = [value(seq.tokens[: p + 1]) for p in range(len(seq.tokens))]
            assert held.tolist() == expected
        index = pool.prefix_index
        for key, tokens in self.named.items():  # a cached page holds what its key names
            page = index.get(key)
            if page is not None:
                assert pool.k[0, page, :, 0, 0].tolist() == [
                    value(tokens[: p + 1]) for p in range(len(tokens) - PAGE, len(tokens))
                ]
        held_pages = [p for seq in self.live for p in seq.slot.pages]
        idle = {page for _, page in index.idle_blocks()}
        free = pool._free[0]  # (the test reads the pool's own sets)
        for page in range(TRASH_PAGE + 1, pool.num_pages):
            states = (page in free) + (page in idle) + (page in held_pages)
            assert states == 1, f"page {page}: free {page in free}, idle {page in idle}, held {page in held_pages}"
            assert int(pool._refs[0, page]) == held_pages.count(page)
        promised = sum(seq.slot.promised_pages for seq in self.live)
        assert len(free) >= promised and pool.pages_free == len(free) - promised + len(idle)


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_every_sequence_and_cached_page_intact(seed: int) -> None:
    traffic = Traffic(seed, pages=12)
    for _ in range(300):
        traffic.step()
        traffic.check()
    assert traffic.pool.num_evictions > 0 and traffic.named  # the run exercised eviction and publication
    for seq in traffic.live:
        traffic.pool.free([seq.slot])
    assert traffic.pool.layer_pages_taken == 0
