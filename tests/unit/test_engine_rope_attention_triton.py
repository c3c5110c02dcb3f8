"""The fused rotary decode attention (`rope_attention_triton.rope_paged_decode_attention`) against the pair it
replaces, `rope_and_store_ref` then `paged_decode_attention_ref`: the same output and the same caches after the call,
for ragged rows over shuffled pages (pages no row uses NaN), grouped heads, 1 to 7 splits; a short step whose rows
hold consecutive positions of one sequence (each attends to the others' new keys, written by the same call), across a
page boundary; each row's new slot poisoned before the call (the kernel must take the new keys from qkv); a row of
distinct sequences independent of the other rows; the counters back to zero after each call. Runs on CUDA, or on CPU
under Triton's interpreter (`TRITON_INTERPRET=1` with Triton importable); skipped otherwise."""

from __future__ import annotations

import os

import pytest
import torch
from tests.helpers import paged_cache

from corolla.engine.kernels.attention_counters import attention_counters
from corolla.engine.ops import decode_ops as ops
from corolla.engine.spans.span_model import rotary_tables, row_slots

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
rat = pytest.importorskip("corolla.engine.kernels.rope_attention_triton")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE, D, POSITIONS = 16, 32, 512
SEQ_LENS = [1, 17, 300, 64, 290, 33]
INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))


def make_inputs(seq_lens: list[int], nq: int, nkv: int, seed: int):
    """qkv [B, (nq + 2 nkv) D], positions (each row's length - 1), caches and tables (`paged_cache.make_cache`),
    each row's new slot poisoned with 1e4."""
    gen = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // PAGE) for n in seq_lens) + 1
    k, v, tables = paged_cache.make_cache(seq_lens, nkv, D, max_pages, gen, PAGE)
    qkv = torch.randn(len(seq_lens), (nq + 2 * nkv) * D, generator=gen)
    positions = torch.tensor(seq_lens) - 1
    slots = row_slots(tables, positions, PAGE)
    k.view(-1, nkv, D)[slots], v.view(-1, nkv, D)[slots] = 1e4, 1e4
    return qkv, positions, k, v, tables


def reference(inputs, nq: int, nkv: int):
    """`rope_and_store_ref` then `paged_decode_attention_ref` on copies of the caches: (out, k, v)."""
    qkv, positions, k, v, tables = (t.clone() for t in inputs)
    cos, sin = rotary_tables(INV_FREQ, POSITIONS, torch.device("cpu"))
    q = ops.rope_and_store_ref(qkv, cos, sin, positions, row_slots(tables, positions, PAGE), k, v, nq, nkv, D)
    out = ops.paged_decode_attention_ref(q, k, v, tables, (positions + 1).int(), D**-0.5)
    return out, k, v


def fused(inputs, nq: int, nkv: int, splits: int):
    """The kernel on device copies: (out, k, v) on the CPU."""
    qkv, positions, k, v, tables = (t.clone().to(DEV) for t in inputs)
    cos, sin = rotary_tables(INV_FREQ.to(DEV), POSITIONS, DEV)
    out = rat.rope_paged_decode_attention(qkv, cos, sin, positions, k, v, tables, D**-0.5, splits, nq, nkv)
    return out.cpu(), k.cpu(), v.cpu()


def assert_same(got, expected) -> None:
    # outputs within the split combine's rounding; caches: the rotated keys as the reference rounds them
    torch.testing.assert_close(got[0], expected[0], atol=2e-3, rtol=2e-3)
    for cache, ref in zip(got[1:], expected[1:], strict=True):
        torch.testing.assert_close(cache, ref, equal_nan=True)


@pytest.mark.parametrize(("nq", "nkv"), [(8, 2), (6, 2), (4, 4), (16, 1)])
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_fused_attention_matches_rope_then_attention(nq: int, nkv: int, splits: int) -> None:
    inputs = make_inputs(SEQ_LENS, nq, nkv, seed=nq * 10 + nkv + 100 * splits)
    got = fused(inputs, nq, nkv, splits)
    assert not got[0].isnan().any()
    assert_same(got, reference(inputs, nq, nkv))


@pytest.mark.parametrize("splits", [1, 4])
def test_a_short_steps_rows_attend_to_each_others_new_keys(splits: int) -> None:
    # rows 1-3: one sequence at positions 48, 47, 46 (the page boundary at 48 between them), sharing its table; each
    # attends to the new keys of the rows of lower positions, which this call writes (poisoned in the cache before
    # it). The later positions come first: under the interpreter (programs in grid order) no row's write lands before
    # a later row reads, as on a GPU where the programs run at once
    qkv, positions, k, v, tables = make_inputs([20, 49, 49, 49, 70], 8, 2, seed=splits)
    positions[1:4] = torch.tensor([48, 47, 46])
    tables[2:4] = tables[1]
    slots = row_slots(tables, positions, PAGE)
    k.view(-1, 2, D)[slots], v.view(-1, 2, D)[slots] = 1e4, 1e4
    inputs = (qkv, positions, k, v, tables)
    got = fused(inputs, 8, 2, splits)
    expected = reference(inputs, 8, 2)
    assert_same(got, expected)
    # without the other rows' new keys, row 1 would differ from the reference far past the tolerance
    alone = fused((qkv[1:2], positions[1:2], k, v, tables[1:2]), 8, 2, splits)
    assert (alone[0][0] - expected[0][1]).abs().max() > 0.05


def test_a_row_does_not_depend_on_the_other_rows() -> None:
    qkv, positions, k, v, tables = make_inputs(SEQ_LENS, 6, 2, seed=33)
    whole = fused((qkv, positions, k, v, tables), 6, 2, 3)
    for row in (2, 4):
        alone = fused((qkv[row : row + 1], positions[row : row + 1], k, v, tables[row : row + 1]), 6, 2, 3)
        assert torch.equal(alone[0][0], whole[0][row])


def test_repeated_calls_reset_the_counters_and_repeat_the_bits() -> None:
    inputs = make_inputs(SEQ_LENS, 8, 2, seed=21)
    counters = attention_counters(DEV, len(SEQ_LENS) * 2)
    outs = []
    for _ in range(3):
        outs.append(fused(inputs, 8, 2, 5)[0])
        assert int(counters.abs().sum()) == 0  # the last program of each pair put its counter back
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("rows", [1, 3])
def test_decode_ops_rope_attention_takes_the_fused_kernel_up_to_its_rows(rows: int, monkeypatch) -> None:
    # DecodeOps.rope_attention: the fused kernel for up to FUSED_ATTENTION_MAX_ROWS rows with Triton, the pair
    # (rope_and_store + paged_decode_attention) for more rows or without Triton; every way equals the reference
    inputs = make_inputs(SEQ_LENS[:rows], 8, 2, seed=44 + rows)
    expected = reference(inputs, 8, 2)
    calls: list[int] = []
    kernel = rat.rope_paged_decode_attention
    monkeypatch.setattr(rat, "rope_paged_decode_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    for use_triton in (True, False):
        qkv, positions, k, v, tables = (t.clone().to(DEV) for t in inputs)
        cos, sin = rotary_tables(INV_FREQ.to(DEV), POSITIONS, DEV)
        dec = ops.DecodeOps(DEV, D, use_triton=use_triton)
        dec.use_triton = use_triton  # (the interpreter on CPU counts as Triton here)
        out = dec.rope_attention(qkv, cos, sin, positions, tables, k, v, 8, 2, D, D**-0.5)
        assert_same((out.cpu(), k.cpu(), v.cpu()), expected)
    assert len(calls) == (1 if rows <= ops.FUSED_ATTENTION_MAX_ROWS else 0)
