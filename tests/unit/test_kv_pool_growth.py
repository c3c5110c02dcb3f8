"""The pool charges what a sequence holds: `allocate` promises pages (counted, none taken), steps take them as their
positions arrive (`KVPool.grow`, called by the engine's `validate`), `free` returns both; a promise keeps others out
until the sequence ends, so a session still gets its whole maximum length."""

from __future__ import annotations

import pytest
import torch

from corolla.engine.config import EngineConfig
from corolla.engine.kv.kv_pool import TRASH_PAGE, KVLayout, KVPool
from corolla.engine.span_engine import SpanEngine, StepRequest
from corolla.models.registry import get_family
from corolla.utils.errors import AllocationFailed
from helpers.tiny_models import tiny_config

PAGE = 16
H = 64


def make_pool(usable_pages: int, num_layers: int = 2) -> KVPool:
    return KVPool(num_layers=num_layers, layout=KVLayout.heads(1, 4), num_pages=usable_pages + 1,
                  page_size_tokens=PAGE, max_pages_per_seq=usable_pages, dtype=torch.float32, device="cpu")  # fmt: skip


def test_a_page_taken_is_written_into_the_table_without_a_torch_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # the device thread grows a session's pages as they fill (every 16th-64th step of each session, shadows' rows
    # included): through the table's numpy view, not a tensor built and copied (~8 us, the GIL handed away each)
    pool = make_pool(10)
    (slot,) = pool.allocate(1, 4 * PAGE)

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a torch call in KVPool.grow")

    monkeypatch.setattr(torch, "tensor", refused)
    monkeypatch.setattr(torch.Tensor, "__setitem__", refused)
    pool.grow([slot], 3 * PAGE + 1)
    monkeypatch.undo()
    assert len(slot.pages) == 4 and slot.table[:4].tolist() == slot.pages  # the tensor holds what numpy wrote
    assert slot.table[4:].eq(TRASH_PAGE).all()


def test_promised_pages_are_taken_as_positions_arrive() -> None:
    pool = make_pool(10)
    (slot,) = pool.allocate(1, 4 * PAGE)
    assert slot.pages == [] and slot.promised_pages == 4
    assert pool.pages_free == 6 and pool.layer_pages_taken == 0  # promised: out of reach of others, not yet held
    pool.grow([slot], 1)
    assert len(slot.pages) == 1 and pool.layer_pages_taken == 2 and slot.table[0] == slot.pages[0] != TRASH_PAGE
    pool.grow([slot], PAGE)  # the same page
    assert len(slot.pages) == 1
    pool.grow([slot], 3 * PAGE + 1)
    assert len(slot.pages) == 4 and slot.promised_pages == 0 and pool.pages_free == 6
    assert slot.table[:4].tolist() == slot.pages and slot.table[4:].eq(TRASH_PAGE).all()
    with pytest.raises(ValueError, match="promised at open"):
        pool.grow([slot], 4 * PAGE + 1)
    pool.free([slot])
    assert pool.pages_free == 10 and pool.layer_pages_taken == 0
    (ended,) = pool.allocate(1, PAGE)
    pool.free([ended])
    with pytest.raises(AllocationFailed, match="returned to the pool"):
        pool.grow([ended], 1)  # a step racing its session's end takes nothing
    assert pool.pages_free == 10


def test_a_promise_is_kept_against_later_sessions() -> None:
    pool = make_pool(8)
    (honest,) = pool.allocate(1, 6 * PAGE)
    pool.grow([honest], 1)  # one page taken, five still promised
    with pytest.raises(AllocationFailed, match="need 3 pages"):
        pool.allocate(1, 3 * PAGE)  # 7 pages free, 5 of them promised
    (small,) = pool.allocate(1, 2 * PAGE)
    pool.grow([small], 2 * PAGE)
    pool.grow([honest], 6 * PAGE)  # the honest sequence still reaches its maximum length
    assert len(honest.pages) == 6 and pool.pages_free == 0
    pool.free([honest, small])
    assert pool.pages_free == 8


def test_sub_span_sequences_share_ids_across_layers_and_leave_whole_columns() -> None:
    pool = make_pool(4, num_layers=2)
    (low,) = pool.allocate(1, 2 * PAGE, layers=(0, 1))
    pool.grow([low], 2 * PAGE)
    (high,) = pool.allocate(1, 2 * PAGE, layers=(1, 2))
    pool.grow([high], 2 * PAGE)
    assert sorted(high.pages) == sorted(low.pages)  # ids already taken in the other layer first
    (whole,) = pool.allocate(1, 2 * PAGE)  # two ids are still free in both layers
    pool.grow([whole], 2 * PAGE)
    assert not set(whole.pages) & set(low.pages)
    pool.free([low, high, whole])
    assert pool.pages_free == 4


def test_engine_steps_take_pages_as_tokens_arrive() -> None:
    torch.manual_seed(0)
    config = tiny_config("llama", 2)
    blocks = [get_family(config).build_block(config, i).eval() for i in range(2)]
    engine = SpanEngine.from_blocks(blocks, EngineConfig(kv_pool_bytes=1 << 20, page_size_tokens=PAGE,
                                                         max_seq_len_tokens=128, max_batch_rows=8))  # fmt: skip
    pool = engine.pool
    free = pool.pages_free
    with engine.open_session(2, 128) as session, engine.open_session(1, 64) as other:
        assert pool.layer_pages_taken == 0 and pool.pages_free == free - 2 * 8 - 4
        engine.step(session, torch.randn(2, 5, H), 0)
        engine.step(other, torch.randn(1, 5, H), 0)
        assert [len(s.pages) for s in session.slots] == [1, 1]
        position = 5
        while position < PAGE + 1:  # merged single-token steps cross into a second page
            engine.decode_many([engine_step(session, position), engine_step(other, position)])
            position += 1
        assert [len(s.pages) for s in session.slots] == [2, 2] and len(other.slots[0].pages) == 2
        assert pool.layer_pages_taken == 2 * (4 + 2) and pool.pages_free == free - 2 * 8 - 4
    assert pool.pages_free == free and pool.layer_pages_taken == 0


def engine_step(session, position: int) -> StepRequest:
    return StepRequest(session, torch.randn(session.batch_size, 1, H), position)


def test_a_withdrawn_promise_grows_from_free_pages_and_can_come_back() -> None:
    pool = make_pool(6)
    (idle,) = pool.allocate(1, 4 * PAGE)
    pool.grow([idle], PAGE)
    assert pool.withdraw([idle], 2) == 2 and idle.promised_pages == 1 and pool.pages_free == 4
    (newcomer,) = pool.allocate(1, 4 * PAGE)  # what was withdrawn is promised to someone else
    pool.grow([idle], 2 * PAGE)  # the promise left covers one more page
    with pytest.raises(AllocationFailed, match="promise went to another session"):
        pool.grow([idle], 3 * PAGE)  # nothing free that nobody was promised
    assert not pool.restore([idle])  # nor to promise again
    pool.free([newcomer])
    assert pool.restore([idle]) and idle.promised_pages == 2 and pool.pages_free == 2
    pool.grow([idle], 4 * PAGE)
    assert len(idle.pages) == 4 and pool.withdraw([idle], 5) == 0
    pool.free([idle])
    assert pool.pages_free == 6 and pool.layer_pages_taken == 0


def test_the_room_in_every_layer_is_what_a_sequence_over_all_layers_can_get() -> None:
    """A sequence over layers 0..2 of 4 leaves the pool's mean free (`pages_free`) above what a sequence over every
    layer can still be promised (`pages_free_in_every_layer`, what a server announces: decision 0036)."""
    pool = make_pool(10, num_layers=4)
    assert pool.pages_free == pool.pages_free_in_every_layer == 10
    (part,) = pool.allocate(1, 4 * PAGE, (0, 2))
    assert pool.pages_free == 8 and pool.pages_free_in_every_layer == 6
    pool.grow([part], 4 * PAGE)  # taken now, no longer promised: the same room
    assert pool.pages_free == 8 and pool.pages_free_in_every_layer == 6
    with pytest.raises(AllocationFailed):
        pool.allocate(1, 7 * PAGE)
    (whole,) = pool.allocate(1, 6 * PAGE)
    assert pool.pages_free_in_every_layer == 0
    pool.free([part, whole])
    assert pool.pages_free_in_every_layer == 10
