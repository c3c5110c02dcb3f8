"""The CPU paged decode attention against the reference: equal and mixed row lengths, grouped-query heads, ALiBi,
garbage (NaN) in the page slots past each row's length, and a table far longer than the rows."""

from __future__ import annotations

import math

import pytest
import torch

from corolla.engine.kernels.alibi import ALIBI_BF16, ALIBI_FP32, Alibi
from corolla.engine.ops import decode_ops as ops

PAGES, PAGE, D = 64, 8, 16


def _case(rows: int, nq: int, nkv: int, lengths: list[int], table_pages: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(PAGES, PAGE, nkv, D, generator=g)  # [pages, page, nkv, D]
    v_cache = torch.randn(PAGES, PAGE, nkv, D, generator=g)
    tables = torch.randperm(PAGES, generator=g)[: rows * table_pages].view(rows, table_pages).int()  # [B, maxp]
    lens = torch.tensor(lengths, dtype=torch.int32)  # [B]
    for row, n in enumerate(lengths):  # NaN in every slot past a row's tokens, in its own pages
        flat_k = k_cache[tables[row].long()].view(-1, nkv, D)
        flat_k[n:] = float("nan")
        k_cache[tables[row].long()] = flat_k.view(-1, PAGE, nkv, D)
        flat_v = v_cache[tables[row].long()].view(-1, nkv, D)
        flat_v[n:] = float("nan")
        v_cache[tables[row].long()] = flat_v.view(-1, PAGE, nkv, D)
    q = torch.randn(rows, nq, D, generator=g)  # [B, nq, D]
    return q, k_cache, v_cache, tables, lens


@pytest.mark.parametrize(
    ("nq", "nkv", "lengths"),
    [(4, 4, [5]), (4, 4, [9, 9, 9]), (4, 4, [1, 17, 8, 30]), (8, 2, [3, 40, 40, 12]), (8, 1, [64, 2])],
)
def test_matches_the_reference_and_never_reads_past_a_rows_length(nq: int, nkv: int, lengths: list[int]) -> None:
    q, k_cache, v_cache, tables, lens = _case(len(lengths), nq, nkv, lengths)
    scale = 1 / math.sqrt(D)
    expected = ops.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale)
    got = ops.paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert torch.isfinite(got).all()  # the NaN past each row's length never reached it
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [ALIBI_FP32, ALIBI_BF16])
def test_alibi_bias_matches_the_reference(mode: int) -> None:
    q, k_cache, v_cache, tables, lens = _case(3, 4, 4, [6, 33, 20], seed=1)
    alibi = Alibi(slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]), scale=0.7, mode=mode)
    expected = ops.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25, alibi)
    plain = ops.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)
    got = ops.paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 0.25, alibi)
    assert (expected - plain).abs().max() > 1e-2  # the bias matters in this case
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_rows_stay_within_rounding_of_the_reference() -> None:
    q, k_cache, v_cache, tables, lens = _case(4, 8, 2, [7, 7, 30, 1], seed=2)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    expected = ops.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)
    got = ops.paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 0.25)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_the_engines_cpu_ops_use_it() -> None:
    q, k_cache, v_cache, tables, lens = _case(2, 4, 4, [3, 11])
    decode_ops = ops.DecodeOps(torch.device("cpu"), D, use_triton=False)
    got = decode_ops.paged_decode_attention(q, k_cache, v_cache, tables, (lens - 1).long(), 0.25)
    torch.testing.assert_close(got, ops.paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 0.25))
    assert torch.isfinite(got).all()


def test_one_sequences_rows_gather_its_pages_once_and_match_the_reference() -> None:
    # rows 1-4: one sequence's four consecutive positions (a shadow's or a speculative step's rows share its table),
    # beside two other sequences; NaN past the sequence's longest row (its own pages)
    q, k_cache, v_cache, tables, lens = _case(6, 8, 2, [12, 27, 28, 29, 30, 5], table_pages=8, seed=3)
    tables[1:5] = tables[4]
    lens = torch.tensor([12, 27, 28, 29, 30, 5], dtype=torch.int32)
    flat = k_cache[tables[4].long()].view(-1, 2, D)
    flat[30:] = float("nan")
    k_cache[tables[4].long()] = flat.view(-1, PAGE, 2, D)
    expected = ops.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)
    got = ops.paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 0.25)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    batches = ops.cpu_attention_batches(tables, lens.tolist(), PAGE)
    assert ([1], 4, 4) in batches  # the sequence: one gather of its 4 pages for its 4 rows


def test_a_row_gathers_at_most_twice_its_own_pages() -> None:
    # a step's rows of 1 to 400 tokens (pages of 8): none gathers up to the longest row's 50 pages
    lengths = [1, 9, 17, 40, 64, 65, 130, 400]
    tables = torch.arange(len(lengths) * 50, dtype=torch.int32).view(len(lengths), 50)
    batches = ops.cpu_attention_batches(tables, lengths, PAGE)
    gathered = {row: pages for firsts, rows, pages in batches for row in firsts if rows == 1}
    assert sorted(gathered) == list(range(len(lengths)))  # every row once, each its own sequence
    for row, n in enumerate(lengths):
        own = -(-n // PAGE)
        assert own <= gathered[row] < 2 * own or gathered[row] == own == 1
