"""GPUs and models for the simulator, and the roofline that turns them into times: per-block decode step time as a
function of batch rows and context, prefill time per token, memory for blocks and KV, NIC tokens/s, and the
Helix-style node capacity (tokens/s at a given span length) that the bound uses.

Sources: memory, bandwidth and dense fp16 tensor FLOPs from NVIDIA's datasheets (A100 40/80GB SXM, H100 SXM, L4,
A10, T4) and architecture whitepapers (GA102 for RTX 3090/3080, GA106 for RTX 3060, AD102 for RTX 4090; consumer
figures with fp32 accumulate, what PyTorch uses); NIC speeds are assumptions named per class (datacenter 10 Gbit/s
as in Helix's GCP profile, home links 100-1000 Mbit/s). Model shapes from the models' config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1 << 30
GB = 10**9

# Decode reads every weight once per step: time = bytes / (peak bandwidth x efficiency). Single-GPU decode kernels
# typically reach 50-80% of peak HBM/GDDR bandwidth (e.g. the roofline analyses in Yuan et al. 2024, "LLM Inference
# Unveiled: Survey and Roofline Model Insights"); 0.6 is our assumption for fp16 and 0.4 for NF4, whose dequantizing
# kernels run further from the roofline. Prefill is compute-bound: 0.5 of dense peak FLOPs (assumption).
BANDWIDTH_EFFICIENCY = {"fp16": 0.6, "nf4": 0.4}
BYTES_PER_PARAM = {"fp16": 2.0, "nf4": 0.5625}  # NF4: 4 bits + one fp32 absmax per 64 weights (bitsandbytes)
FLOPS_EFFICIENCY = 0.5
STEP_OVERHEAD_S = 1.2e-3  # server CPU per merged step through the real server (issue 31, H200: ~1.16 ms)
USABLE_MEMORY_FRACTION = 0.92  # CUDA context, allocator slack (assumption)
MAX_BATCH_ROWS = 256  # the most decode rows one merged step takes (assumption; corolla measured 64 on one H200)


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    fp16_flops: float  # dense tensor-core peak
    nic_bits_per_s: float


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("H100-80GB", 80 * GB, 3.35e12, 989e12, 10e9),
        GpuSpec("A100-80GB", 80 * GB, 2.039e12, 312e12, 10e9),
        GpuSpec("A100-40GB", 40 * GB, 1.555e12, 312e12, 10e9),
        GpuSpec("A10", 24 * GB, 600e9, 125e12, 10e9),
        GpuSpec("L4", 24 * GB, 300e9, 121e12, 10e9),
        GpuSpec("T4", 16 * GB, 320e9, 65e12, 10e9),
        GpuSpec("RTX-4090", 24 * GB, 1008e9, 165.2e12, 1e9),
        GpuSpec("RTX-3090", 24 * GB, 936e9, 71e12, 1e9),
        GpuSpec("RTX-3080", 10 * GB, 760e9, 59.5e12, 500e6),
        GpuSpec("RTX-3060", 12 * GB, 360e9, 25.6e12, 100e6),
    )
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_blocks: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    params_per_block: int

    def block_bytes(self, dtype: str) -> float:
        return self.params_per_block * BYTES_PER_PARAM[dtype]

    @property
    def kv_bytes_per_token_block(self) -> int:
        """K and V of one token in one block, fp16."""
        return 2 * self.num_kv_heads * self.head_dim * 2

    @property
    def hidden_bytes_per_token(self) -> int:
        return self.hidden_size * 2


# LLaMA-2-70B: q/o 8192x8192, k/v 8192x1024, MLP 3 x 8192x28672 per block (config.json of meta-llama/Llama-2-70b-hf)
LLAMA2_70B = ModelSpec("Llama-2-70B", 80, 8192, 8, 128, 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672)


@dataclass(frozen=True)
class ServerPerf:
    """One card serving one model at one dtype: the times and sizes every simulated server uses."""

    gpu: GpuSpec
    model: ModelSpec
    dtype: str = "fp16"

    @property
    def block_bytes(self) -> float:
        return self.model.block_bytes(self.dtype)

    @property
    def usable_bytes(self) -> float:
        return self.gpu.memory_bytes * USABLE_MEMORY_FRACTION

    def decode_block_s(self, rows: float, context_tokens: float) -> float:
        """One decode step of one block for `rows` sessions holding `context_tokens` tokens of KV in all."""
        memory_s = (self.block_bytes + context_tokens * self.model.kv_bytes_per_token_block) / (
            self.gpu.bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY[self.dtype]
        )
        compute_s = 2 * self.model.params_per_block * rows / (self.gpu.fp16_flops * FLOPS_EFFICIENCY)
        return max(memory_s, compute_s)

    def decode_step_s(self, num_blocks: int, rows: float, context_tokens: float) -> float:
        return num_blocks * self.decode_block_s(rows, context_tokens) + STEP_OVERHEAD_S

    def prefill_s(self, num_blocks: int, tokens: int) -> float:
        per_block = max(
            2 * self.model.params_per_block * tokens / (self.gpu.fp16_flops * FLOPS_EFFICIENCY),
            self.block_bytes / (self.gpu.bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY[self.dtype]),
        )
        return num_blocks * per_block + STEP_OVERHEAD_S

    @property
    def network_tps(self) -> float:
        """Tokens/s of hidden states the NIC carries (Petals' network_rps: bits/s over hidden_size x 16 bits)."""
        return self.gpu.nic_bits_per_s / (self.model.hidden_size * 16)

    def petals_max_blocks(self, attn_cache_tokens: int = 16384) -> int:
        """Petals' `_choose_num_blocks`: memory over (block + its KV budget), after autograd's 2 GiB x hidden/14336."""
        autograd = 2 * GIB * self.model.hidden_size / 14336
        per_block = self.block_bytes + attn_cache_tokens * self.model.kv_bytes_per_token_block
        return max(0, min(self.model.num_blocks, math.floor((self.gpu.memory_bytes - autograd) / per_block)))

    def kv_tokens(self, num_blocks: int) -> int:
        """Tokens of context (all sessions together) the memory left beside `num_blocks` blocks holds."""
        free = self.usable_bytes - num_blocks * self.block_bytes
        return max(0, int(free // (num_blocks * self.model.kv_bytes_per_token_block)))

    def rows_fitting(self, num_blocks: int, context_tokens: int) -> int:
        return min(MAX_BATCH_ROWS, self.kv_tokens(num_blocks) // max(context_tokens, 1))

    def capacity_tps(self, num_blocks: int, context_tokens: int) -> float:
        """Helix's node capacity: decode tokens/s through all `num_blocks` at the batch its KV memory allows for
        sessions of `context_tokens`, capped by the NIC; 0 when not even one session fits."""
        rows = self.rows_fitting(num_blocks, context_tokens)
        if rows < 1:
            return 0.0
        step_s = self.decode_step_s(num_blocks, rows, rows * context_tokens)
        return min(rows / step_s, self.network_tps)

    def max_blocks(self, context_tokens: int) -> int:
        """The most blocks that still leave room for one session of `context_tokens`."""
        k = min(self.model.num_blocks, int(self.usable_bytes // self.block_bytes))
        while k > 0 and self.kv_tokens(k) < context_tokens:
            k -= 1
        return k

    def inference_rps(self) -> float:
        """Petals' inference_rps: single-token steps/s through one block."""
        return 1.0 / self.decode_block_s(1, 1)

    def forward_rps(self, tokens: int = 1024) -> float:
        """Petals' forward_rps: tokens/s of a `tokens`-long forward through one block."""
        return tokens / (self.prefill_s(1, tokens) - STEP_OVERHEAD_S)
