"""What every form of one layer's routed experts tells of itself (`routed_experts.ExpertWeights`, dense tensors;
`moe_quant.QuantizedExpertWeights`, bitsandbytes layouts): its sizes, compute dtype and device, read off its first
expert's `gate_up` [2I, H] and `down` [H, I] (each form checks that every expert agrees when it is built)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class ExpertSet:
    """The shared surface of a layer's E experts: subclasses hold `gate_up` and `down`, one entry per expert, each
    with `.shape`, `.dtype` and `.device` (a torch tensor or a quantized weight record)."""

    gate_up: tuple[Any, ...]
    down: tuple[Any, ...]

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    @property
    def hidden_size(self) -> int:
        return int(self.gate_up[0].shape[1])

    @property
    def intermediate_size(self) -> int:
        return int(self.down[0].shape[1])

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the quantized forms': the dtype they dequantize to)."""
        return self.gate_up[0].dtype

    @property
    def device(self) -> torch.device:
        return self.gate_up[0].device

    def _check_shapes(self) -> None:
        """ValueError unless there are experts, each a gate_up [2I, H] and a down [H, I] of the first one's sizes;
        then sets `boundaries` [E + 1] int64: 0..E on the experts' device, for segmenting sorted expert ids."""
        if not self.gate_up or len(self.gate_up) != len(self.down):
            raise ValueError(
                f"need one down per gate_up and at least one expert, got {len(self.gate_up)}/{len(self.down)}"
            )
        first = self.gate_up[0]
        if len(first.shape) != 2 or first.shape[0] % 2:
            raise ValueError(f"gate_up must be [2I, H], got {tuple(first.shape)}")
        two_i, h = first.shape
        for e, (gu, dn) in enumerate(zip(self.gate_up, self.down, strict=True)):
            if tuple(gu.shape) != (two_i, h) or tuple(dn.shape) != (h, two_i // 2):
                raise ValueError(
                    f"expert {e}: gate_up {tuple(gu.shape)} / down {tuple(dn.shape)} differ from ({two_i}, {h}) / "
                    f"({h}, {two_i // 2})"
                )
        object.__setattr__(self, "boundaries", torch.arange(len(self.gate_up) + 1, device=first.device))


def module_weights(
    experts: Sequence[torch.nn.Module], weight_of: Callable[[int, str, torch.nn.Module], Any]
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(gate_up, down) of corolla `GatedMLP` experts, each projection read by `weight_of(expert index, "gate_up" or
    "down", its module)`; ValueError for an expert that is not SiLU-gated."""
    gate_up, down = [], []
    for e, expert in enumerate(experts):
        act = getattr(expert, "act_name", None)
        if act not in ("silu", "swish"):
            raise ValueError(f"expert {e}: the fused experts implement SiLU-gated MLPs, not {act!r}")
        gate_up.append(weight_of(e, "gate_up", expert.get_submodule("gate_up")))
        down.append(weight_of(e, "down", expert.get_submodule("down")))
    return tuple(gate_up), tuple(down)
