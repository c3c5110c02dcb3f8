"""The Triton paged decode attention's in-kernel split combine against the torch reference: one launch per call
whatever the splits, 1 to 7 splits (empty splits included), ragged rows, grouped heads padded to the kernel's 16
rows (3 or 4 real heads of 16), cache pages outside every row's tokens poisoned with NaN, a row's output independent
of the other rows, repeated calls (the arrival counters are back to zero after each, so the next call or graph
replay combines again) and the counters' limit. Runs on CUDA, or on CPU under Triton's interpreter
(`TRITON_INTERPRET=1` with Triton importable); skipped otherwise."""

from __future__ import annotations

import os

import pytest
import torch
from tests.helpers import paged_cache

from corolla.engine.kernels.attention_counters import ATTENTION_COUNTERS, attention_counters, reserve_attention_counters
from corolla.engine.ops import decode_ops as ops

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
tk = pytest.importorskip("corolla.engine.kernels.triton_kernels")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE, D = 16, 32
SEQ_LENS = [1, 17, 300, 64, 290, 33]


def make_inputs(seq_lens: list[int], nq: int, nkv: int, seed: int):
    """q [B, nq, D] and paged caches: pages shuffled between rows; pages no row uses hold NaN, tokens past a row's
    length hold 1e4; every table entry past a row's pages names a NaN page."""
    gen = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // PAGE) for n in seq_lens) + 1
    k, v, tables = paged_cache.make_cache(seq_lens, nkv, D, max_pages, gen, PAGE)
    q = torch.randn(len(seq_lens), nq, D, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q, k, v, tables, lens


def run(inputs, splits: int, pages_per_split: int = 1, unsplit_pages: int = 0, early: bool = False) -> torch.Tensor:
    q, k, v, tables, lens = (t.to(DEV) for t in inputs)  # rows at positions lens - 1
    return tk.paged_decode_attention(
        q,
        k,
        v,
        tables,
        (lens - 1).long(),
        D**-0.5,
        splits,
        pages_per_split=pages_per_split,
        unsplit_pages=unsplit_pages,
        early=early,
    ).cpu()


def launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts the Triton kernel launches made after the call (interpreted or compiled kernels alike)."""
    seen: list[str] = []
    kind = type(tk._paged_attn_kernel)
    original = kind.run

    def counted(self, *args, **kwargs):
        seen.append(getattr(self.fn, "__name__", "?"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(kind, "run", counted)
    return seen


@pytest.mark.parametrize(("nq", "nkv"), [(8, 2), (6, 2), (4, 4), (16, 1)])
@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("early", [False, True])
def test_split_attention_matches_reference(nq: int, nkv: int, splits: int, early: bool) -> None:
    # seq lens of 1 page (splits past the first empty) to 19 pages (every split has pages): a skipped split or a
    # combine of the wrong programs' partials moves the rows far past the tolerance; `early`: the splits of one
    # page read before the wait, bit for bit the other form's
    inputs = make_inputs(SEQ_LENS, nq, nkv, seed=nq * 10 + nkv + 100 * splits)
    expected = ops.paged_decode_attention_ref(*inputs, D**-0.5)
    got = run(inputs, splits, early=early)
    assert torch.equal(got, run(inputs, splits, early=not early))
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("splits", [1, 4])
def test_one_launch_per_call(splits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = make_inputs(SEQ_LENS, 8, 2, seed=5)
    seen = launches(monkeypatch)
    run(inputs, splits)
    assert seen == ["_paged_attn_kernel"]  # the split combine runs inside it


def test_every_split_counts_in_the_combine() -> None:
    # one row of 4 pages, one page per split: a key that dominates its split's scores makes that split's values the
    # output's; changing the values of any one split's page must change the output (no split is left out)
    inputs = make_inputs([64], 4, 1, seed=9)
    q, k, v, tables, lens = inputs
    for j in range(4):
        k[int(tables[0, j]), 3] = q[0, 0] * 4.0  # token 3 of each page: score ~ 4 |q|^2 / sqrt(D)
    base = run((q, k, v, tables, lens), 4)
    torch.testing.assert_close(base, ops.paged_decode_attention_ref(q, k, v, tables, lens, D**-0.5), atol=2e-3, rtol=0)
    for j in range(4):
        moved = v.clone()
        moved[int(tables[0, j])] += 1.0
        got = run((q, k, moved, tables, lens), 4)
        assert (got[0, 0] - base[0, 0]).abs().min() > 0.05, j


def test_repeated_calls_reset_the_counters_and_repeat_the_bits() -> None:
    first = make_inputs(SEQ_LENS, 8, 2, seed=21)
    second = make_inputs(SEQ_LENS, 8, 2, seed=22)
    counters = attention_counters(DEV, len(SEQ_LENS) * 2)
    outs = []
    for inputs in (first, second, first, second, first):
        outs.append(run(inputs, 5))
        assert int(counters.abs().sum()) == 0  # the last program of each pair put its counter back
    for inputs, got in zip((first, second), outs[:2], strict=True):
        torch.testing.assert_close(got, ops.paged_decode_attention_ref(*inputs, D**-0.5), atol=2e-3, rtol=2e-3)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[0], outs[4]) and torch.equal(outs[1], outs[3])


def test_a_row_does_not_depend_on_the_other_rows() -> None:
    q, k, v, tables, lens = make_inputs(SEQ_LENS, 6, 2, seed=33)
    whole = run((q, k, v, tables, lens), 3)
    for row in (2, 4):
        alone = run((q[row : row + 1], k, v, tables[row : row + 1], lens[row : row + 1]), 3)
        assert torch.equal(alone[0], whole[row])


def test_counters_cover_the_reserved_grid_and_refuse_more() -> None:
    assert attention_counters(DEV, ATTENTION_COUNTERS).numel() >= ATTENTION_COUNTERS
    held = attention_counters(DEV, 0)
    pairs = held.numel() + 1
    q = torch.zeros(pairs, 1, 16, device=DEV)
    cache = torch.zeros(1, PAGE, 1, 16, device=DEV)
    tables = torch.zeros(pairs, 1, dtype=torch.int32, device=DEV)
    positions = torch.zeros(pairs, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match=f"{pairs} \\(row, kv head\\) pairs exceed the {held.numel()}"):
        tk.paged_decode_attention(q, cache, cache, tables, positions, 1.0, 2)
    grown = reserve_attention_counters(DEV, pairs)
    assert grown.numel() >= pairs and int(grown.abs().sum()) == 0
    assert attention_counters(DEV, pairs) is grown
    assert reserve_attention_counters(DEV, 1) is grown  # a smaller reservation keeps them


@pytest.mark.parametrize(("splits", "pages_per_split", "unsplit"), [(7, 2, 0), (7, 3, 3), (4, 19, 0), (2, 1, 4)])
def test_rows_take_splits_by_their_own_pages(splits: int, pages_per_split: int, unsplit: int) -> None:
    # rows of 1 to 19 pages take min(splits, ceil(pages / pages_per_split)) splits (one for rows of <= `unsplit`
    # pages): one (no partials, the output stored at once) beside rows that take all of them; every row as the
    # reference, the counters back to zero, and a row's output the same alone as beside the others (its splits
    # follow its own length)
    q, k, v, tables, lens = make_inputs(SEQ_LENS, 8, 2, seed=40 + splits * pages_per_split + unsplit)
    expected = ops.paged_decode_attention_ref(q, k, v, tables, lens, D**-0.5)
    counters = attention_counters(DEV, len(SEQ_LENS) * 2)
    whole = run((q, k, v, tables, lens), splits, pages_per_split, unsplit)
    assert not whole.isnan().any() and int(counters.abs().sum()) == 0
    torch.testing.assert_close(whole, expected, atol=2e-3, rtol=2e-3)
    assert torch.equal(run((q, k, v, tables, lens), splits, pages_per_split, unsplit), whole)  # combines again
    for row in (0, 2, 4):
        one = (q[row : row + 1], k, v, tables[row : row + 1], lens[row : row + 1])
        assert torch.equal(run(one, splits, pages_per_split, unsplit)[0], whole[row])


def test_a_short_row_takes_one_split() -> None:
    # a row of 10 pages with unsplit_pages 10 gives the output of one program over its pages (splits=1), bit for bit;
    # with 9 it is split (summed in another order)
    inputs = make_inputs([146], 4, 1, seed=7)  # 10 pages of 16
    one = run(inputs, 1)
    assert torch.equal(run(inputs, 8, 1, unsplit_pages=10), one)
    assert not torch.equal(run(inputs, 8, 1, unsplit_pages=9), one)


def test_pages_per_split_must_be_positive() -> None:
    with pytest.raises(ValueError, match="pages_per_split"):
        run(make_inputs([64], 4, 1, seed=1), 2, 0)


def test_splits_must_be_positive() -> None:
    # a grid of no split programs would return the output as torch.empty left it (whatever the memory held)
    with pytest.raises(ValueError, match="splits must be >= 1"):
        run(make_inputs([64], 4, 1, seed=1), 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="simulates the kernel ahead through the interpreter's calls")
@pytest.mark.parametrize(
    ("run_start", "run_rows", "splits", "pages_per_split"),
    [(20, 4, 2, 1), (20, 4, 1, 1), (20, 4, 3, 2), (60, 8, 2, 1), (60, 8, 5, 1), (13, 1, 2, 1)],
)
def test_tokens_the_step_writes_are_read_after_the_wait(
    run_start: int, run_rows: int, splits: int, pages_per_split: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A programmatic launch starts before the RoPE + KV write ahead of it completes: what a program reads before its
    # wait may be stale. Interpreted, each program is made to see the step's slots stale (the old keys and values)
    # until its `gdc_wait` and written after it. Row 0 is another sequence at position 35, then `run_rows` rows of
    # one sequence at consecutive positions from `run_start` (a speculative step's rows share its table, the later
    # rows attending to the earlier rows' new tokens; 60-67 cross a page), then one more sequence at 40: every row
    # must attend to every token this step wrote, including the other rows' in its pages.
    positions = torch.tensor([35, *range(run_start, run_start + run_rows), 40])
    rows = len(positions)
    q, k, v, tables, _ = make_inputs((positions + 1).tolist(), 8, 2, seed=50 + splits + run_rows)
    tables[1 : 1 + run_rows] = tables[run_rows]
    slots, lens = ops.decode_slots_ref(positions, tables, PAGE)
    gen = torch.Generator().manual_seed(51)
    k_flat, v_flat = k.view(-1, 2, D), v.view(-1, 2, D)  # [pages * PAGE, nkv, D] views of the caches
    new_k, new_v = torch.randn(rows, 2, D, generator=gen), torch.randn(rows, 2, D, generator=gen)
    old_k, old_v = k_flat[slots].clone(), v_flat[slots].clone()
    k_flat[slots], v_flat[slots] = new_k, new_v
    expected = ops.paged_decode_attention_ref(q, k, v, tables, lens, D**-0.5)
    waits: list[int] = []

    def launched() -> None:  # a program starts: the write ahead has not landed
        k_flat[slots], v_flat[slots] = old_k, old_v

    def waited() -> None:  # its wait returns: the write ahead has landed
        waits.append(1)
        k_flat[slots], v_flat[slots] = new_k, new_v

    monkeypatch.setattr(tk, "programmatic_launches", lambda device: True)
    monkeypatch.setattr(tk, "gdc_launch_dependents", launched)
    monkeypatch.setattr(tk, "gdc_wait", waited)
    got = tk.paged_decode_attention(
        q, k, v, tables, positions, D**-0.5, splits, pages_per_split=pages_per_split, early=True
    )
    assert len(waits) == rows * 2 * splits  # every program waited
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
    # the stale step is far from it: the test sees the difference
    k_flat[slots], v_flat[slots] = old_k, old_v
    stale = ops.paged_decode_attention_ref(q, k, v, tables, lens, D**-0.5)
    assert (stale - expected).abs().amax(dim=(1, 2)).min() > 0.05
