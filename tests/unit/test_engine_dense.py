"""The fast path's Falcon and BLOOM spans (`engine.spans.fast_dense`) on CPU in fp32 compute what our plain blocks
compute, for every layer structure the two families have: Falcon's new decoder architecture (GQA, `ln_attn` +
`ln_mlp`, or one shared norm), 7B-style multi-query with one shared LayerNorm, ALiBi Falcon (sequential MHA with
biases, and parallel multi-query), BLOOM with `apply_residual_connection_post_layernorm` false and true. Each is
checked on a prefill, cached single-token steps, a multi-token step on a cached prefix, merged sessions at
different lengths, a rollback and deep prompts; the ALiBi bias's rounding modes equal the blocks' own bias; an NF4
span equals the span on its dequantized weights; the engine and the serving rules pick the span."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from benchmarks.common.quantize import quantize_nf4
from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.kernels.alibi import ALIBI_BF16, ALIBI_FALCON_BF16, Alibi
from corolla.engine.serving import SpanTraits, unsupported_reason
from corolla.engine.span_engine import StepRequest
from corolla.engine.spans.fast_dense import FastDenseSpan
from corolla.models.positions import alibi_slopes
from corolla.models.registry import get_family
from helpers.engine_reference import cached_block_steps, quantized_tuning_asked

H = 64
MAX_LEN = 96
COMMON = dict(vocab_size=300, hidden_size=H, num_hidden_layers=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)

VARIANTS = {
    # Falcon-40B/180B style: GQA, ln_attn + ln_mlp, rotary, parallel attention
    "falcon_new_arch": dict(num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True, bias=False),
    # Falcon2-11B style: new architecture with one shared LayerNorm, biases
    "falcon_new_arch_one_ln": dict(
        num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True, num_ln_in_parallel_attn=1, bias=True
    ),
    # Falcon-7B style: multi-query, parallel attention, one shared input LayerNorm, rotary
    "falcon_7b": dict(num_attention_heads=4, new_decoder_architecture=False, multi_query=True, parallel_attn=True),
    # Falcon-RW style: ALiBi, multi-head, sequential residual, biases
    "falcon_alibi_sequential": dict(
        num_attention_heads=4, new_decoder_architecture=False, multi_query=False, parallel_attn=False, alibi=True,
        bias=True,
    ),
    # ALiBi with multi-query and parallel attention (8 heads of 8 dims)
    "falcon_alibi_mq": dict(
        num_attention_heads=8, new_decoder_architecture=False, multi_query=True, parallel_attn=True, alibi=True
    ),
    "bloom": dict(n_head=4, apply_residual_connection_post_layernorm=False),
    "bloom_residual_post_ln": dict(n_head=4, apply_residual_connection_post_layernorm=True),
}  # fmt: skip


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def variant_config(name: str):
    fields = dict(VARIANTS[name])
    if name.startswith("bloom"):
        common = {k: v for k, v in COMMON.items() if k != "num_hidden_layers"}
        return tf.BloomConfig(**common, n_layer=2, **fields)
    fields.setdefault("alibi", False)
    fields.setdefault("parallel_attn", True)
    return tf.FalconConfig(**COMMON, max_position_embeddings=512, **fields)


def make_blocks(name: str, num_layers: int = 2, seed: int = 0) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    config = variant_config(name)
    blocks = [get_family(config).build_block(config, i) for i in range(num_layers)]
    for block in blocks:
        for pname, p in block.named_parameters():  # norms away from 1 and biases away from 0: every tensor matters
            if p.ndim > 1:
                torch.nn.init.normal_(p, std=0.15)
            else:
                torch.nn.init.normal_(p, mean=1.0 if "norm" in pname or "ln_" in pname else 0.0, std=0.2)
        block.eval()
    return blocks


def make_engine(blocks, **overrides) -> SpanEngine:
    settings = dict(kv_pool_bytes=4 << 20, page_size_tokens=16, max_seq_len_tokens=128, max_batch_rows=8)
    settings.update(overrides)
    return SpanEngine.from_blocks(blocks, EngineConfig(**settings))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_cached_steps_and_rollback_match_blocks(name: str) -> None:
    blocks = make_blocks(name)
    engine = make_engine(blocks)
    assert isinstance(engine.model, FastDenseSpan)
    assert engine.model.spec.alibi == ("alibi" in name or name.startswith("bloom"))
    steps = [(torch.randn(2, 21, H), 0)] + [(torch.randn(2, 1, H), 21 + i) for i in range(3)]
    steps.append((torch.randn(2, 19, H), 24))  # multi-token step on a cached prefix, across pages
    expected = cached_block_steps(blocks, MAX_LEN, steps)
    with engine.open_session(2, MAX_LEN) as session:
        got = [engine.step(session, x, position) for x, position in steps]
        assert session.length_tokens == 43
        rollback = torch.randn(2, 1, H)
        out = engine.step(session, rollback, 22)  # speculative rollback: as if only 22 tokens were ever sent
    for out_step, ref in zip(got, expected, strict=True):
        assert out_step.shape == ref.shape
        torch.testing.assert_close(out_step, ref, atol=1e-4, rtol=0)
    ref_rollback = cached_block_steps(blocks, MAX_LEN, [(steps[0][0], 0), (steps[1][0], 21), (rollback, 22)])[2]
    torch.testing.assert_close(out, ref_rollback, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["falcon_7b", "falcon_alibi_mq", "bloom"])
def test_merged_sessions_at_different_lengths_equal_each_alone(name: str) -> None:
    blocks = make_blocks(name)
    engine = make_engine(blocks)
    prefixes, batch_sizes = [3, 17, 40, 1], [1, 2, 1, 3]
    prompts = [torch.randn(b, n, H) for b, n in zip(batch_sizes, prefixes, strict=True)]
    tokens = [[torch.randn(b, 1, H) for _ in range(2)] for b in batch_sizes]
    expected = [
        cached_block_steps(blocks, MAX_LEN, [(p, 0)] + [(t, p.shape[1] + i) for i, t in enumerate(toks)])[1:]
        for p, toks in zip(prompts, tokens, strict=True)
    ]
    sessions = [engine.open_session(p.shape[0], MAX_LEN) for p in prompts]
    for s, prompt in zip(sessions, prompts, strict=True):
        engine.step(s, prompt, 0)
    for i in range(2):
        reqs = [StepRequest(s, t[i], p.shape[1] + i) for s, t, p in zip(sessions, tokens, prompts, strict=True)]
        for k, out in enumerate(engine.decode_many(reqs)):  # 7 rows at 4 different positions in one forward
            torch.testing.assert_close(out, expected[k][i], atol=1e-4, rtol=0)
    for s in sessions:
        s.close()


# parallel layers whose w_qkv and w_up the span joins into one tensor (one shared LayerNorm, no biases)
JOINED = {"falcon_7b", "falcon_alibi_mq"}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_one_row_steps_match_blocks(name: str) -> None:
    """One-row decode steps (the parallel layers' joined GEMM, the attention branch apart from the MLP's) equal
    the blocks, and the span joined w_qkv and w_up where it applies."""
    blocks = make_blocks(name)
    engine = make_engine(blocks)
    span = engine.model
    assert isinstance(span, FastDenseSpan)
    assert all((w.joined_rows() is not None) == (name in JOINED) for w in span.layers)
    steps = [(torch.randn(1, 21, H), 0)] + [(torch.randn(1, 1, H), 21 + i) for i in range(4)]
    expected = cached_block_steps(blocks, MAX_LEN, steps)
    with engine.open_session(1, MAX_LEN) as session:
        got = [engine.step(session, x, position) for x, position in steps]
    for out_step, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out_step, ref, atol=1e-4, rtol=0)


def test_joined_rows_are_views_of_the_blocks_weights_and_keep_their_forward() -> None:
    """Falcon-7B's w_qkv and w_up move into one tensor without a second copy: the blocks' parameters become its
    row blocks and compute bit for bit what they computed before; a second span on the same blocks moves nothing;
    a layer whose projection was swapped since (a quantized or updated weight) runs the two apart again."""
    blocks = make_blocks("falcon_7b")
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        before = cached_block_steps(blocks, MAX_LEN, [(x, 0)])[0]
    span = FastDenseSpan.from_blocks(blocks, max_positions=MAX_LEN)
    with torch.no_grad():
        after = cached_block_steps(blocks, MAX_LEN, [(x, 0)])[0]
    assert torch.equal(before, after)
    again = FastDenseSpan.from_blocks(blocks, max_positions=MAX_LEN)
    for block, w, w2 in zip(blocks, span.layers, again.layers, strict=True):
        rows = w.joined_rows()
        assert rows is not None and rows.shape == (block.attn.qkv.out_features + block.mlp.up.out_features, H)
        for m in (block.attn.qkv, block.mlp.up):
            assert m.weight.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
        assert torch.equal(rows, torch.cat([block.attn.qkv.weight, block.mlp.up.weight]))
        rows2 = w2.joined_rows()
        assert rows2 is not None and rows2.data_ptr() == rows.data_ptr()
    span.layers[0].w_up = span.layers[0].w_up.clone()
    assert span.layers[0].joined_rows() is None and span.layers[1].joined_rows() is not None


@pytest.mark.parametrize("name", ["falcon_new_arch", "bloom"])
def test_deep_prompts_and_chunked_prefill_match_blocks(name: str) -> None:
    blocks = make_blocks(name)
    engine = make_engine(blocks, prefill_chunk_tokens=7)  # several chunks, each attending to the earlier ones
    x, prompts = torch.randn(1, 20, H), torch.randn(2, 1, 5, H)
    h = x.clone()
    caches = [[d.make_zeros() for d in b.cache_descriptors(1, MAX_LEN)] for b in blocks]
    with torch.no_grad():
        for j, (block, cache) in enumerate(zip(blocks, caches, strict=True)):
            h = h.clone()
            h[:, :5] += prompts[j]
            h = block(h, cache=cache, position=0)
    with engine.open_session(1, MAX_LEN) as session:
        out = engine.step(session, x, 0, prompts=prompts)
    torch.testing.assert_close(out, h, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["falcon", "bloom"])
def test_alibi_bias_rounding_equals_the_blocks_bias(family: str) -> None:
    """Our bias (`Alibi.bias`, what the kernel computes) is the blocks' own in bf16: BLOOM rounds its fp32 product,
    Falcon builds it from bf16 slopes and bf16-rounded positions (transformers' `build_alibi_tensor` both)."""
    heads, positions = 12, torch.arange(0, 3000, 7)
    blocks = make_blocks("falcon_alibi_mq" if family == "falcon" else "bloom", num_layers=1)
    attn = blocks[0].attn
    slopes = alibi_slopes(heads)
    if family == "falcon":
        ours = Alibi(slopes.bfloat16().float(), 0.125, ALIBI_FALCON_BF16).bias(positions)
        theirs = (slopes.bfloat16()[:, None] * positions[None, :]).to(torch.bfloat16) * 0.125
        assert attn.alibi_bf16_product
    else:
        ours = Alibi(slopes, 1.0, ALIBI_BF16).bias(positions)
        theirs = (slopes[:, None] * positions[None, :].float() * 1.0).to(torch.bfloat16)
        assert not attn.alibi_bf16_product and attn.alibi_scale == 1.0
    assert torch.equal(ours, theirs.float())
    exact = slopes[:, None] * positions[None, :].float()
    assert not torch.equal(ours, exact * (0.125 if family == "falcon" else 1.0))  # the rounding is not a no-op here


def test_nf4_span_equals_the_span_on_dequantized_weights() -> None:
    blocks = make_blocks("bloom")
    dense = FastDenseSpan.from_blocks(blocks, max_positions=128, use_triton=False)
    quant = FastDenseSpan.from_blocks(blocks, max_positions=128, use_triton=False)
    for dq, qq in zip(dense.layers, quant.layers, strict=True):
        for name in ("w_qkv", "w_o", "w_up", "w_down"):
            packed = quantize_nf4(getattr(dq, name))
            setattr(qq, name, packed)
            setattr(dq, name, packed.dequantize())
    assert quant.weight_bytes() < dense.weight_bytes() / 3
    engines = [SpanEngine(m, EngineConfig(kv_pool_bytes=4 << 20, page_size_tokens=16)) for m in (dense, quant)]
    x, tok = torch.randn(1, 9, H), torch.randn(1, 1, H)
    outs = []
    for engine in engines:
        with engine.open_session(1, 32) as s:
            outs.append((engine.step(s, x, 0), engine.step(s, tok, 9)))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_unsupported_blocks_are_refused_with_a_reason() -> None:
    falcon, bloom = make_blocks("falcon_7b", 1), make_blocks("bloom", 1)
    with pytest.raises(ValueError, match="share one layer structure"):
        FastDenseSpan.from_blocks([falcon[0], bloom[0]], max_positions=64)
    relu = make_blocks("falcon_7b", 1)
    relu[0].mlp.act_name = "relu"
    with pytest.raises(ValueError, match="GELU"):
        FastDenseSpan.from_blocks(relu, max_positions=64)
    split = make_blocks("bloom", 1)
    split[0].attn.head_ids = [0, 1]
    with pytest.raises(ValueError, match="tensor-parallel"):
        FastDenseSpan.from_blocks(split, max_positions=64)


@pytest.mark.parametrize("family", ["falcon", "bloom"])
@pytest.mark.parametrize("quant_type", ["none", "nf4", "int8"])
def test_serving_rules_take_falcon_and_bloom(family: str, quant_type: str) -> None:
    traits = SpanTraits("cuda", torch.bfloat16, quant_type, family, num_adapters=0, tensor_parallel_devices=0)
    assert unsupported_reason(traits) is None


def test_warm_up_tunes_no_norm_or_silu_prologue_for_quantized_dense_spans() -> None:
    """Falcon/BLOOM projections never take the RMSNorm / SiLU x up prologues: warm-up times none for them."""
    span = FastDenseSpan.from_blocks(make_blocks("bloom"), max_positions=128, use_triton=False)
    for layer in span.layers:
        for name in ("w_qkv", "w_o", "w_up", "w_down"):
            setattr(layer, name, quantize_nf4(getattr(layer, name)))
    seen = quantized_tuning_asked(span)
    assert seen["weights"] and seen["prologues"] == {}
