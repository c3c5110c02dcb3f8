"""The Triton paths of the Falcon/BLOOM span against their torch references: paged decode attention with ALiBi
(every rounding mode, multi-query / grouped / multi-head, ragged rows, 1 or several splits, cache pages outside
every row's tokens poisoned with NaN) and the KV write without rotation. Runs on CUDA, or on CPU under Triton's
interpreter (`TRITON_INTERPRET=1` with Triton importable); skipped otherwise."""

from __future__ import annotations

import os

import pytest
import torch
from tests.helpers import paged_cache

from corolla.engine.kernels.alibi import ALIBI_BF16, ALIBI_FALCON_BF16, ALIBI_FP16, ALIBI_FP32, Alibi
from corolla.engine.ops import decode_ops as ops
from corolla.models.positions import alibi_slopes

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
tk = pytest.importorskip("corolla.engine.kernels.triton_kernels")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE = 16


@pytest.mark.parametrize("mode", [ALIBI_FP32, ALIBI_BF16, ALIBI_FP16, ALIBI_FALCON_BF16])
@pytest.mark.parametrize(("nq", "nkv", "splits"), [(8, 1, 1), (8, 1, 3), (8, 2, 2), (4, 4, 1)])
def test_alibi_paged_attention_matches_reference(mode: int, nq: int, nkv: int, splits: int) -> None:
    gen = torch.Generator().manual_seed(mode * 100 + nq * 10 + nkv + splits)
    d, seq_lens = 32, [1, 17, 300, 64, 290]  # positions past 256: bf16 rounds them (Falcon mode)
    k, v, tables = paged_cache.make_cache(seq_lens, nkv, d, 20, gen, PAGE)
    q = torch.randn(len(seq_lens), nq, d, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    slopes = alibi_slopes(nq)
    alibi = Alibi(slopes.bfloat16().float() if mode == ALIBI_FALCON_BF16 else slopes, 0.25, mode)
    scale = d**-0.5
    expected = ops.paged_decode_attention_ref(q, k, v, tables, lens, scale, alibi)
    plain = ops.paged_decode_attention_ref(q, k, v, tables, lens, scale)
    assert (expected - plain).abs().max() > 0.1  # the bias changes the result
    args = [t.to(DEV) for t in (q, k, v, tables, (lens - 1).long())]
    got = tk.paged_decode_attention(
        *args, scale, splits, alibi_slopes=alibi.slopes.to(DEV), alibi_scale=alibi.scale, alibi_mode=mode
    )
    torch.testing.assert_close(got.cpu(), expected, atol=2e-3, rtol=2e-3)


def test_store_without_rotation_writes_keys_and_values_as_projected() -> None:
    gen = torch.Generator().manual_seed(3)
    n, nq, nkv, d = 3, 4, 2, 16
    qkv = torch.randn(n, (nq + 2 * nkv) * d, generator=gen)
    positions = torch.tensor([0, 5, 9])
    slots = torch.tensor([7, 2, 12])
    caches = {}
    for name, fn in (("ref", ops.rope_and_store_ref), ("triton", tk.rope_and_store)):
        kc, vc = torch.zeros(4, 4, nkv, d, device=DEV), torch.zeros(4, 4, nkv, d, device=DEV)
        table = torch.zeros(1, d // 2, device=DEV)  # never read
        args = (qkv.to(DEV), table, table, positions.to(DEV), slots.to(DEV), kc, vc, nq, nkv, d)
        caches[name] = (fn(*args, rotate=False).cpu(), kc.cpu(), vc.cpu())
    q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
    for got_q, kc, vc in caches.values():
        assert torch.equal(got_q, q.reshape(n, nq, d))
        assert torch.equal(kc.view(-1, nkv, d)[slots], k.reshape(n, nkv, d))
        assert torch.equal(vc.view(-1, nkv, d)[slots], v.reshape(n, nkv, d))
