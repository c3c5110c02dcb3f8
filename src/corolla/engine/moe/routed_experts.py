"""Routed mixture-of-experts for the fast path: SwiGLU experts read in place (`ExpertWeights`, or bitsandbytes'
NF4 / Int8 layouts as `moe_quant.QuantizedExpertWeights`), `experts_forward` over them, and `RoutedMoE`, the MLP of
one Mixtral / Qwen3-MoE layer (the DeepSeek-V3 fast path calls `experts_forward` with its own group-limited router).
The CUDA kernels read the experts' tensors through a table of their addresses: nothing is gathered or copied per
step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from corolla.engine.kernels.graph_timing import graph_median_ms
from corolla.engine.moe import moe_nf4_tile
from corolla.engine.moe.expert_set import ExpertSet, module_weights
from corolla.engine.moe.moe_quant import QuantizedExpertWeights
from corolla.engine.quant.quant_weights import quantized_weight_of
from corolla.models.layers import SparseMoE, softmax_topk
from corolla.utils.logging import get_logger

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs use the reference.
    from corolla.engine.moe import moe_kernels, moe_quant_kernels

    TRITON_IMPORTED = True
except ImportError:  # pragma: no cover - depends on the installation
    TRITON_IMPORTED = False

logger = get_logger(__name__)

WEIGHT_ALIGNMENT_BYTES = 16  # the kernels load expert rows as 16-byte vectors from the address table
KERNEL_MAX_TOKENS = 256  # above this (prefill chunks) one dense GEMM per used expert is faster than the grouped kernel


@dataclass(frozen=True)
class ExpertWeights(ExpertSet):
    """E SwiGLU experts of one layer: `gate_up[e]` [2I, H] (rows [gate; up]), `down[e]` [H, I], of one dtype on one
    device, row-major, read in place."""

    gate_up: tuple[torch.Tensor, ...]
    down: tuple[torch.Tensor, ...]
    gate_up_ptrs: torch.Tensor = field(init=False)  # [E] int64 on the experts' device: addresses of gate_up[e]
    down_ptrs: torch.Tensor = field(init=False)  # [E] int64
    boundaries: torch.Tensor = field(init=False)  # [E + 1] int64: 0..E, for segmenting sorted expert ids

    def __post_init__(self) -> None:
        self._check_shapes()
        first = self.gate_up[0]
        for e, (gu, dn) in enumerate(zip(self.gate_up, self.down, strict=True)):
            for t in (gu, dn):
                if t.dtype != first.dtype or t.device != first.device:
                    raise ValueError(f"expert {e}: every tensor must be {first.dtype} on {first.device}")
                if not t.is_floating_point() or not t.is_contiguous():
                    raise ValueError(f"expert {e}: weights must be contiguous floating-point tensors")
                if t.data_ptr() % WEIGHT_ALIGNMENT_BYTES:
                    raise ValueError(f"expert {e}: weights must start on {WEIGHT_ALIGNMENT_BYTES}-byte boundaries")
        dev = first.device
        object.__setattr__(self, "gate_up_ptrs", _address_table(self.gate_up, dev))
        object.__setattr__(self, "down_ptrs", _address_table(self.down, dev))

    @classmethod
    def from_stacked(cls, gate_up: torch.Tensor, down: torch.Tensor) -> ExpertWeights:
        """gate_up [E, 2I, H], down [E, H, I] (transformers 5's layout): per-expert views of the same storage."""
        if gate_up.ndim != 3 or down.ndim != 3 or gate_up.shape[0] != down.shape[0]:
            raise ValueError(
                f"need gate_up [E, 2I, H] and down [E, H, I], got {tuple(gate_up.shape)}, {tuple(down.shape)}"
            )
        return cls(tuple(gate_up.unbind(0)), tuple(down.unbind(0)))

    @classmethod
    def from_modules(cls, experts: Sequence[torch.nn.Module]) -> ExpertWeights:
        """corolla `GatedMLP` experts with plain bias-free `nn.Linear` projections (ValueError otherwise: quantized or
        LoRA-wrapped experts are not read by this op)."""

        def weight_of(e: int, name: str, linear: torch.nn.Module) -> torch.Tensor:
            if type(linear) is not torch.nn.Linear or linear.bias is not None:
                raise ValueError(f"expert {e}: {name} must be a bias-free torch.nn.Linear, not {type(linear).__name__}")
            return linear.weight.data

        return cls(*module_weights(experts, weight_of))

    def expert_nbytes(self) -> int:
        """Bytes of one expert's weights (what a step reads per expert it uses)."""
        return 3 * self.hidden_size * self.intermediate_size * self.gate_up[0].element_size()

    def nbytes(self) -> int:
        return self.num_experts * self.expert_nbytes()

    def dense(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, H], down [H, I]) as they are (the torch reference's view)."""
        return self.gate_up[e], self.down[e]


Experts = ExpertWeights | QuantizedExpertWeights  # dense or bitsandbytes-quantized experts of one layer


def _address_table(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64).to(device)  # [E]


# ---------------------------------------------------------------------------------------------- experts


def _check_inputs(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, experts: Experts):
    n = x.shape[0]
    if x.ndim != 2 or x.shape[1] != experts.hidden_size:
        raise ValueError(f"x must be [N, {experts.hidden_size}], got {tuple(x.shape)}")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != n or expert_ids.dtype.is_floating_point:
        raise ValueError(
            f"expert_ids must be an integer [{n}, k] tensor, got {expert_ids.dtype} {tuple(expert_ids.shape)}"
        )
    if tuple(expert_weights.shape) != tuple(expert_ids.shape) or expert_weights.dtype != torch.float32:
        raise ValueError(
            f"expert_weights must be float32 {tuple(expert_ids.shape)}, got {expert_weights.dtype} "
            f"{tuple(expert_weights.shape)}"
        )
    if x.dtype != experts.dtype or x.device != experts.device:
        raise ValueError(f"x must be {experts.dtype} on {experts.device}, got {x.dtype} on {x.device}")


def experts_forward(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    experts: Experts,
    *,
    use_triton: bool = True,
    config: tuple[int, ...] | None = None,
    graph_safe: bool = False,
) -> torch.Tensor:
    """x [N, H], expert_ids [N, k] int, expert_weights [N, k] fp32 -> [N, H] in x's dtype: out[n] = sum_j
    expert_weights[n, j] * down_e(silu(gate_e(x[n])) * up_e(x[n])), e = expert_ids[n, j]; each expert's output is
    rounded to x's dtype before it is weighted (as the plain blocks do), the k terms summed in fp32 and rounded once;
    ids outside [0, E) contribute nothing. On CUDA with Triton and N <= `KERNEL_MAX_TOKENS`: the grouped kernels
    (`moe_kernels`, `moe_quant_kernels`; NF4 steps of at most `moe_nf4_tile.TILE_MAX_TOKENS` tokens the matrix-unit
    GEMV), no host sync, so CUDA-graph safe, each chosen expert's weights read once per step; else
    `experts_forward_ref`. `use_triton=False` forces the reference; `config` is an entry of `expert_configs(experts)`
    (default: the first); `graph_safe=True` keeps the kernel on CUDA whatever N, as a captured step needs."""
    _check_inputs(x, expert_ids, expert_weights, experts)
    if use_triton and kernel_usable(experts.device) and (graph_safe or x.shape[0] <= KERNEL_MAX_TOKENS):
        if isinstance(experts, QuantizedExpertWeights) and tile_serves(experts, x.shape[0]):
            return moe_nf4_tile.tile_experts(x, expert_ids, expert_weights, experts)
        config = config or expert_configs(experts)[0]
        if isinstance(experts, QuantizedExpertWeights):
            return moe_quant_kernels.grouped_quant_experts(x, expert_ids, expert_weights, experts, config)
        return moe_kernels.grouped_experts(x, expert_ids, expert_weights, experts, config)
    return experts_forward_ref(x, expert_ids, expert_weights, experts)


def expert_configs(experts: Experts) -> tuple[tuple[int, ...], ...]:
    """The kernel configs (BLOCK_N, BLOCK_K, warps, stages[, NF4 decode]) for this kind of experts; () without CUDA +
    Triton."""
    if not kernel_usable(experts.device):
        return ()
    if isinstance(experts, QuantizedExpertWeights):
        return moe_quant_kernels.configs_for(experts.kind)
    return moe_kernels.EXPERT_CONFIGS


def kernel_usable(device: torch.device) -> bool:
    return TRITON_IMPORTED and device.type == "cuda"


def tile_serves(experts: Experts, tokens: int) -> bool:
    """Whether a CUDA step of `tokens` tokens runs `moe_nf4_tile`'s GEMV (NF4 experts, at most TILE_MAX_TOKENS) rather
    than the grouped Triton kernels (whose `config` then goes unused)."""
    return (
        isinstance(experts, QuantizedExpertWeights)
        and tokens <= moe_nf4_tile.TILE_MAX_TOKENS
        and moe_nf4_tile.tile_usable(experts)
    )


def experts_forward_ref(
    x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, experts: Experts
) -> torch.Tensor:
    """The torch reference of `experts_forward` (same contract): one GEMM pair per used expert, fp32 accumulation
    of the weighted expert outputs. Reads the used experts only (quantized ones dequantized to the compute dtype,
    as bitsandbytes' layers compute); needs a host sync to find them."""
    _check_inputs(x, expert_ids, expert_weights, experts)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [N, H]
    ids = expert_ids.long()
    inter = experts.intermediate_size
    for e in torch.unique(ids).tolist():
        if not 0 <= e < experts.num_experts:
            continue  # ids outside [0, E) contribute nothing
        token_idx, slot = torch.where(ids == e)  # [n], [n]
        w_gate_up, w_down = experts.dense(e)  # [2I, H], [H, I]
        gate_up = F.linear(x[token_idx], w_gate_up)  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
        y = F.linear(act, w_down)  # [n, H] in x's dtype
        out.index_add_(0, token_idx, y.float() * expert_weights[token_idx, slot, None])
    return out.to(x.dtype)


@dataclass(frozen=True)
class RoutedMoE:
    """The MLP of one Mixtral / Qwen3-MoE layer: `router` [E, H] (in the block's dtype, as the plain block computes
    its logits), softmax top-`top_k` routing (renormalized when `normalize_top_k`) over `experts`."""

    router: torch.Tensor  # [E, H]
    experts: Experts
    top_k: int
    normalize_top_k: bool

    def __post_init__(self) -> None:
        e, h = self.experts.num_experts, self.experts.hidden_size
        if tuple(self.router.shape) != (e, h):
            raise ValueError(f"router must be [{e}, {h}], got {tuple(self.router.shape)}")
        if not 1 <= self.top_k <= e:
            raise ValueError(f"top_k must lie in [1, {e}], got {self.top_k}")

    @classmethod
    def from_module(cls, moe: SparseMoE) -> RoutedMoE:
        """A corolla `SparseMoE` holding all of its layer's experts (ValueError for a tensor-parallel slice); experts
        quantized by bitsandbytes (`models.quantization`) are read as `QuantizedExpertWeights` in the router's dtype."""
        num_experts = int(moe.num_experts)
        if list(moe.expert_ids) != list(range(num_experts)):
            raise ValueError("The fast path needs every expert of the layer (not a tensor-parallel slice)")
        if type(moe.router) is not torch.nn.Linear:
            raise ValueError(f"The router must be a plain torch.nn.Linear, not {type(moe.router).__name__}")
        modules = list(moe.experts)
        first = modules[0].get_submodule("gate_up") if modules else None
        quantized = first is not None and quantized_weight_of(first, moe.router.weight.dtype) is not None
        return cls(
            router=moe.router.weight.data,
            experts=(
                QuantizedExpertWeights.from_modules(modules, moe.router.weight.dtype)
                if quantized
                else ExpertWeights.from_modules(modules)
            ),
            top_k=int(moe.top_k),
            normalize_top_k=bool(moe.normalize_top_k),
        )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(experts, hidden size, expert intermediate size, top_k): what a kernel config is tuned for."""
        return (self.experts.num_experts, self.experts.hidden_size, self.experts.intermediate_size, self.top_k)

    def nbytes(self) -> int:
        return self.router.numel() * self.router.element_size() + self.experts.nbytes()

    def active_nbytes(self, num_used_experts: int) -> int:
        """Bytes one step reads when `num_used_experts` distinct experts are chosen (router included)."""
        return self.router.numel() * self.router.element_size() + num_used_experts * self.experts.expert_nbytes()

    def forward(
        self,
        x: torch.Tensor,
        *,
        use_triton: bool = True,
        config: tuple[int, ...] | None = None,
        graph_safe: bool = False,
    ) -> torch.Tensor:
        """x [N, H] (already normed) -> [N, H]."""
        logits = F.linear(x, self.router)  # [N, E] in x's dtype, as the plain block
        weights, ids = softmax_topk(logits, self.top_k, normalize=self.normalize_top_k)  # [N, k] each
        return experts_forward(
            x, ids, weights, self.experts, use_triton=use_triton, config=config, graph_safe=graph_safe
        )


@torch.inference_mode()
def tune_experts(layers: Sequence[RoutedMoE], *, rows: Sequence[int] = (1, 8), reps: int = 7) -> dict:
    """`time_expert_configs` for Mixtral / Qwen3-MoE layers, each routed by its own router."""
    if not layers:
        return {}

    def calls_at(n: int) -> Callable[[tuple[int, ...]], object]:
        first = layers[0].experts
        x = torch.randn(n, first.hidden_size, device=first.device, dtype=first.dtype)  # [n, H]
        return lambda config: [moe.forward(x, config=config) for moe in layers]

    return time_expert_configs(layers[0].experts, len(layers), calls_at, rows=rows, reps=reps)


def time_expert_configs(
    experts: Experts,
    num_layers: int,
    calls_at: Callable[[int], Callable[[tuple[int, ...]], object]],
    *,
    rows: Sequence[int] = (1, 8),
    reps: int = 7,
) -> dict:
    """Times every `expert_configs` entry of `experts`' kind at each token count in `rows` (`calls_at(n)(config)`
    runs random tokens of n rows, routed by each layer's own router, through the experts of all `num_layers` layers),
    as one CUDA graph (distinct weights, no launch gaps), and keeps the config with the least summed slowdown against
    each count's fastest. One config then serves every batch size (rows stay batch-invariant), but for NF4 experts
    the counts `tile_serves`, which run `moe_nf4_tile`'s GEMV (timed once, as "tile"; the configs then at the other
    counts, or at twice its range). Returns {"best": config, "best_us": per layer call at the least count timed, "us":
    {rows: {config or "tile": us}}}; {} without CUDA + Triton."""
    configs = expert_configs(experts)
    if not configs:
        return {}
    # token counts the NF4 tile GEMV serves are timed once (it takes no config); the configs at the others, or at
    # twice the tile range when every count is in it
    tile_us: dict[int, float] = {}
    for n in (n for n in rows if tile_serves(experts, n)):
        tile_us[n] = graph_median_ms(lambda call=calls_at(n): call(configs[0]), reps) * 1000 / num_layers
    rows = [n for n in rows if n not in tile_us] or [2 * moe_nf4_tile.TILE_MAX_TOKENS]
    timings: dict[int, dict[tuple[int, ...], float]] = {}
    for n in rows:
        call = calls_at(n)
        timings[n] = {}
        for config in configs:
            try:
                ms = graph_median_ms(lambda c=config, call=call: call(c), reps)
            except Exception as e:  # a config that does not compile or fit is skipped
                logger.info(f"moe.tune_experts.skip(config={config}, rows={n}, error={type(e).__name__})")
                continue
            timings[n][config] = ms * 1000 / num_layers
    common = set.intersection(*(set(t) for t in timings.values()))
    if not common:
        raise RuntimeError(f"no expert kernel config runs for {experts.hidden_size} x {experts.intermediate_size}")
    fastest = {n: min(t.values()) for n, t in timings.items()}
    best = min(common, key=lambda c: sum(timings[n][c] / fastest[n] for n in rows))
    us = {n: {"tile": v} for n, v in tile_us.items()} | {
        n: {str(c): v for c, v in t.items()} for n, t in timings.items()
    }
    first = min(us)
    return {"best": best, "best_us": tile_us[first] if first in tile_us else timings[first][best], "us": us}
