"""The paged prefill attention kernel (`engine.kernels.prefill_attention_triton`) against its reference on a real GPU: every
launch the graphs may choose at Llama-3-8B's heads, one at a head count that is no power of two, chunks from the
sequence's start to a long prefix, padding rows zero; one captured graph serves other prefix lengths when only the
index changes. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from corolla.engine.kernels.prefill_attention import paged_prefill_attention_ref
from helpers.numerics import rel_err

DEV = torch.device("cuda")
BF16 = torch.bfloat16
PAGE = 64


def make_pool(pages: int, nkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [pages, PAGE, nkv, d] bf16."""
    torch.manual_seed(0)
    k = torch.randn((pages, PAGE, nkv, d), device=DEV).to(BF16)
    v = torch.randn((pages, PAGE, nkv, d), device=DEV).to(BF16)
    return k, v


def make_index(start: int, t: int, maxp: int, pages: int) -> torch.Tensor:
    """[2 + maxp] int32: start, t, a shuffled block table over pages 1.. (0 is the trash page)."""
    table = torch.randperm(pages - 1, device=DEV)[:maxp].int() + 1
    return torch.cat((torch.tensor((start, t), dtype=torch.int32, device=DEV), table))


@pytest.mark.parametrize("nq,nkv,d", [(32, 8, 128), (12, 4, 64)])
@torch.inference_mode()
def test_launches_match_the_reference(nq: int, nkv: int, d: int) -> None:
    from corolla.engine.kernels.prefill_attention_triton import ATTENTION_CONFIGS, paged_prefill_attention

    configs = ATTENTION_CONFIGS if nq == 32 else ATTENTION_CONFIGS[:1]  # every launch at Llama-3-8B's heads
    k, v = make_pool(90, nkv, d)
    scale = d**-0.5
    for start, t, rows in ((4000, 132, 160), (0, 7, 8), (1000, 250, 256), (63, 1, 8)):
        index = make_index(start, t, 80, 90)
        q = torch.randn((rows, nq, d), device=DEV).to(BF16)
        want = paged_prefill_attention_ref(q, k, v, index, scale=scale)
        for config in configs:
            got = paged_prefill_attention(q, k, v, index, scale=scale, config=config)
            assert rel_err(got[:t], want[:t]) < 1e-2, (start, t, config)
            assert not got[t:].any(), (start, t, config)  # padding rows zero


@torch.inference_mode()
def test_one_graph_serves_other_prefix_lengths() -> None:
    from corolla.engine.kernels.prefill_attention_triton import ATTENTION_CONFIGS, paged_prefill_attention

    k, v = make_pool(90, 8, 128)
    q = torch.randn((160, 32, 128), device=DEV).to(BF16)
    index = make_index(3000, 150, 80, 90)
    static_out = paged_prefill_attention(q, k, v, index, scale=0.1, config=ATTENTION_CONFIGS[0])  # compiled
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = paged_prefill_attention(q, k, v, index, scale=0.1, config=ATTENTION_CONFIGS[0])
    for start, t in ((4900, 132), (64, 140), (0, 160)):
        index.copy_(make_index(start, t, 80, 90))
        graph.replay()
        want = paged_prefill_attention_ref(q, k, v, index, scale=0.1)
        assert rel_err(static_out[:t], want[:t]) < 1e-2, (start, t)
        assert not static_out[t:].any()
