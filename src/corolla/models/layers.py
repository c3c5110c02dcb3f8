"""Small building blocks shared by the families: RMSNorm, gated (SwiGLU-style) and dense MLPs, and the sparse
mixture-of-experts MLP with its router (`softmax_topk`) and the weighted sum over the chosen experts (`mix_experts`,
also the other families' mixtures'). Projections are plain `nn.Linear` so quantization, LoRA and tensor parallelism
can replace or slice them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


def activation(name: str):
    """Activation by the name transformers configs use."""
    if name in ("silu", "swish"):
        return F.silu
    if name == "gelu":
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "bloom_gelu"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    raise ValueError(f"Unsupported activation {name!r}")


RMSNormKind = Literal["llama", "gemma", "gpt_oss"]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32. How the gain applies differs by family, each as its reference rounds:
    "llama" (Llama/Mistral/Mixtral) scales in the input dtype; "gemma" multiplies by (1 + weight) in fp32 before the
    cast (weights stored as offsets); "gpt_oss" multiplies by the weight before the cast."""

    def __init__(self, hidden_size: int, eps: float, *, kind: RMSNormKind = "llama"):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if kind == "gemma" else torch.ones(hidden_size))
        self.eps, self.kind = eps, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.kind == "gemma":
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        if self.kind == "gpt_oss":
            return (self.weight * x32).to(x.dtype)
        return self.weight * x32.to(x.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one projection: rows [gate (I); up (I)]."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)
        self.act_name = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # 2 x [..., I]
        return self.down(self.act(gate) * up)


class DenseMLP(nn.Module):
    """down(act(up(x))) (Falcon, BLOOM)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = True):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.up = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)
        self.act_name = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return self.down(self.act(self.up(x)))


class SparseMoE(nn.Module):
    """Top-k routed experts (Mixtral): softmax over router logits in fp32, top-k renormalized, each token's
    output the weighted sum of its experts' GatedMLP outputs. `expert_ids` are the global ids of the experts this
    module holds (all of them unless tensor parallel split them); the router is always complete."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        act: str,
        expert_ids: list[int] | None = None,
        *,
        normalize_top_k: bool = True,
    ):
        super().__init__()
        self.hidden_size, self.intermediate_size, self.act_name = hidden_size, intermediate_size, act
        self.normalize_top_k = normalize_top_k  # False: the top-k softmax weights as they are (Qwen3-MoE option)
        self.num_experts = num_experts
        self.top_k = top_k
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.expert_ids: list[int] = list(range(num_experts)) if expert_ids is None else list(expert_ids)
        self.experts = nn.ModuleList(GatedMLP(hidden_size, intermediate_size, act) for _ in self.expert_ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B,T,H] -> [B,T,H]
        B, T, H = x.shape
        flat = x.reshape(B * T, H)  # [N, H]
        logits = F.linear(flat, self.router.weight.to(flat.device))  # [N, E]
        top_w, top_i = softmax_topk(logits, self.top_k, normalize=self.normalize_top_k)  # [N, k] each
        return mix_experts(flat, top_w, top_i, zip(self.expert_ids, self.experts, strict=True)).reshape(B, T, H)


def softmax_topk(logits: torch.Tensor, top_k: int, *, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, k] fp32, ids [N, k] int64): softmax in fp32 over all experts, the k largest,
    renormalized to sum 1 when `normalize` (Mixtral; Qwen3-MoE's `norm_topk_prob`)."""
    if not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"top_k must lie in [1, {logits.shape[-1]}], got {top_k}")
    probs = torch.softmax(logits.float(), dim=-1)  # [N, E] fp32
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [N, k] each
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def mix_experts(
    flat: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: Iterable[tuple[int, Callable[[torch.Tensor], torch.Tensor]]],
) -> torch.Tensor:
    """flat [N, H] routed to experts `ids` [N, k] with `weights` [N, k] fp32 -> [N, H]: each (id, expert) of
    `experts` in turn runs on its tokens, its output weighted in fp32 and added in flat's dtype (the blocks' order of
    rounding); experts no token chose are skipped, ids of no listed expert contribute nothing."""
    out = torch.zeros_like(flat)  # [N, H]
    for expert_id, expert in experts:
        token_idx, slot = torch.where(ids == expert_id)  # [n], [n]
        if token_idx.numel() == 0:
            continue
        y = expert(flat[token_idx]) * weights[token_idx, slot, None]  # [n, H] fp32
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out
