"""NF4 routed experts at a few tokens on the matrix-unit GEMV of the dense NF4 projections
(`engine.quant.quant_tile_gemv`, one row a program row, bitsandbytes' bytes read in place): `experts_forward` on CUDA
for `moe_quant.QuantizedExpertWeights` of kind NF4 and at most `TILE_MAX_TOKENS` tokens.

Each of the A = N k assignments (token n's j-th choice, row n k + j) is an output row of the GEMV, whose programs
read the routes on the device (after the router ahead of them: no host sync, CUDA-graph safe), at two or more tokens
take up to four rows of one expert each (`GROUP_ROWS`, all the rows the routes give it at <= 4), and that expert's
codes through the experts' address table: the gated form writes silu(gate) * up [A, I] (gate and up rounded
as stored, gated as the SiLU kernel gates them), then the plain form the expert outputs [A, H] in the compute dtype;
torch weights them by the routing weights in fp32 and sums each token's k terms (the Triton kernels' epilogue). An id
outside [0, E) gives a zero row. At one token each chosen expert's bytes are read once, on every multiprocessor (the
grouped Triton kernels give an expert's whole rows to one program per column block and decode in registers: 13.9x
their floor on an H200, docs/decisions/0077); with more tokens an expert chosen by several is read once per four
choices (0061, 0103; with uniform top-2 routes of 8 tokens over 8 experts an expert is chosen 5 or more times with
probability 0.027), so an expert's bytes are read about once a step; above `TILE_MAX_TOKENS` the Triton kernels run.
Numerics as quant_tile_gemv (within the rounding of bitsandbytes' dequantized weights); a row's bits do not depend
on the other rows."""

from __future__ import annotations

import torch

from corolla.engine.moe.moe_quant import QuantizedExpertWeights
from corolla.engine.quant.quant_tile_gemv import NF4_TILE_CONFIGS, TILE_ROWS, nf4_tile_gemv_experts
from corolla.engine.quant.quant_weights import NF4Weight

TILE_MAX_TOKENS = 8  # steps of at most this many tokens run here (Mixtral: 16 assignments), larger ones on Triton

_CONFIGS: dict[tuple, tuple[int, int, int, int, int]] = {}  # (device, H, I, grouped) -> the first config that fits


def tile_usable(experts: QuantizedExpertWeights) -> bool:
    """Whether these experts run here: NF4 in a 16-bit compute dtype, 2I a multiple of the gated form's 32 rows."""
    return (
        experts.kind == "nf4"
        and experts.dtype in (torch.bfloat16, torch.float16)
        and experts.intermediate_size % TILE_ROWS == 0
    )


def tile_experts(
    x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, experts: QuantizedExpertWeights
) -> torch.Tensor:
    """`routed_experts.experts_forward` for `tile_usable` experts (inputs checked there): x [N, H], expert_ids [N, k],
    expert_weights [N, k] fp32 -> [N, H] in x's dtype. The tile config: the first of NF4_TILE_CONFIGS the device
    holds for both GEMVs (the H200's fastest on these shapes first, docs/decisions/0060)."""
    n, h = x.shape
    k = expert_ids.shape[1]
    routes = expert_ids.reshape(-1).long().contiguous()  # [A] the expert of each assignment row
    grouped = n > 1  # (one token's k choices are k distinct experts: nothing to group)
    gate_up, down = experts.gate_up[0], experts.down[0]
    assert isinstance(gate_up, NF4Weight) and isinstance(down, NF4Weight)  # tile_usable: kind nf4
    gu, dn = experts.gate_up_tables, experts.down_tables
    key = (x.device, h, experts.intermediate_size, grouped)
    errors = []
    for config in (_CONFIGS[key],) if key in _CONFIGS else NF4_TILE_CONFIGS:
        try:  # (a config the device cannot hold raises before that GEMV is launched; the group's x of w_down is
            # the larger: a gate_up launched under a config that w_down cannot run is run again under the next)
            act = nf4_tile_gemv_experts(
                x, gate_up, gu.addresses, gu.offsets, routes, k, config, gated=True, grouped=grouped
            )  # [A, I]
            y = nf4_tile_gemv_experts(act, down, dn.addresses, dn.offsets, routes, 1, config, grouped=grouped)  # [A, H]
        except ValueError as e:
            errors.append(str(e))
            continue
        _CONFIGS[key] = config
        break
    else:
        raise ValueError(f"no NF4 tile GEMV config runs these experts: {errors}")
    # each expert output rounded (as stored), weighted in fp32, a token's k terms summed in choice order
    return (y.view(n, k, h).float() * expert_weights[:, :, None]).sum(dim=1).to(x.dtype)  # [N, H]
