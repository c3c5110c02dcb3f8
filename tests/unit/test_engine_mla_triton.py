"""The DeepSeek-V3 decode kernels of `engine.kernels.mla_triton` against their torch references (`engine.kernels.mla_kernels`,
`ops.rms_norm_ref`): paged latent attention over ragged rows (any number of splits, head counts and latent/rope
widths that are not powers of two, cache pages outside every row's real tokens poisoned with NaN, tokens past a
row's length with huge values) and the fused rope + latent norm + cache write. Runs on CUDA, or on CPU under
Triton's interpreter (`TRITON_INTERPRET=1` with Triton importable); skipped otherwise."""

from __future__ import annotations

import os

import pytest
import torch

from corolla.engine.kernels.mla_kernels import paged_latent_attention as attention_ref
from corolla.engine.kernels.mla_kernels import rope_rotate, store_latent
from corolla.engine.ops.decode_ops import rms_norm_ref
from helpers.engine_reference import decode_after_prompts

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
mla_triton = pytest.importorskip("corolla.engine.kernels.mla_triton")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE = 16


def make_cache(seq_lens: list[int], c: int, r: int, max_pages: int, gen: torch.Generator):
    """A pool whose pages are shuffled between rows; pages no row uses hold NaN, tokens past a row's length in its
    last page hold 1e4 (so reading either shows). Returns (latent [P, PAGE, 1, c], rope [P, PAGE, 1, r],
    tables [B, max_pages] int32)."""
    used = [-(-n // PAGE) for n in seq_lens]
    total = sum(used) + 3
    order = torch.randperm(total, generator=gen).tolist()
    latent = torch.full((total, PAGE, 1, c), float("nan"))
    rope = torch.full((total, PAGE, 1, r), float("nan"))
    tables = torch.full((len(seq_lens), max_pages), order[-1], dtype=torch.int32)  # unused entries: a NaN page
    nxt = 0
    for row, (n, k) in enumerate(zip(seq_lens, used, strict=True)):
        for j in range(k):
            page = order[nxt]
            nxt += 1
            tables[row, j] = page
            latent[page] = torch.randn(PAGE, 1, c, generator=gen)
            rope[page] = torch.randn(PAGE, 1, r, generator=gen)
            tail = n - j * PAGE
            if tail < PAGE:
                latent[page, tail:] = 1e4
                rope[page, tail:] = 1e4
    return latent, rope, tables


@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize(("heads", "c", "r"), [(20, 24, 8), (16, 64, 32)])
def test_paged_latent_attention_matches_reference(splits: int, heads: int, c: int, r: int) -> None:
    gen = torch.Generator().manual_seed(splits * 100 + heads)
    seq_lens = [1, 17, 40, 64, 5]
    latent, rope, tables = make_cache(seq_lens, c, r, max_pages=8, gen=gen)
    q_lat = torch.randn(len(seq_lens), heads, c, generator=gen)
    q_rope = torch.randn(len(seq_lens), heads, r, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    expected = torch.cat(
        [
            attention_ref(q_lat[i : i + 1], q_rope[i : i + 1], latent, rope, tables[i : i + 1], lens[i : i + 1], 0.3)
            for i in range(len(seq_lens))
        ]
    )  # [B, n, c]: row by row, so the reference reads only the row's own pages
    assert torch.isfinite(expected).all()
    got = mla_triton.paged_latent_attention(
        q_lat.to(DEV), q_rope.to(DEV), latent.to(DEV), rope.to(DEV), tables.to(DEV), lens.to(DEV), 0.3, splits
    ).cpu()
    assert got.shape == expected.shape
    tol = 2e-2 if DEV.type == "cuda" else 1e-4  # tf32 dot products on a GPU
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_norm_store_matches_reference(interleaved: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    rows, heads, nope, c, r, positions_max = 3, 20, 12, 24, 8, 50
    q = torch.randn(rows, heads, nope + r, generator=gen)
    kv = torch.randn(rows, c + r, generator=gen)
    norm = torch.randn(c, generator=gen)
    angles = torch.rand(positions_max, r // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 49, 17])
    slots = torch.tensor([5, 0, 30])
    lat_ref, rope_ref = torch.full((2, PAGE, 1, c), float("nan")), torch.full((2, PAGE, 1, r), float("nan"))
    lat_got, rope_got = lat_ref.clone().to(DEV), rope_ref.clone().to(DEV)
    q_rope_ref = rope_rotate(q[..., nope:], cos[positions], sin[positions], interleaved=interleaved)
    k_rope = rope_rotate(kv[:, None, c:], cos[positions], sin[positions], interleaved=interleaved)[:, 0]
    store_latent(rms_norm_ref(kv[:, :c].contiguous(), norm, 1e-6), k_rope, slots, lat_ref, rope_ref)
    q_rope = mla_triton.rope_norm_store(
        q.to(DEV), kv.to(DEV), norm.to(DEV), cos.to(DEV), sin.to(DEV), positions.to(DEV), slots.to(DEV),
        lat_got, rope_got, nope=nope, eps=1e-6, interleaved=interleaved,
    )  # fmt: skip
    torch.testing.assert_close(q_rope.cpu(), q_rope_ref, atol=1e-5, rtol=1e-5)
    # written slots equal; every other slot still NaN (nothing else written)
    torch.testing.assert_close(lat_got.cpu(), lat_ref, atol=1e-5, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(rope_got.cpu(), rope_ref, atol=1e-5, rtol=1e-5, equal_nan=True)


@torch.inference_mode()
def test_span_decode_with_the_kernels_equals_the_torch_path() -> None:
    """FastMlaSpan's decode step wired to these kernels (q strides, slots, the split count) equals its torch path:
    a tiny DeepSeek-V3 span (dense + MoE layers, interleaved rope), rows of three sessions at ragged positions."""
    from corolla.engine import EngineConfig, SpanEngine
    from corolla.models.registry import get_family
    from helpers.tiny_models_fam_a import tiny_config_of

    torch.manual_seed(0)
    config = tiny_config_of("deepseek_v3", 2)
    blocks = [get_family(config).build_block(config, i).eval() for i in range(2)]
    for block in blocks:
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.15) if p.ndim > 1 else torch.nn.init.normal_(p, 1.0, 0.2)
    blocks = [block.to(DEV) for block in blocks]
    settings = EngineConfig(
        kv_pool_bytes=1 << 20, page_size_tokens=PAGE, max_seq_len_tokens=128, max_batch_rows=8, use_cuda_graphs=False
    )
    engines = [SpanEngine.from_blocks(blocks, settings) for _ in range(2)]
    engines[0].model.kernels, engines[0].model.use_attention_kernels = mla_triton, True
    engines[1].model.use_attention_kernels = False  # the torch reference
    h = int(config.hidden_size)
    prefixes = [3, 17, 40]
    prompts = [torch.randn(1, n, h).to(DEV) for n in prefixes]
    tokens = [torch.randn(1, 1, h).to(DEV) for _ in prefixes]
    outs = []
    for engine in engines:
        outs.append(torch.cat(decode_after_prompts(engine, prompts, tokens, 64)))
    tol = 2e-2 if DEV.type == "cuda" else 1e-4  # tf32 dot products on a GPU
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
