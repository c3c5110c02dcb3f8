"""The Falcon/BLOOM decode step's Triton kernels (`engine.kernels.dense_kernels`) against their torch references
(`dense_ops`): the fused residual add + LayerNorm with no addend (a plain LayerNorm), one addend (BLOOM's residual)
or two summed first (Falcon's parallel attention + MLP), with and without the norm, in fp32 and bf16 (the sums
rounded as torch rounds them), at a width that is not a power of two and with strided rows; every span's decode step
KV slots and lengths (`triton_kernels.decode_slots` against `decode_ops.decode_slots_ref`) at 0 to 40 rows; the
span's decode wired through both (CPU interpreter run); and `DenseOps` choosing the
references without Triton. Runs on CUDA, or on CPU under Triton's interpreter (`TRITON_INTERPRET=1` with Triton
importable); the reference tests run everywhere."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from corolla.engine.ops.decode_ops import decode_slots_ref
from corolla.engine.ops.dense_ops import DenseOps, add_layer_norm_ref

TRITON_OK = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(rows: int, cols: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    a, b, res = (torch.randn(rows, cols, generator=gen) * s for s in (3.0, 2.0, 5.0))
    w = torch.randn(cols, generator=gen) * 0.5 + 1.0
    nb = torch.randn(cols, generator=gen) * 0.1
    return [t.to(DEV, dtype) for t in (a, b, res, w, nb)]


def test_reference_rounds_each_sum_and_norms() -> None:
    a, b, res, w, nb = _inputs(3, 40, torch.bfloat16, 0)
    h, normed = add_layer_norm_ref(a, b, res, w, nb, 1e-5)
    assert torch.equal(h, res + (a + b))
    assert normed is not None and torch.equal(normed, F.layer_norm(h, (40,), w, nb, 1e-5))
    h1, none = add_layer_norm_ref(a, None, res, None, None, 0.0)
    assert torch.equal(h1, res + a) and none is None
    assert not torch.equal(h, (res.float() + a.float() + b.float()).bfloat16())  # the rounding order shows


def test_dense_ops_uses_the_reference_on_cpu() -> None:
    ops = DenseOps(torch.device("cpu"), 64, use_triton=True)
    assert not ops.use_triton and not ops.gelu_epilogue
    a, b, res, w, nb = (t.cpu().float() for t in _inputs(2, 64, torch.float32, 1))
    h, x = ops.add_norm(a, b, res, w, nb, 1e-5)
    torch.testing.assert_close(h, res + (a + b))
    torch.testing.assert_close(x, F.layer_norm(res + (a + b), (64,), w, nb, 1e-5))
    torch.testing.assert_close(ops.add(a, None, res), res + a)
    torch.testing.assert_close(ops.layer_norm(res, w, nb, 1e-5), F.layer_norm(res, (64,), w, nb, 1e-5))
    # torch's CPU `_addmm_activation` computes the erf GELU: the probe must tell it from the tanh form BLOOM uses
    assert ops.rows_without_tanh_gelu(torch.zeros(96, 64, dtype=torch.bfloat16), [1, 3]) == [1, 3]
    assert not ops.choose_gelu_epilogue(torch.zeros(96, 64, dtype=torch.bfloat16), [1, 3]) and not ops.gelu_epilogue


@pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adds", [0, 1, 2])
@pytest.mark.parametrize("norm", [True, False])
def test_add_layer_norm_matches_reference(dtype: torch.dtype, adds: int, norm: bool) -> None:
    dk = pytest.importorskip("corolla.engine.kernels.dense_kernels")
    if adds == 0 and not norm:
        with pytest.raises(ValueError):
            dk.add_layer_norm(None, None, torch.zeros(1, 8, device=DEV), None, None, 0.0)
        return
    rows, cols = 3, 200  # not a power of two: masked lanes must not enter the statistics
    a, b, res, w, nb = _inputs(rows, cols, dtype, 10 * adds + norm)
    wide = torch.zeros(rows, cols + 56, device=DEV, dtype=dtype)
    wide[:, :cols] = res
    res = wide[:, :cols]  # strided rows (row stride 256)
    args = (a if adds else None, b if adds == 2 else None, res, w if norm else None, nb if norm else None, 1e-5)
    h, normed = dk.add_layer_norm(*args)
    h_ref, normed_ref = add_layer_norm_ref(*args)
    if adds:  # the same roundings: bit-equal sums
        assert torch.equal(h, h_ref)
    else:
        assert h is res  # no addend: the input itself, not written
    if norm:
        assert normed is not None and normed_ref is not None
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(normed, normed_ref, atol=tol, rtol=tol)
    else:
        assert normed is None


@pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
def test_add_layer_norm_refuses_bad_shapes() -> None:
    dk = pytest.importorskip("corolla.engine.kernels.dense_kernels")
    x = torch.zeros(2, 16, device=DEV)
    with pytest.raises(ValueError):
        dk.add_layer_norm(x.t().contiguous().t(), None, x, None, None, 0.0)  # a column-major addend
    with pytest.raises(ValueError):
        dk.add_layer_norm(torch.zeros(2, 8, device=DEV), None, x, None, None, 0.0)
    with pytest.raises(ValueError):
        dk.add_layer_norm(x, None, x, torch.ones(16, device=DEV), None, 1e-5)  # a norm without its bias


def test_decode_slots_reference() -> None:
    tables = torch.tensor([[5, 2, 9], [7, 1, 3]], dtype=torch.int32)
    slots, lens = decode_slots_ref(torch.tensor([17, 3]), tables, 16)
    assert slots.tolist() == [2 * 16 + 1, 7 * 16 + 3] and slots.dtype == torch.long
    assert lens.tolist() == [18, 4] and lens.dtype == torch.int32


@pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("rows", [0, 1, 5, 40])
def test_decode_slots_kernel_matches_reference(rows: int) -> None:
    dk = pytest.importorskip("corolla.engine.kernels.triton_kernels")
    gen = torch.Generator().manual_seed(rows)
    page, maxp = 16, 12
    tables = torch.randperm(rows * maxp + 1, generator=gen)[: rows * maxp].reshape(rows, maxp).int()
    wide = torch.zeros(rows, maxp + 4, dtype=torch.int32)
    wide[:, :maxp] = tables  # rows strided as in a larger static table
    positions = torch.randint(0, page * maxp, (rows,), generator=gen)
    slots, lens = dk.decode_slots(positions.to(DEV), wide[:, :maxp].to(DEV), page)
    ref_slots, ref_lens = decode_slots_ref(positions, tables, page)
    assert torch.equal(slots.cpu(), ref_slots) and torch.equal(lens.cpu(), ref_lens)
    assert slots.dtype == torch.long and lens.dtype == torch.int32
    with pytest.raises(ValueError):
        dk.decode_slots(positions.int().to(DEV), tables.to(DEV), page)  # positions must be long


SPAN_VARIANTS = {
    "falcon_7b": dict(num_attention_heads=4, new_decoder_architecture=False, multi_query=True, parallel_attn=True),
    "falcon_new_arch": dict(num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True, bias=False),
    "falcon_alibi_sequential": dict(
        num_attention_heads=4, new_decoder_architecture=False, multi_query=False, parallel_attn=False, alibi=True,
        bias=True,
    ),
    "bloom": dict(n_head=4, apply_residual_connection_post_layernorm=False),
    "bloom_residual_post_ln": dict(n_head=4, apply_residual_connection_post_layernorm=True),
}  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available() or not TRITON_OK, reason="the interpreter run of the span (CPU)")
@pytest.mark.parametrize("name", list(SPAN_VARIANTS))
def test_span_decode_with_the_fused_kernel_matches_blocks(name: str) -> None:
    """The decode step wired through the Triton add+LayerNorm (the rest of the step on the reference ops) equals
    the blocks' cached forward at three layers (first, middle and last layer's norms)."""
    import transformers as tf

    from corolla.engine import EngineConfig, SpanEngine
    from corolla.engine.spans.fast_dense import FastDenseSpan
    from corolla.models.registry import get_family
    from helpers.engine_reference import cached_block_steps

    h, fields = 32, dict(SPAN_VARIANTS[name])
    if name.startswith("bloom"):
        config = tf.BloomConfig(vocab_size=50, hidden_size=h, n_layer=3, **fields)
    else:
        fields.setdefault("alibi", False)
        config = tf.FalconConfig(
            vocab_size=50, hidden_size=h, num_hidden_layers=3, max_position_embeddings=256, **fields
        )
    torch.manual_seed(0)
    blocks = [get_family(config).build_block(config, i).eval() for i in range(3)]
    for block in blocks:
        for pname, p in block.named_parameters():
            torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 and ("norm" in pname or "ln_" in pname) else 0.0, std=0.2)
    engine = SpanEngine.from_blocks(
        blocks, EngineConfig(kv_pool_bytes=1 << 20, page_size_tokens=16, max_seq_len_tokens=64, max_batch_rows=4)
    )
    assert isinstance(engine.model, FastDenseSpan)
    engine.model.dense.use_triton = True  # the interpreter runs the kernel on CPU
    steps = [(torch.randn(2, 9, h), 0), (torch.randn(2, 1, h), 9), (torch.randn(2, 1, h), 10)]
    expected = cached_block_steps(blocks, 32, steps)
    with engine.open_session(2, 32) as session:
        got = [engine.step(session, x, position) for x, position in steps]
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
