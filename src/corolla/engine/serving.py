"""Which spans the engine runs on fused kernels, as one question a server asks before building it:
`unsupported_reason` says why a span can't use them (None when it can); such a span still runs on the engine, its
blocks eagerly over the same paged pool (`eager_span`). The fused span types' own checks on the loaded blocks
(`span_engine.fused_model`, ValueError) still apply after this; extend the rules here when the engine learns a
new case (a quantization, a family)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# fused llama-family spans (Mixtral, Qwen3-MoE: with routed experts, engine.moe.routed_experts); DeepSeek-V3 latent spans (fast_mla)
SUPPORTED_FAMILIES = ("llama", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3", "falcon", "bloom")  # + fast_dense
UNQUANTIZED_EXPERT_FAMILIES = ("deepseek_v3",)  # fast_mla reads dense experts only (Mixtral/Qwen3-MoE: moe_quant)
ADAPTER_FAMILIES = (
    "llama",
    "qwen3",
    "mixtral",
    "qwen3_moe",
)  # FastLlamaSpan applies LoRA adapters (engine.spans.fast_lora)
SUPPORTED_QUANT_TYPES = (
    "none",
    "nf4",
    "int8",
)  # bitsandbytes layouts read in place (corolla.engine.quant.quant_weights)
GPU_DTYPES = (torch.bfloat16, torch.float16)
DEVICE_TYPES = ("cuda", "cpu")  # the CPU runs the fused spans' reference ops (any float dtype)


@dataclass(frozen=True)
class SpanTraits:
    """The facts of a span that decide whether the engine runs it on fused kernels."""

    device_type: str  # "cuda", "cpu", ...
    dtype: torch.dtype
    quant_type: str  # "none", "nf4", "int8"
    family: str  # the model family's registry name
    num_adapters: int
    tensor_parallel_devices: int  # 0 or 1: no tensor parallelism


def unsupported_reason(traits: SpanTraits) -> str | None:
    """Why the engine can't run a span with `traits` on fused kernels, or None."""
    if traits.device_type not in DEVICE_TYPES:
        return f"device {traits.device_type} (fused kernels run on {', '.join(DEVICE_TYPES)})"
    if traits.device_type == "cuda" and traits.dtype not in GPU_DTYPES:
        return f"dtype {str(traits.dtype).removeprefix('torch.')} (fused kernels need bfloat16 or float16 on CUDA)"
    if traits.quant_type not in SUPPORTED_QUANT_TYPES:
        return f"quant_type {traits.quant_type} (fused kernels read {', '.join(SUPPORTED_QUANT_TYPES)})"
    if traits.family not in SUPPORTED_FAMILIES:
        return f"family {traits.family} (fused kernels serve {', '.join(SUPPORTED_FAMILIES)})"
    if traits.family in UNQUANTIZED_EXPERT_FAMILIES and traits.quant_type != "none":
        return f"quant_type {traits.quant_type} with {traits.family} (its fused span reads unquantized experts only)"
    if traits.num_adapters and traits.family not in ADAPTER_FAMILIES:
        families = ", ".join(ADAPTER_FAMILIES)
        return f"{traits.num_adapters} LoRA adapters with {traits.family} (fused kernels apply them to {families})"
    if traits.tensor_parallel_devices > 1:
        return f"tensor parallel over {traits.tensor_parallel_devices} devices"
    return None
