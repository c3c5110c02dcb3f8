"""The quantized routed-experts kernels (`engine.moe.moe_quant_kernels`) on a real GPU, NF4 and Int8 in bitsandbytes'
layouts: equal to the torch reference on the dequantized weights in bf16 (several token counts and top-k, every
tuning config of both kinds, ids outside the expert range), NF4 steps of a few tokens on the dense projections'
tile GEMV (each assignment row bit-equal to that GEMV on its expert, one row a program or up to four rows of one
expert), a row's output bit-identical alone and merged with other tokens, a CUDA graph replayed with new tokens and
routes equal to the eager reference, and a quantized Mixtral-shaped span on the engine (CUDA graphs, merged
sessions) equal to the reference ops on the dequantized weights. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common.quantize import quantize_int8, quantize_nf4
from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.moe.moe_nf4_tile import TILE_MAX_TOKENS, tile_experts
from corolla.engine.moe.moe_quant import QuantizedExpertWeights
from corolla.engine.moe.routed_experts import (
    ExpertWeights,
    experts_forward,
    experts_forward_ref,
    softmax_topk,
    tile_serves,
)
from corolla.engine.quant.quant_tile_gemv import NF4_TILE_CONFIGS, nf4_tile_gemv, nf4_tile_gemv_experts
from corolla.engine.quant.quant_weights import NF4Weight
from corolla.engine.spans.fast_llama import FastLlamaSpan
from helpers.engine_reference import decode_after_prompts
from helpers.numerics import rel_err

DEV = torch.device("cuda")
BF16 = torch.bfloat16
KINDS = ("nf4", "int8")


def random_experts(kind: str, num_experts: int, hidden: int, inter: int, seed: int = 0) -> QuantizedExpertWeights:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    quantize = quantize_nf4 if kind == "nf4" else quantize_int8
    gate_up = [torch.randn(2 * inter, hidden, device=DEV, generator=gen) * hidden**-0.5 for _ in range(num_experts)]
    down = [torch.randn(hidden, inter, device=DEV, generator=gen) * inter**-0.5 for _ in range(num_experts)]
    return QuantizedExpertWeights(
        tuple(quantize(w, dtype=BF16) for w in gate_up), tuple(quantize(w, dtype=BF16) for w in down)
    )


def routes(n: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return softmax_topk(torch.randn(n, num_experts, device=DEV, generator=gen), top_k, normalize=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("num_experts", "hidden", "inter", "top_k"), [(8, 512, 768, 2), (16, 384, 320, 4)])
def test_quantized_kernel_matches_reference(kind, num_experts, hidden, inter, top_k) -> None:
    experts = random_experts(kind, num_experts, hidden, inter)
    dense = ExpertWeights(tuple(w.dequantize() for w in experts.gate_up), tuple(w.dequantize() for w in experts.down))
    for n in (1, 3, 8, 64, 200):
        x = torch.randn(n, hidden, device=DEV, dtype=BF16)
        weights, ids = routes(n, num_experts, top_k, seed=n)
        out = experts_forward(x, ids, weights, experts)
        ref = experts_forward_ref(x, ids, weights, experts)
        assert rel_err(out, ref) < 1e-2, n
        # the dense grouped kernel on the dequantized values: the same structure, only the weight source differs
        assert rel_err(out, experts_forward(x, ids, weights, dense)) < 1e-2, n


@pytest.mark.parametrize("kind", KINDS)
def test_every_quantized_config_is_correct(kind: str) -> None:
    from corolla.engine.moe import moe_quant_kernels

    experts = random_experts(kind, 8, 1024, 1408, seed=2)
    x = torch.randn(24, 1024, device=DEV, dtype=BF16)
    weights, ids = routes(24, 8, 2, seed=3)
    ref = experts_forward_ref(x, ids, weights, experts)
    configs = moe_quant_kernels.configs_for(kind)
    assert len(configs) == (3 if kind == "nf4" else 7)  # NF4: the pair-table decode only (decision 0077)
    for config in configs:
        out = experts_forward(x, ids, weights, experts, config=config)
        assert rel_err(out, ref) < 1e-2, config


@pytest.mark.parametrize("kind", KINDS)
def test_ids_outside_and_batch_invariance(kind: str) -> None:
    experts = random_experts(kind, 6, 256, 128, seed=4)
    x = torch.randn(8, 256, device=DEV, dtype=BF16)
    weights, ids = routes(8, 6, 2, seed=5)
    ids[0, 1], ids[3, 0] = 6, -2
    out = experts_forward(x, ids, weights, experts)
    assert rel_err(out, experts_forward_ref(x, ids, weights, experts)) < 1e-2
    for row in (0, 5):  # alone vs merged with 7 other tokens: the same bits
        alone = experts_forward(x[row : row + 1], ids[row : row + 1], weights[row : row + 1], experts)
        assert torch.equal(alone[0], out[row]), row


@pytest.mark.parametrize("kind", KINDS)
def test_graph_replay_with_new_routes_matches_reference(kind: str) -> None:
    experts = random_experts(kind, 8, 512, 768, seed=6)
    n, top_k = 8, 2
    x = torch.randn(n, 512, device=DEV, dtype=BF16)
    weights, ids = routes(n, 8, top_k, seed=7)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        experts_forward(x, ids, weights, experts)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_forward(x, ids, weights, experts, graph_safe=True)
    for seed in range(3):
        new_w, new_ids = routes(n, 8, top_k, seed=100 + seed)
        x.copy_(torch.randn_like(x))
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, experts_forward_ref(x, ids, weights, experts)) < 1e-2, seed


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_quantized_span_on_the_engine_matches_reference_ops(kind: str) -> None:
    from benchmarks.engine.moe import dequantized_layers, engine_layers, hf_model, quantized_layers
    from corolla.engine.spans.fast_llama import LlamaSpec

    model = hf_model("tiny", 2, DEV, BF16)
    layers = quantized_layers(engine_layers(model), kind)
    spec = LlamaSpec.from_hf_config(model.config)
    inv_freq = model.rotary_emb.inv_freq.float()
    span = FastLlamaSpan(spec, layers, inv_freq, max_positions=512)
    span.tune()
    engine = SpanEngine(
        span, EngineConfig(kv_pool_bytes=64 << 20, max_seq_len_tokens=512, max_batch_rows=8, graph_buckets=(1, 4, 8))
    )
    engine.warmup()
    reference = SpanEngine(
        FastLlamaSpan(spec, dequantized_layers(layers), inv_freq, max_positions=512, use_triton=False),
        EngineConfig(kv_pool_bytes=64 << 20, max_seq_len_tokens=512, use_cuda_graphs=False),
    )
    prompts = [torch.randn(1, n, spec.hidden_size, dtype=BF16) for n in (70, 5, 130)]
    tokens = [torch.randn(1, 1, spec.hidden_size, dtype=BF16) for _ in prompts]
    outs = decode_after_prompts(engine, prompts, tokens, 200)
    for prompt, token, out in zip(prompts, tokens, outs, strict=True):
        with reference.open_session(1, 200) as s:
            reference.step(s, prompt, 0)
            expected = reference.step(s, token, prompt.shape[1])
        assert rel_err(out, expected) < 2e-2


@pytest.mark.parametrize("config", NF4_TILE_CONFIGS)
@pytest.mark.parametrize(("tokens", "grouped"), [(3, False), (3, True), (8, True), (21, True)])
def test_nf4_tile_rows_equal_the_dense_tile_gemv(config, tokens: int, grouped: bool) -> None:
    # each assignment row of the experts' GEMV: bit-equal to quant_tile_gemv's GEMV of its token on its own expert
    # (gated gate_up, then down), one row a program or up to four rows of one expert a program (`grouped`; 8 tokens:
    # expert 3 chosen by 7 tokens, 4 + 3 rows; 21 tokens: 42 rows, two chunks of the grouping, every expert chosen
    # several times); an id outside [0, E) gives a zero row (three of them at 21 tokens: grouped with each other)
    experts = random_experts("nf4", 8, 512, 768, seed=8)
    x = torch.randn(tokens, 512, device=DEV, dtype=BF16)
    _, ids = routes(tokens, 8, 2, seed=9)
    ids[1, 0] = 8
    if tokens == 8:
        ids[:, 1] = torch.tensor([3, 8, 3, 3, 3, 3, 3, 3], device=DEV)
        ids[:, 0] = torch.tensor([0, 8, 1, 2, 4, 5, 6, 7], device=DEV)  # (token 1: both ids outside, one group)
    if tokens > 8:
        ids[5, 1], ids[17, 0] = -1, 9
    flat = ids.reshape(-1).contiguous()
    gu, dn = experts.gate_up_tables, experts.down_tables
    act = nf4_tile_gemv_experts(
        x, experts.gate_up[0], gu.addresses, gu.offsets, flat, 2, config, gated=True, grouped=grouped
    )
    y = nf4_tile_gemv_experts(act, experts.down[0], dn.addresses, dn.offsets, flat, 1, config, grouped=grouped)
    for a, e in enumerate(flat.tolist()):
        if not 0 <= e < 8:
            assert not act[a].any() and not y[a].any()
            continue
        gate_up, down = experts.gate_up[e], experts.down[e]
        assert isinstance(gate_up, NF4Weight) and isinstance(down, NF4Weight)
        assert torch.equal(act[a], nf4_tile_gemv(x[a // 2 : a // 2 + 1], gate_up, None, config, gated=True)[0]), a
        assert torch.equal(y[a], nf4_tile_gemv(act[a : a + 1], down, None, config)[0]), a


def test_nf4_steps_of_few_tokens_run_the_tile_gemv() -> None:
    experts = random_experts("nf4", 8, 512, 768, seed=10)
    for n in (1, TILE_MAX_TOKENS):
        x = torch.randn(n, 512, device=DEV, dtype=BF16)
        weights, ids = routes(n, 8, 2, seed=11)
        assert tile_serves(experts, n) and not tile_serves(experts, TILE_MAX_TOKENS + 1)
        assert torch.equal(experts_forward(x, ids, weights, experts), tile_experts(x, ids, weights, experts))
