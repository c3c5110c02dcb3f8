"""The INT8 word kernel (engine/quant_int8_words.py, byte-permute conversion) on a real GPU: one-hot rows read every
int8 code (-128 included) back exactly through quant_gemv's word-GEMV configs; K that is not whole words is refused.
Skipped without CUDA. (The NF4 register-lookup GEMV this file also covered is deleted: docs/decisions/0017; the
streaming GEMV's decode has its own one-hot test, tests/gpu/test_quant_stream.py.)"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_word_kernel_converts_every_code(dtype) -> None:
    from corolla.engine import quant_gemv, quant_int8_words
    from corolla.engine.quant import Int8Weight

    n, k = 136, 1216
    gen = torch.Generator(device=DEV).manual_seed(9)
    codes = torch.randint(-128, 128, (n, k), device=DEV, dtype=torch.int8, generator=gen)  # every byte, -128 too
    weight = Int8Weight(codes, torch.rand(n, device=DEV, generator=gen) + 0.5, dtype)
    ref = (codes.float() * weight.col_scale[:, None]).to(dtype)  # [N, K]: one fp32 product, rounded once
    eye = torch.eye(k, device=DEV, dtype=dtype)
    configs = [c for c in quant_gemv.INT8_GEMV_CONFIGS if c[4] == 1]
    assert configs
    for start in range(0, k, 8 * 19):
        cols = [min(start + j * 19, k - 1) for j in range(quant_gemv.GEMV_MAX_ROWS)]
        x = eye[cols].contiguous()  # [8, K] one-hot rows read 8 weight columns
        for config in configs:
            out = torch.full((8, n), float("nan"), device=DEV, dtype=dtype)
            out.copy_(quant_gemv.quant_gemv(x, weight, None, config))
            assert torch.equal(out, ref[:, cols].t()), (config, start)
    odd = Int8Weight(codes[:, :1214].contiguous(), weight.row_absmax, dtype)  # K not whole words
    with pytest.raises(ValueError, match="multiples of 4"):
        quant_int8_words.int8_words_gemv(torch.randn(1, 1214, device=DEV, dtype=dtype), odd, None, 128, 64, 1, 4)
