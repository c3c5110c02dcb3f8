"""DeepSeek-V3's mixture of experts: sigmoid router scores, group-limited top-k choice (the best `topk_group` of
`n_group` expert groups, each group ranked by the sum of its two best biased scores), `e_score_correction_bias`
added for the choice only, chosen weights renormalized when `norm_topk_prob` and scaled by
`routed_scaling_factor`; plus `n_shared_experts` always-on experts fused into one SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from corolla.models.layers import GatedMLP, mix_experts

NORM_EPS = 1e-20  # added to the top-k weight sum, as the reference does


class GroupLimitedMoE(nn.Module):
    """forward(x [B,T,H]) -> [B,T,H]. The router (`router.weight` [E, H], `e_score_correction_bias` [E]) is kept
    and computed in fp32 whatever the block dtype, as transformers keeps it."""

    def __init__(self, config):
        super().__init__()
        self.hidden_size = int(config.hidden_size)
        self.intermediate_size = int(config.moe_intermediate_size)
        self.num_experts = int(config.n_routed_experts)
        self.top_k = int(config.num_experts_per_tok)
        self.n_group = int(config.n_group)
        self.topk_group = int(config.topk_group)
        if self.num_experts % self.n_group:
            raise ValueError(f"n_routed_experts={self.num_experts} must be a multiple of n_group={self.n_group}")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds the experts of topk_group={self.topk_group}")
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.router = nn.Linear(self.hidden_size, self.num_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)
        act = config.hidden_act
        self.experts = nn.ModuleList(
            GatedMLP(self.hidden_size, self.intermediate_size, act) for _ in range(self.num_experts)
        )
        self.shared_experts = GatedMLP(self.hidden_size, self.intermediate_size * int(config.n_shared_experts), act)

    def _apply(self, fn, recurse: bool = True):
        """Dtype/device moves keep the router in fp32 (as transformers keeps `gate.weight` and the correction
        bias): in bf16 the bias, whose small differences between experts decide the choice, would be rounded away."""
        super()._apply(fn, recurse)
        for param in (self.router.weight, self.e_score_correction_bias):
            if param.dtype != torch.float32:
                param.data = param.data.float()
        return self

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """flat [N, H] -> (weights [N, k] fp32, expert ids [N, k])."""
        return group_limited_route(
            flat, self.router.weight, self.e_score_correction_bias, top_k=self.top_k, num_groups=self.n_group,
            topk_groups=self.topk_group, normalize=self.norm_topk_prob, scaling=self.routed_scaling_factor,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B,T,H] -> [B,T,H]
        B, T, H = x.shape
        flat = x.reshape(B * T, H)  # [N, H]
        top_w, top_i = self.route(flat)  # [N, k] each
        chosen = ((e, self.experts[e]) for e in torch.unique(top_i).tolist())
        return mix_experts(flat, top_w, top_i, chosen).reshape(B, T, H) + self.shared_experts(x)


def group_limited_route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    score_bias: torch.Tensor,
    *,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H]; router_weight [E, H], score_bias [E] (fp32). Sigmoid scores in fp32; the biased scores choose:
    the `topk_groups` best of `num_groups` groups (ranked by the sum of each group's two best), then the `top_k`
    best experts inside them; the chosen unbiased scores are renormalized when `normalize` and scaled by `scaling`.
    Returns (weights [N, k] fp32, ids [N, k] int64). No host sync (CUDA-graph safe): the fast path routes with it."""
    n = x.shape[0]
    num_experts = router_weight.shape[0]
    scores = F.linear(x.float(), router_weight.float()).sigmoid()  # [N, E] fp32
    biased = scores + score_bias.float()  # [N, E]: for the choice only
    per_group = biased.view(n, num_groups, num_experts // num_groups)  # [N, G, E/G]
    group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)  # [N, G]
    best_groups = group_scores.topk(topk_groups, dim=-1, sorted=False).indices  # [N, topk_groups]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)  # [N, G]
    expert_mask = group_mask[:, :, None].expand_as(per_group).reshape(n, num_experts)  # [N, E]
    choice = biased.masked_fill(~expert_mask, float("-inf"))  # [N, E]
    ids = choice.topk(top_k, dim=-1, sorted=False).indices  # [N, k]
    weights = scores.gather(1, ids)  # [N, k]
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    return weights * scaling, ids
