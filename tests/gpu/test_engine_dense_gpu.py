"""The Falcon/BLOOM span on a real GPU in bf16: for Falcon-7B-style multi-query (rotary, parallel attention),
Falcon-40B-style GQA (`ln_attn` + `ln_mlp`), ALiBi Falcon (sequential, biases) and BLOOM, the engine (Triton
ALiBi attention, tuned projections, CUDA graphs) equals our blocks' own cached forward, the graphed decode step
equals the eager one at ragged lengths, merged sessions equal each session alone; and the Triton ALiBi attention
equals its reference at Falcon-7B (71 query heads, one KV head) and BLOOM (32 heads of 128) widths; the fused
residual add + LayerNorm kernel equals its torch reference at both widths, cuBLASLt's bias + tanh-GELU epilogue
equals the projection then GELU where it computes the tanh GELU, and BLOOM's warm-up takes it there and the step
agrees either way; Falcon-7B's one-row graphed steps (w_qkv and w_up in one GEMM, the attention branch on a side stream)
equal the blocks. Skipped without CUDA."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.kernels.alibi import ALIBI_BF16, ALIBI_FALCON_BF16, Alibi
from corolla.engine.ops.decode_ops import paged_decode_attention_ref
from corolla.engine.span_engine import StepRequest
from corolla.engine.spans.fast_dense import GELU_PROBE_ROWS, FastDenseSpan
from corolla.models.positions import alibi_slopes
from corolla.models.registry import get_family
from helpers.engine_reference import cached_block_steps
from helpers.numerics import rel_err

DEV = torch.device("cuda")
BF16 = torch.bfloat16
H = 512

VARIANTS = {
    "falcon_7b": dict(num_attention_heads=8, new_decoder_architecture=False, multi_query=True, parallel_attn=True),
    "falcon_40b": dict(num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True, parallel_attn=True),
    "falcon_alibi": dict(
        num_attention_heads=8, new_decoder_architecture=False, multi_query=False, parallel_attn=False, alibi=True,
        bias=True,
    ),
    "bloom": dict(n_head=4, apply_residual_connection_post_layernorm=False),
}  # fmt: skip


def make_blocks(name: str, layers: int = 3, seed: int = 0) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    fields = dict(VARIANTS[name])
    if name == "bloom":
        config = tf.BloomConfig(hidden_size=H, n_layer=layers, **fields)
    else:
        fields.setdefault("alibi", False)
        config = tf.FalconConfig(hidden_size=H, num_hidden_layers=layers, max_position_embeddings=4096, **fields)
    blocks = []
    for i in range(layers):
        block = get_family(config).build_block(config, i)
        for pname, p in block.named_parameters():
            if p.ndim > 1:
                torch.nn.init.normal_(p, std=0.03)
            else:
                torch.nn.init.normal_(p, mean=1.0 if "norm" in pname or "ln_" in pname else 0.0, std=0.1)
        blocks.append(block.to(DEV, BF16).eval())
    return blocks


def make_engine(blocks, **kw) -> SpanEngine:
    settings = dict(kv_pool_bytes=256 << 20, page_size_tokens=64, max_seq_len_tokens=2048, max_batch_rows=16)
    settings.update(kw)
    return SpanEngine.from_blocks(blocks, EngineConfig(**settings))


def _prefill_then_tokens(engine, prompt, tokens):
    with engine.open_session(prompt.shape[0], prompt.shape[1] + len(tokens) + 1) as s:
        outs = [engine.step(s, prompt, 0)]
        outs += [engine.step(s, t, prompt.shape[1] + i) for i, t in enumerate(tokens)]
    return outs


def _steps_on_device(prompt, tokens):
    """`_prefill_then_tokens`' steps as `cached_block_steps` takes them: (hidden on the device, position)."""
    return [(prompt.to(DEV), 0)] + [(t.to(DEV), prompt.shape[1] + i) for i, t in enumerate(tokens)]


@torch.no_grad()
@pytest.mark.parametrize("name", list(VARIANTS))
def test_tuned_graphed_engine_matches_blocks_in_bf16(name: str) -> None:
    blocks = make_blocks(name)
    engine = make_engine(blocks)
    assert isinstance(engine.model, FastDenseSpan) and engine.model.ops.use_triton
    engine.warmup()
    prompt = torch.randn(2, 300, H, dtype=BF16)  # past 256 positions: Falcon's bf16 ALiBi rounding shows
    tokens = [torch.randn(2, 1, H, dtype=BF16) for _ in range(4)]
    got = _prefill_then_tokens(engine, prompt, tokens)
    expected = cached_block_steps(blocks, 320, _steps_on_device(prompt, tokens))
    for x, out, h in zip([prompt, *tokens], got, expected, strict=True):
        assert out.shape == x.shape
        assert rel_err(out, h.cpu()) < 2e-2, name


@torch.no_grad()
@pytest.mark.parametrize("name", ["falcon_7b", "falcon_alibi", "bloom"])
def test_cuda_graph_step_equals_eager_step_and_merged_equals_alone(name: str) -> None:
    blocks = make_blocks(name)
    graphed, eager = make_engine(blocks), make_engine(blocks, use_cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    torch.manual_seed(2)
    rows = 5
    prompts = [torch.randn(1, 5 + 67 * i, H, dtype=BF16) for i in range(rows)]  # ragged positions
    tokens = [[torch.randn(1, 1, H, dtype=BF16) for _ in range(3)] for _ in range(rows)]
    outs = {}
    for label, engine in (("graphed", graphed), ("eager", eager)):
        sessions = [engine.open_session(1, 512) for _ in range(rows)]
        for s, p in zip(sessions, prompts, strict=True):
            engine.step(s, p, 0)
        outs[label] = []
        for i in range(3):
            reqs = [StepRequest(s, t[i], p.shape[1] + i) for s, t, p in zip(sessions, tokens, prompts, strict=True)]
            outs[label].append(engine.decode_many(reqs))
        for s in sessions:
            s.close()
    alone = [_prefill_then_tokens(graphed, p, t)[1:] for p, t in zip(prompts, tokens, strict=True)]
    for i, (g_step, e_step) in enumerate(zip(outs["graphed"], outs["eager"], strict=True)):
        for k, (g, e) in enumerate(zip(g_step, e_step, strict=True)):
            assert rel_err(g, e) < 1e-2
            assert rel_err(g, alone[k][i]) < 1e-2


@pytest.mark.parametrize(("nq", "nkv", "d", "mode"), [(71, 1, 64, ALIBI_FALCON_BF16), (32, 32, 128, ALIBI_BF16)])
def test_triton_alibi_attention_at_model_widths(nq: int, nkv: int, d: int, mode: int) -> None:
    from corolla.engine.kernels import triton_kernels as tk

    torch.manual_seed(1)
    page, pages = 64, 201  # 200 distinct pages besides the trash page
    kc = torch.randn(pages, page, nkv, d, device=DEV, dtype=BF16)
    vc = torch.randn_like(kc)
    b, maxp = 5, 40
    tables = (torch.randperm(pages - 1, device=DEV)[: b * maxp].reshape(b, maxp) + 1).int()
    lens = torch.tensor([1, 64, 65, 700, 2560], device=DEV, dtype=torch.int32)
    q = torch.randn(b, nq, d, device=DEV, dtype=BF16)
    slopes = alibi_slopes(nq).to(DEV)
    scale = 1 / math.sqrt(d)
    alibi = Alibi(slopes.bfloat16().float() if mode == ALIBI_FALCON_BF16 else slopes, scale if nkv == 1 else 1.0, mode)
    ref = paged_decode_attention_ref(q, kc, vc, tables, lens, scale, alibi)
    assert rel_err(paged_decode_attention_ref(q, kc, vc, tables, lens, scale), ref) > 0.05  # the bias matters
    for splits in (1, 4, 16):
        out = tk.paged_decode_attention(
            q,
            kc,
            vc,
            tables,
            (lens - 1).long(),
            scale,
            splits,
            alibi_slopes=alibi.slopes,
            alibi_scale=alibi.scale,
            alibi_mode=mode,
        )
        assert rel_err(out, ref) < 1e-2, splits


@pytest.mark.parametrize("cols", [4096, 4544])
@pytest.mark.parametrize("rows", [1, 8])
def test_fused_add_layer_norm_at_model_widths(cols: int, rows: int) -> None:
    from corolla.engine.kernels import dense_kernels
    from corolla.engine.ops.dense_ops import add_layer_norm_ref

    torch.manual_seed(cols + rows)
    a, b, res = (torch.randn(rows, cols, device=DEV, dtype=BF16) * s for s in (1.0, 0.5, 4.0))
    w = torch.randn(cols, device=DEV, dtype=BF16) * 0.2 + 1.0
    nb = torch.randn(cols, device=DEV, dtype=BF16) * 0.1
    for args in ((a, b, res, w, nb), (a, None, res, w, nb), (None, None, res, w, nb), (a, b, res, None, None)):
        h, normed = dense_kernels.add_layer_norm(*args, 1e-5)
        h_ref, normed_ref = add_layer_norm_ref(*args, 1e-5)
        assert torch.equal(h, h_ref)  # sums rounded as torch rounds them
        if normed_ref is None:
            assert normed is None
        else:
            assert normed is not None
            assert (normed.float() - normed_ref.float()).abs().max() <= 2 * normed_ref.float().abs().max() * 2**-8


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_gelu_epilogue_matches_projection_then_gelu(rows: int) -> None:
    from corolla.engine.ops.dense_ops import DenseOps

    torch.manual_seed(rows)
    ops = DenseOps(DEV, 128, use_triton=True)
    w = torch.randn(16384, 4096, device=DEV, dtype=BF16) * 0.02
    bias = torch.randn(16384, device=DEV, dtype=BF16) * 0.1
    x = torch.randn(rows, 4096, device=DEV, dtype=BF16)
    ref = F.gelu(F.linear(x.float(), w.float(), bias.float()), approximate="tanh")
    if ops.rows_without_tanh_gelu(w, [rows]):
        pytest.skip(f"cuBLAS's GELU epilogue is not the tanh GELU at {rows} rows: the step keeps two kernels")
    assert rel_err(ops.up_gelu(x, w, bias), ref) < 1e-2
    assert rel_err(F.gelu(F.linear(x, w, bias), approximate="tanh"), ref) < 1e-2


@torch.no_grad()
def test_bloom_takes_the_gelu_epilogue_where_it_is_tanh_and_the_step_stays_equal() -> None:
    blocks = make_blocks("bloom")
    engine = make_engine(blocks)
    assert isinstance(engine.model, FastDenseSpan)
    engine.warmup()
    dense = engine.model.dense
    assert dense.gelu_epilogue == (not dense.rows_without_tanh_gelu(engine.model.layers[0].w_up, GELU_PROBE_ROWS))
    prompt, token = torch.randn(1, 40, H, dtype=BF16), torch.randn(1, 1, H, dtype=BF16)
    with_choice = _prefill_then_tokens(engine, prompt, [token])[1]
    engine.model.dense.gelu_epilogue = not engine.model.dense.gelu_epilogue
    engine.graphs.clear()
    other = _prefill_then_tokens(engine, prompt, [token])[1]
    assert rel_err(with_choice, other) < 1e-2


@torch.no_grad()
def test_one_row_graphed_steps_of_falcon_7b_match_blocks() -> None:
    """One-row CUDA-graph steps of Falcon-7B's parallel layers: w_qkv and w_up in one GEMM, the attention branch on
    the span's side stream beside GELU + w_down (a fork and a join in the graph); equal to the blocks' forward."""
    blocks = make_blocks("falcon_7b")
    engine = make_engine(blocks)
    span = engine.model
    assert isinstance(span, FastDenseSpan) and engine.graphs is not None and span.side_stream is not None
    assert all(w.joined_rows() is not None for w in span.layers)
    engine.warmup()
    torch.manual_seed(3)
    prompt = torch.randn(1, 300, H, dtype=BF16)
    tokens = [torch.randn(1, 1, H, dtype=BF16) for _ in range(3)]
    got = _prefill_then_tokens(engine, prompt, tokens)
    for out, h in zip(got, cached_block_steps(blocks, 320, _steps_on_device(prompt, tokens)), strict=True):
        assert rel_err(out, h.cpu()) < 2e-2
