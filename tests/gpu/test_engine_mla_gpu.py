"""The DeepSeek-V3 fast path on a real GPU (bf16, small shapes): the CUDA-graph decode step (latent paged cache,
graph-safe router, grouped experts kernel) equals the eager step, merged ragged decode equals each session alone,
and the engine agrees with the plain corolla blocks. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config

from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.span_engine import StepRequest
from corolla.engine.spans.fast_mla import FastMlaSpan
from corolla.models.registry import get_family
from helpers.numerics import rel_err

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def make_blocks(layers: int = 3, seed: int = 0, max_positions: int = 1024) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    config = DeepseekV3Config(
        hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_attention_heads=8,
        num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=64,
        v_head_dim=64, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
        first_k_dense_replace=1, num_hidden_layers=layers, max_position_embeddings=max_positions, vocab_size=128,
        rope_interleave=True,
    )  # fmt: skip
    blocks = []
    for i in range(layers):
        block = get_family(config).build_block(config, i)
        for name, p in block.named_parameters():
            if p.ndim > 1:
                torch.nn.init.normal_(p, std=0.05)
            else:
                torch.nn.init.normal_(p, mean=0.0 if "bias" in name else 1.0, std=0.1)
        block = block.to(DEV, BF16).eval()
        bias = getattr(block.mlp, "e_score_correction_bias", None)
        if bias is not None:  # well separated choices: bf16 rounding never flips an expert between two paths
            bias.data.copy_(2.0 * torch.randperm(bias.numel()).float())
        blocks.append(block)
    return blocks


def make_engine(blocks, **overrides) -> SpanEngine:
    settings = dict(kv_pool_bytes=64 << 20, page_size_tokens=16, max_seq_len_tokens=256, max_batch_rows=8,
                    graph_buckets=(1, 2, 4, 8))  # fmt: skip
    settings.update(overrides)
    return SpanEngine.from_blocks(blocks, EngineConfig(**settings))


@torch.inference_mode()
def test_graph_decode_equals_eager_and_the_plain_blocks() -> None:
    blocks = make_blocks()
    graphs, eager = make_engine(blocks), make_engine(blocks, use_cuda_graphs=False)
    assert isinstance(graphs.model, FastMlaSpan) and graphs.graphs is not None and eager.graphs is None
    graphs.warmup()
    torch.manual_seed(1)
    prompt = torch.randn(2, 37, 512).to(BF16)
    tokens = [torch.randn(2, 1, 512).to(BF16) for _ in range(4)]
    caches = [[d.make_zeros() for d in b.cache_descriptors(2, 64)] for b in blocks]
    with graphs.open_session(2, 64) as g, eager.open_session(2, 64) as e:
        outs_g = [graphs.step(g, prompt, 0)] + [graphs.step(g, t, 37 + i) for i, t in enumerate(tokens)]
        outs_e = [eager.step(e, prompt, 0)] + [eager.step(e, t, 37 + i) for i, t in enumerate(tokens)]
    ref_outs = []
    for x, pos in [(prompt, 0)] + [(t, 37 + i) for i, t in enumerate(tokens)]:
        h = x.to(DEV)
        for block, cache in zip(blocks, caches, strict=True):
            h = block(h, cache=cache, position=pos)
        ref_outs.append(h.cpu())
    for step, (og, oe, ref) in enumerate(zip(outs_g, outs_e, ref_outs, strict=True)):
        graph_vs_eager, vs_block = rel_err(og, oe), rel_err(og, ref)
        assert graph_vs_eager < 1e-2, (step, graph_vs_eager)  # same kernels (attention over padded vs used pages)
        assert vs_block < 3e-2, (step, vs_block)  # absorbed bf16 decode vs the decompressing block


@torch.inference_mode()
def test_merged_ragged_decode_equals_each_session_alone() -> None:
    blocks = make_blocks(seed=2)
    engine = make_engine(blocks)
    engine.warmup()
    torch.manual_seed(3)
    prefixes = [5, 40, 17]
    prompts = [torch.randn(1, n, 512).to(BF16) for n in prefixes]
    token = [torch.randn(1, 1, 512).to(BF16) for _ in prefixes]
    alone = []
    for p, t in zip(prompts, token, strict=True):
        with engine.open_session(1, 64) as s:
            engine.step(s, p, 0)
            alone.append(engine.step(s, t, p.shape[1]))
    sessions = [engine.open_session(1, 64) for _ in prompts]
    for s, p in zip(sessions, prompts, strict=True):
        engine.step(s, p, 0)
    merged = engine.decode_many(
        [StepRequest(s, t, p.shape[1]) for s, t, p in zip(sessions, token, prompts, strict=True)]
    )
    for s in sessions:
        s.close()
    for m, a in zip(merged, alone, strict=True):
        assert rel_err(m, a) < 1e-2


def _latent_case(seq_lens: list[int], page: int, max_pages: int, heads: int = 128, c: int = 512, r: int = 64):
    """bf16 pool at DeepSeek-V3's latent widths; pages shuffled between rows; unused pages NaN."""
    used = [-(-n // page) for n in seq_lens]
    total = sum(used) + 1
    order = torch.randperm(total, device=DEV)
    latent = torch.full((total, page, 1, c), float("nan"), device=DEV, dtype=BF16)
    rope = torch.full((total, page, 1, r), float("nan"), device=DEV, dtype=BF16)
    tables = torch.full((len(seq_lens), max_pages), int(order[-1]), dtype=torch.int32, device=DEV)
    first = 0
    for row, k in enumerate(used):
        pages = order[first : first + k]
        first += k
        tables[row, :k] = pages.int()
        latent[pages] = torch.randn(k, page, 1, c, device=DEV).to(BF16)
        rope[pages] = torch.randn(k, page, 1, r, device=DEV).to(BF16)
    q_lat = (torch.randn(len(seq_lens), heads, c, device=DEV) * 0.1).to(BF16)
    q_rope = (torch.randn(len(seq_lens), heads, r, device=DEV) * 0.1).to(BF16)
    return q_lat, q_rope, latent, rope, tables


def _reference_rows(q_lat, q_rope, latent, rope, tables, lens, scale) -> torch.Tensor:
    from corolla.engine.kernels.mla_kernels import paged_latent_attention as ref

    return torch.cat([ref(q_lat[i : i + 1], q_rope[i : i + 1], latent, rope, tables[i : i + 1], lens[i : i + 1], scale)
                      for i in range(len(lens))])  # fmt: skip


@torch.inference_mode()
@pytest.mark.parametrize("splits", [1, 4, 16])
def test_latent_attention_kernel_at_deepseek_widths(splits: int) -> None:
    from corolla.engine.kernels import mla_triton

    torch.manual_seed(splits)
    seq_lens = [1, 63, 64, 65, 700, 129]
    q_lat, q_rope, latent, rope, tables = _latent_case(seq_lens, page=64, max_pages=128)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    got = mla_triton.paged_latent_attention(q_lat, q_rope, latent, rope, tables, lens, 0.1, splits)
    assert rel_err(got, _reference_rows(q_lat, q_rope, latent, rope, tables, lens, 0.1)) < 1e-2


@torch.inference_mode()
def test_latent_attention_graph_replay_follows_new_lengths() -> None:
    """Captured once over a 8192-token-wide table; replays with other lengths and pages read only those."""
    from corolla.engine.kernels import mla_triton

    torch.manual_seed(4)
    q_lat, q_rope, latent, rope, tables = _latent_case([40, 3000, 9], page=64, max_pages=128)
    lens = torch.tensor([5, 5, 5], dtype=torch.int32, device=DEV)
    run = lambda: mla_triton.paged_latent_attention(q_lat, q_rope, latent, rope, tables, lens, 0.1, 8)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for new_lens in ([40, 3000, 9], [1, 2999, 7], [33, 1, 9]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        assert rel_err(out, _reference_rows(q_lat, q_rope, latent, rope, tables, lens, 0.1)) < 1e-2, new_lens


@torch.inference_mode()
def test_long_max_length_graphs_stay_small() -> None:
    """An engine allowing 8192 tokens per row with graphs up to 64 rows: capturing them with the latent attention
    kernel takes a small fraction of what the torch reference takes (which gathers every row's 8192-token table),
    and both decode the same."""
    blocks = make_blocks(layers=2, seed=5, max_positions=8192)
    prompt, token = torch.randn(1, 70, 512).to(BF16), torch.randn(1, 1, 512).to(BF16)
    settings = dict(max_seq_len_tokens=8192, max_batch_rows=64, graph_buckets=(1, 8, 64), kv_pool_bytes=64 << 20,
                    tune_gemm=False)  # fmt: skip
    capture_bytes, outs = {}, {}
    for kernel in (True, False):
        engine = make_engine(blocks, **settings)
        assert engine.max_seq_len_tokens == 8192 and engine.graphs is not None
        engine.model.use_attention_kernels = kernel
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        engine.warmup()  # captures every bucket
        capture_bytes[kernel] = torch.cuda.max_memory_allocated() - before
        with engine.open_session(1, 128) as s:
            engine.step(s, prompt, 0)
            outs[kernel] = engine.step(s, token, 70)
        del engine
    assert rel_err(outs[True], outs[False]) < 1e-2
    gather = 64 * 8192 * (64 + 32) * 4  # one layer's fp32 latent + rope gather at 64 rows (the torch path)
    assert capture_bytes[False] - capture_bytes[True] > gather, capture_bytes
    assert capture_bytes[True] < 128 << 20, capture_bytes  # cuBLAS workspaces, outputs, split scratch
