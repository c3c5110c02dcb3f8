"""Quantized routed experts for the fast path: a layer's E SwiGLU experts whose projections are bitsandbytes NF4
or Int8 layouts, read in place (no gather, repack or copy per step) by the grouped kernels of `moe_quant_kernels`
through per-expert address tables (`ProjectionTables`), and by `routed_experts.experts_forward_ref`, which
dequantizes only the experts a call uses. Every NF4 expert must use the same 16 levels and second-level code table
(bitsandbytes always does; the tile GEMV of `moe_nf4_tile` stages that table once)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from corolla.engine.moe.expert_set import ExpertSet, module_weights
from corolla.engine.quant.quant_weights import Int8Weight, NF4Weight, QuantizedWeight, quantized_weight_of
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

CODE_ALIGNMENT_BYTES = 16  # the kernels load packed codes as 16-byte vectors from the address table


@dataclass(frozen=True)
class ProjectionTables:
    """Address tables of one projection (gate_up or down) over the E experts, on the experts' device."""

    # [4, E] int64 addresses, rows: codes (NF4 packed [N, K/2] uint8 / Int8 [N, K] int8), scales (NF4 absmax codes
    # [N K / 64] uint8 / Int8 row scales [N] fp32), NF4 second-level absmaxes fp32, NF4 absmax code table [256] fp32
    # (Int8: the last two rows repeat the codes' addresses, unread)
    addresses: torch.Tensor
    offsets: torch.Tensor  # [E] fp32: NF4 absmax offsets (Int8: zeros, unread)

    @classmethod
    def of(cls, weights: Sequence[QuantizedWeight], device: torch.device) -> ProjectionTables:
        rows: list[list[torch.Tensor]]
        if isinstance(weights[0], NF4Weight):
            nf4 = [w for w in weights if isinstance(w, NF4Weight)]
            rows = [[w.packed for w in nf4], [w.absmax_codes for w in nf4], [w.nested_absmax for w in nf4]]
            rows.append([w.nested_code for w in nf4])
            offsets = [w.nested_offset for w in nf4]
        else:
            int8 = [w for w in weights if isinstance(w, Int8Weight)]
            rows = [[w.codes for w in int8], [w.col_scale for w in int8], [w.codes for w in int8]]
            rows.append(rows[0])
            offsets = [0.0] * len(int8)
        addresses = torch.tensor([[t.data_ptr() for t in row] for row in rows], dtype=torch.int64)  # [4, E]
        return cls(addresses.to(device), torch.tensor(offsets, dtype=torch.float32).to(device))


@dataclass(frozen=True)
class QuantizedExpertWeights(ExpertSet):
    """E SwiGLU experts of one layer: `gate_up[e]` [2I, H] and `down[e]` [H, I] quantized weights of one kind
    (all NF4 or all Int8), one compute dtype, one device (see module docstring)."""

    gate_up: tuple[QuantizedWeight, ...]
    down: tuple[QuantizedWeight, ...]
    gate_up_tables: ProjectionTables = field(init=False)
    down_tables: ProjectionTables = field(init=False)
    pair_levels: torch.Tensor = field(init=False)  # [256] int32 NF4 pair table (NF4Weight.pair_levels; Int8: zeros)
    boundaries: torch.Tensor = field(init=False)  # [E + 1] int64: 0..E, for segmenting sorted expert ids

    def __post_init__(self) -> None:
        self._check_shapes()
        first = self.gate_up[0]
        kind = type(first)
        for e, (gu, dn) in enumerate(zip(self.gate_up, self.down, strict=True)):
            if type(gu) is not kind or type(dn) is not kind:
                raise ValueError(f"expert {e}: every projection must be a {kind.__name__}")
            for w in (gu, dn):
                codes = w.packed if isinstance(w, NF4Weight) else w.codes
                if w.dtype != first.dtype or w.device != first.device:
                    raise ValueError(f"expert {e}: every weight must compute in {first.dtype} on {first.device}")
                if not codes.is_contiguous() or codes.data_ptr() % CODE_ALIGNMENT_BYTES:
                    raise ValueError(
                        f"expert {e}: codes must be contiguous from {CODE_ALIGNMENT_BYTES}-byte boundaries"
                    )
                if isinstance(w, NF4Weight) and not (
                    torch.equal(w.code, first.code)  # type: ignore[union-attr]
                    and torch.equal(w.nested_code, first.nested_code)  # type: ignore[union-attr]
                ):
                    raise ValueError(f"expert {e}: every expert must use the same 16 NF4 levels and absmax code table")
        dev = first.device
        object.__setattr__(self, "gate_up_tables", ProjectionTables.of(self.gate_up, dev))
        object.__setattr__(self, "down_tables", ProjectionTables.of(self.down, dev))
        pairs = first.pair_levels if isinstance(first, NF4Weight) else torch.zeros(256, dtype=torch.int32, device=dev)
        object.__setattr__(self, "pair_levels", pairs.contiguous())

    @classmethod
    def from_modules(cls, experts: Sequence[torch.nn.Module], dtype: torch.dtype) -> QuantizedExpertWeights:
        """corolla `GatedMLP` experts whose bias-free `gate_up` / `down` are bitsandbytes `Linear4bit` (nf4) or
        `Linear8bitLt` layers; `dtype` is the block's compute dtype. ValueError for anything else."""

        def weight_of(e: int, name: str, linear: torch.nn.Module) -> QuantizedWeight:
            weight = quantized_weight_of(linear, dtype)
            if weight is None or linear.bias is not None:
                raise ValueError(
                    f"expert {e}: {name} must be a bias-free bitsandbytes layer, not {type(linear).__name__}"
                )
            return weight

        return cls(*module_weights(experts, weight_of))

    @property
    def kind(self) -> str:
        """ "nf4" or "int8"."""
        return "nf4" if isinstance(self.gate_up[0], NF4Weight) else "int8"

    def expert_nbytes(self) -> int:
        """Bytes of one expert's packed codes and scales (what a step reads per expert it uses)."""
        return self.gate_up[0].nbytes() + self.down[0].nbytes()

    def nbytes(self) -> int:
        return sum(w.nbytes() for w in (*self.gate_up, *self.down))

    def dense(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, H], down [H, I]) dequantized in the compute dtype (the torch reference)."""
        return self.gate_up[e].dequantize(), self.down[e].dequantize()
