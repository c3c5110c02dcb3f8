"""The ALiBi bias inside Triton attention kernels (`triton_kernels._paged_attn_kernel`): slope x key position,
rounded as `ops.Alibi` says. bf16 rounding is done on the bits (round to nearest even) so that the compiled kernel
and Triton's interpreter agree with torch's `.bfloat16()`. Importing fails without Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    # fp32 -> nearest bf16 (ties to even), returned as fp32; x finite
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def alibi_bias(slopes, key_pos, alibi_scale, ALIBI: tl.constexpr):
    # slopes [GP] fp32, key_pos [N] int -> bias [GP, N] fp32; ALIBI as `ops.ALIBI_*` (1 fp32, 2 product rounded to
    # bf16, 3 to fp16, 4 positions and product rounded to bf16)
    pos = key_pos.to(tl.float32)
    if ALIBI == 4:
        pos = round_bf16(pos)
    bias = slopes[:, None] * pos[None, :]
    if ALIBI == 2 or ALIBI == 4:
        bias = round_bf16(bias)
    elif ALIBI == 3:
        bias = bias.to(tl.float16).to(tl.float32)
    return bias * alibi_scale
