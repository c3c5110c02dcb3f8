"""The routed-experts op of the fast path on CPU (`engine.moe.routed_experts`): the torch reference against a per-token loop and
against the plain `SparseMoE` block, the softmax top-k router, the three ways to build `ExpertWeights` (in place,
no copies), ids outside the expert range, and input validation with the limit in the message."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from corolla.engine.moe.routed_experts import (
    ExpertWeights,
    RoutedMoE,
    experts_forward,
    experts_forward_ref,
    softmax_topk,
)
from corolla.models.layers import SparseMoE

E, H, INTER = 5, 24, 16


def random_experts(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    gate_up = [(torch.randn(2 * INTER, H, generator=g) / 4).to(dtype) for _ in range(E)]
    down = [(torch.randn(H, INTER, generator=g) / 4).to(dtype) for _ in range(E)]
    return gate_up, down


def per_token_loop(x, ids, weights, gate_up, down) -> torch.Tensor:
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            gate, up = F.linear(x[n], gate_up[e]).chunk(2)
            out[n] += weights[n, j] * F.linear(F.silu(gate) * up, down[e])
    return out


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_reference_matches_per_token_loop(top_k: int) -> None:
    gate_up, down = random_experts()
    experts = ExpertWeights(tuple(gate_up), tuple(down))
    x = torch.randn(9, H)
    weights, ids = softmax_topk(torch.randn(9, E), top_k, normalize=True)
    expected = per_token_loop(x, ids, weights, gate_up, down)
    torch.testing.assert_close(experts_forward_ref(x, ids, weights, experts), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(experts_forward(x, ids, weights, experts), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("normalize", [True, False])
def test_routed_moe_matches_sparse_moe_block(normalize: bool) -> None:
    torch.manual_seed(1)
    block = SparseMoE(H, INTER, E, 2, "silu", normalize_top_k=normalize).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe = RoutedMoE.from_module(block)
    assert moe.experts.gate_up[3].data_ptr() == block.experts[3].gate_up.weight.data_ptr()  # read in place
    x = torch.randn(2, 7, H)
    with torch.no_grad():
        expected = block(x).reshape(14, H)
    torch.testing.assert_close(moe.forward(x.reshape(14, H)), expected, atol=1e-5, rtol=1e-5)


def test_softmax_topk_rule() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    w, ids = softmax_topk(logits, 2, normalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2]] and w.dtype == torch.float32
    torch.testing.assert_close(w, probs[:, [1, 2]])
    w_norm, _ = softmax_topk(logits.bfloat16(), 2, normalize=True)
    assert w_norm.dtype == torch.float32
    torch.testing.assert_close(w_norm.sum(-1), torch.ones(1))
    with pytest.raises(ValueError, match=r"top_k must lie in \[1, 4\]"):
        softmax_topk(logits, 5, normalize=True)


def test_stacked_experts_are_views_and_match() -> None:
    gate_up, down = random_experts(2)
    stacked_gu, stacked_dn = torch.stack(gate_up), torch.stack(down)
    experts = ExpertWeights.from_stacked(stacked_gu, stacked_dn)
    assert experts.gate_up[2].data_ptr() == stacked_gu[2].data_ptr()
    assert experts.gate_up_ptrs.tolist() == [t.data_ptr() for t in experts.gate_up]
    assert experts.down_ptrs.tolist() == [stacked_dn[e].data_ptr() for e in range(E)]
    assert (experts.num_experts, experts.hidden_size, experts.intermediate_size) == (E, H, INTER)
    assert experts.expert_nbytes() == 3 * H * INTER * 4
    x = torch.randn(4, H)
    weights, ids = softmax_topk(torch.randn(4, E), 2, normalize=True)
    torch.testing.assert_close(
        experts_forward(x, ids, weights, experts),
        experts_forward(x, ids, weights, ExpertWeights(tuple(gate_up), tuple(down))),
    )


def test_ids_outside_the_experts_contribute_nothing() -> None:
    gate_up, down = random_experts(3)
    experts = ExpertWeights(tuple(gate_up), tuple(down))
    x = torch.randn(3, H)
    ids = torch.tensor([[0, E], [-1, 2], [4, 1]])
    weights = torch.rand(3, 2)
    expected = per_token_loop(x[[2]], ids[[2]], weights[[2]], gate_up, down)
    out = experts_forward(x, ids, weights, experts)
    torch.testing.assert_close(out[2:], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0], per_token_loop(x[:1], ids[:1, :1], weights[:1, :1], gate_up, down)[0])
    torch.testing.assert_close(out[1], per_token_loop(x[1:2], ids[1:2, 1:], weights[1:2, 1:], gate_up, down)[0])


def test_bfloat16_rounds_each_expert_output_like_the_block() -> None:
    torch.manual_seed(4)
    block = SparseMoE(H, INTER, E, 2, "silu").to(torch.bfloat16).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(6, H, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = block(x[None])[0].float()
    out = RoutedMoE.from_module(block).forward(x).float()
    assert (out - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()


def test_validation_names_the_limit() -> None:
    gate_up, down = random_experts()
    experts = ExpertWeights(tuple(gate_up), tuple(down))
    ids = torch.zeros(2, 2, dtype=torch.long)
    w = torch.ones(2, 2)
    with pytest.raises(ValueError, match=rf"x must be \[N, {H}\]"):
        experts_forward(torch.randn(2, H + 1), ids, w, experts)
    with pytest.raises(ValueError, match="expert_weights must be float32"):
        experts_forward(torch.randn(2, H), ids, w.half(), experts)
    with pytest.raises(ValueError, match="expert_ids must be an integer"):
        experts_forward(torch.randn(2, H), ids.float(), w, experts)
    with pytest.raises(ValueError, match=r"x must be torch.float32"):
        experts_forward(torch.randn(2, H, dtype=torch.float64), ids, w, experts)
    with pytest.raises(ValueError, match="expert 1"):
        ExpertWeights((gate_up[0], gate_up[1][:-2]), tuple(down[:2]))
    with pytest.raises(ValueError, match="contiguous"):
        ExpertWeights((gate_up[0], gate_up[1]), (down[0], down[1].t().contiguous().t()))
    with pytest.raises(ValueError, match="router must be"):
        RoutedMoE(torch.randn(E + 1, H), experts, 2, True)
    block = SparseMoE(H, INTER, E, 2, "silu", expert_ids=[0, 1])
    with pytest.raises(ValueError, match="every expert of the layer"):
        RoutedMoE.from_module(block)
