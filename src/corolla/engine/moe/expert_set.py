"""What every form of one layer's routed experts tells of itself (`routed_experts.ExpertWeights`, dense tensors;
`moe_quant.QuantizedExpertWeights`, bitsandbytes layouts): its sizes, compute dtype and device, read off its first
expert's `gate_up` [2I, H] and `down` [H, I] (each form checks that every expert agrees when it is built)."""

from __future__ import annotations

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
