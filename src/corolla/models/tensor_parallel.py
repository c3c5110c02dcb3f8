"""Tensor parallelism inside one block: attention heads (with their KV heads and cache) and the MLP's
intermediate dimension (or Mixtral's experts) are split over several local devices; norms and residuals stay on
the output device. The block keeps the same forward/cache contract; its cache has K and V per shard."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from corolla.models.attention import Attention
from corolla.models.block_base import BlockAttention, CorollaBlock, TensorDescriptor
from corolla.models.layers import DenseMLP, GatedMLP, SparseMoE
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

SPLIT_ATTR = "corolla_split"  # on a sliced nn.Linear: ("rows" | "cols", LongTensor of full-layer indices, full size)


def make_tensor_parallel(block: CorollaBlock, devices: Sequence[torch.device | str]) -> CorollaBlock:
    """Splits `block` in place over `devices` (call before `quantize_block` and `add_adapter`) and returns it.
    Inputs and outputs live on the first device. One device: just moves the block."""
    targets = [torch.device(d) for d in devices]
    if not targets:
        raise ValueError("make_tensor_parallel needs at least one device")
    out = targets[0]
    if len(targets) == 1:
        return block.to(targets[0])
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear) and type(module) is not nn.Linear:
            raise ValueError(f"{name} is already quantized ({type(module).__name__}): call make_tensor_parallel first")
    if isinstance(block.attn, ParallelAttention):
        raise ValueError("block is already tensor parallel")
    if not isinstance(block.attn, Attention) or block.attn.fp32_scores:  # e.g. DeepSeek-V3's latent attention
        raise ValueError(f"tensor parallelism can't split {type(block.attn).__name__} of {type(block).__name__}")
    attn = ParallelAttention(_split_attention(block.attn, targets), out)
    block.attn = attn
    if isinstance(block.mlp, SparseMoE):
        block.mlp = ParallelMLP(_split_moe(block.mlp, targets), out)
    elif isinstance(block.mlp, GatedMLP | DenseMLP):
        block.mlp = ParallelMLP(_split_mlp(block.mlp, targets), out)
    else:
        raise ValueError(f"Cannot split MLP {type(block.mlp).__name__}")
    for name, child in block.named_children():
        if name not in ("attn", "mlp"):
            child.to(out)
    block.tensor_parallel_devices = tuple(targets)
    logger.info(
        "tensor_parallel.split(layer=%d, devices=%s, heads=%s)",
        block.layer_idx, [str(d) for d in targets], [s.num_heads for s in attn.attention_shards],
    )  # fmt: skip
    return block


class ParallelAttention(BlockAttention):
    """Attention shards (each an `Attention` over some heads, on its device); outputs summed on `output_device`."""

    def __init__(self, shards: Sequence[Attention], output_device: torch.device):
        super().__init__()
        if not shards:
            raise ValueError("ParallelAttention needs at least one shard")
        self.shards = nn.ModuleList(shards)  # registers them: their parameters are `shards.<i>.*`
        self.attention_shards = tuple(shards)  # the same modules as `Attention`s (a ModuleList yields nn.Modules)
        self.output_device = output_device

    def cache_descriptors(self, batch_size: int, max_length: int, dtype: torch.dtype) -> list[TensorDescriptor]:
        return [d for shard in self.attention_shards for d in shard.cache_descriptors(batch_size, max_length, dtype)]

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None, position: int) -> torch.Tensor:
        if cache is not None and len(cache) != 2 * len(self.shards):
            raise ValueError(f"expected {2 * len(self.shards)} cache tensors (K, V per shard), got {len(cache)}")
        total: torch.Tensor | None = None
        for i, shard in enumerate(self.attention_shards):
            device = shard.o_proj.weight.device
            part = shard(x.to(device), None if cache is None else cache[2 * i : 2 * i + 2], position)  # [B, T, H]
            part = part.to(self.output_device)
            total = part if total is None else total + part
        assert total is not None  # __init__ refuses an empty shard list
        return total

    def route(self, subpath: str) -> list[tuple[nn.Module, str]]:
        """Where a linear of the unsplit attention (`qkv`, `o_proj`) lives: every shard holds a slice."""
        return [(shard, subpath) for shard in self.shards]


class ParallelMLP(nn.Module):
    """MLP shards (slices of the intermediate dimension, or subsets of experts); outputs summed."""

    def __init__(self, shards: Sequence[nn.Module], output_device: torch.device):
        super().__init__()
        if not shards:
            raise ValueError("ParallelMLP needs at least one shard")
        self.shards = nn.ModuleList(shards)
        self.output_device = output_device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total: torch.Tensor | None = None
        for shard in self.shards:
            device = next(shard.parameters()).device
            part = shard(x.to(device)).to(self.output_device)  # [B, T, H]
            total = part if total is None else total + part
        assert total is not None  # __init__ refuses an empty shard list
        return total

    def route(self, subpath: str) -> list[tuple[nn.Module, str]]:
        parts = subpath.split(".")
        if parts[0] == "experts":  # whole experts live on one shard each
            expert = int(parts[1])
            for shard in self.shards:
                if isinstance(shard, SparseMoE) and expert in shard.expert_ids:
                    local = shard.expert_ids.index(expert)
                    return [(shard.experts[local], ".".join(parts[2:]))]
            raise KeyError(f"expert {expert} not found in any shard")
        if parts[0] == "router":
            raise ValueError("the MoE router is replicated on every shard; LoRA on it is not supported")
        return [(shard, subpath) for shard in self.shards]


# --- splitting helpers ---------------------------------------------------------------------------------------


def _sliced_linear(src: nn.Linear, device: torch.device, *, rows=None, cols=None, bias: bool = True) -> nn.Linear:
    """A new nn.Linear on `device` holding rows (output features) or columns (input features) of `src`."""
    weight = src.weight.detach()
    if rows is not None:
        weight = weight[rows]
    if cols is not None:
        weight = weight[:, cols]
    has_bias = bias and src.bias is not None
    with torch.device("meta"):
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias)
    lin = lin.to_empty(device=device).to(weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if has_bias:
            b = src.bias.detach()
            lin.bias.copy_(b[rows] if rows is not None else b)
    lin.requires_grad_(src.weight.requires_grad)
    if rows is not None:
        setattr(lin, SPLIT_ATTR, ("rows", torch.as_tensor(rows), src.out_features))
    elif cols is not None:
        setattr(lin, SPLIT_ATTR, ("cols", torch.as_tensor(cols), src.in_features))
    return lin


def _head_assignment(num_heads: int, num_kv_heads: int, n: int) -> list[tuple[list[int], list[int]]]:
    """[(query heads, kv heads)] per shard. KV heads are split when they divide evenly; otherwise (e.g. multi-query)
    each shard takes a slice of one KV group's query heads and a copy of that KV head."""
    group = num_heads // num_kv_heads
    if num_kv_heads % n == 0:
        kv_per = num_kv_heads // n
        return [
            (list(range(i * kv_per * group, (i + 1) * kv_per * group)), list(range(i * kv_per, (i + 1) * kv_per)))
            for i in range(n)
        ]
    if num_heads % n == 0 and group % (num_heads // n) == 0:
        per = num_heads // n
        return [(list(range(i * per, (i + 1) * per)), [(i * per) // group]) for i in range(n)]
    raise ValueError(
        f"Cannot split {num_heads} attention heads with {num_kv_heads} KV heads over {n} devices evenly; "
        f"use a number of devices dividing {num_kv_heads} (or {num_heads} for multi-query models)"
    )


def _split_attention(attn: Attention, devices: list[torch.device]) -> list[Attention]:
    h, kv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    shards = []
    for i, (q_heads, kv_heads) in enumerate(_head_assignment(h, kv, len(devices))):
        q_rows = [hh * hd + d for hh in q_heads for d in range(hd)]
        k_rows = [(h + g) * hd + d for g in kv_heads for d in range(hd)]
        v_rows = [(h + kv + g) * hd + d for g in kv_heads for d in range(hd)]
        with torch.device("meta"):
            shard = Attention(
                attn.hidden_size, len(q_heads), len(kv_heads), hd, qkv_bias=False, out_bias=False,
                rotary=copy.copy(attn.rotary), alibi=attn.alibi, alibi_scale=attn.alibi_scale,
                alibi_bf16_product=attn.alibi_bf16_product, total_heads=attn.total_heads,
                sliding_window=attn.sliding_window,
            )  # fmt: skip
        if attn.q_norm is not None and attn.k_norm is not None:  # per-head norms: every shard holds them whole
            shard.q_norm = copy.deepcopy(attn.q_norm).to(devices[i])
            shard.k_norm = copy.deepcopy(attn.k_norm).to(devices[i])
        shard.head_ids = [attn.head_ids[q] for q in q_heads]
        shard.qkv = _sliced_linear(attn.qkv, devices[i], rows=torch.tensor(q_rows + k_rows + v_rows))
        shard.o_proj = _sliced_linear(attn.o_proj, devices[i], cols=torch.tensor(q_rows), bias=i == 0)
        shards.append(shard)
    return shards


def _split_mlp(mlp: GatedMLP | DenseMLP, devices: list[torch.device]) -> list[nn.Module]:
    inter = mlp.intermediate_size
    chunks = torch.arange(inter).tensor_split(len(devices))
    shards: list[nn.Module] = []
    for i, chunk in enumerate(chunks):
        if len(chunk) == 0:
            continue
        hidden = (mlp.gate_up if isinstance(mlp, GatedMLP) else mlp.up).in_features
        with torch.device("meta"):
            shard = type(mlp)(hidden, len(chunk), mlp.act_name, bias=False)
        if isinstance(mlp, GatedMLP):
            shard.gate_up = _sliced_linear(mlp.gate_up, devices[i], rows=torch.cat([chunk, chunk + inter]))
        else:
            shard.up = _sliced_linear(mlp.up, devices[i], rows=chunk)
        shard.down = _sliced_linear(mlp.down, devices[i], cols=chunk, bias=i == 0)
        shards.append(shard)
    return shards


def _split_moe(moe: SparseMoE, devices: list[torch.device]) -> list[SparseMoE]:
    shards = []
    for i, ids in enumerate(torch.arange(moe.num_experts).tensor_split(len(devices))):
        if len(ids) == 0:
            continue
        expert_ids = [moe.expert_ids[int(e)] for e in ids]
        with torch.device("meta"):
            shard = SparseMoE(
                moe.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, moe.act_name, expert_ids,
                normalize_top_k=moe.normalize_top_k,
            )  # fmt: skip
        shard.router = copy.deepcopy(moe.router).to(devices[i])  # the router is small: every shard has it
        shard.experts = nn.ModuleList(copy.deepcopy(moe.experts[int(e)]).to(devices[i]) for e in ids)
        shards.append(shard)
    return shards
