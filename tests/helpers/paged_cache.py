"""Paged KV caches for the Triton paged-attention tests: pages shuffled between rows, pages no row uses NaN."""

from __future__ import annotations

import torch


def make_cache(seq_lens: list[int], nkv: int, d: int, max_pages: int, gen: torch.Generator, page: int = 16):
    """k, v [pages, page, nkv, d] and block tables [rows, max_pages]: pages shuffled between rows; pages no row uses
    hold NaN, tokens past a row's length hold 1e4; every table entry past a row's pages names a NaN page."""
    used = [-(-n // page) for n in seq_lens]
    total = sum(used) + 2
    order = torch.randperm(total, generator=gen).tolist()
    k = torch.full((total, page, nkv, d), float("nan"))
    v = torch.full((total, page, nkv, d), float("nan"))
    tables = torch.full((len(seq_lens), max_pages), order[-1], dtype=torch.int32)
    nxt = 0
    for row, (n, pages) in enumerate(zip(seq_lens, used, strict=True)):
        for j in range(pages):
            p = order[nxt]
            nxt += 1
            tables[row, j] = p
            k[p], v[p] = torch.randn(page, nkv, d, generator=gen), torch.randn(page, nkv, d, generator=gen)
            tail = n - j * page
            if tail < page:
                k[p, tail:], v[p, tail:] = 1e4, 1e4
    return k, v, tables
