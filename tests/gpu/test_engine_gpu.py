"""The fast path on a real GPU: each Triton kernel equals its PyTorch reference on fresh random bf16 inputs
(outputs poisoned first), the CUDA-graph step equals the eager step, batched ragged decode equals each session
alone, device inputs give the rows CPU inputs give, and the engine agrees with the span's own blocks. Skipped without CUDA."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig

from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.span_engine import StepRequest
from corolla.models.registry import get_family
from helpers.numerics import rel_err

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def make_blocks(hidden=512, heads=8, kv_heads=2, layers=3, inter=1024, seed=0, dtype=BF16, rope_parameters=None):
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=layers,
        intermediate_size=inter,
        max_position_embeddings=4096,
        rope_theta=500000.0,
    )
    if rope_parameters is not None:
        config.rope_parameters = rope_parameters
    blocks = []
    for i in range(layers):
        block = get_family(config).build_block(config, i)
        for p in block.parameters():
            torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.1 if p.ndim == 1 else 0.03)
        blocks.append(block.to(DEV, dtype).eval())
    return blocks


def make_engine(blocks, **kw) -> SpanEngine:
    settings = dict(kv_pool_bytes=256 << 20, page_size_tokens=64, max_seq_len_tokens=2048, max_batch_rows=16)
    settings.update(kw)
    return SpanEngine.from_blocks(blocks, EngineConfig(**settings))


# ------------------------------------------------------------------------------------------------ kernels


def test_triton_kernels_match_reference() -> None:
    from corolla.engine.kernels import triton_kernels as tk
    from corolla.engine.ops import decode_ops as ops

    torch.manual_seed(1)
    for n, hsz in ((1, 4096), (7, 4096), (33, 1000)):
        x, w = torch.randn(n, hsz, device=DEV, dtype=BF16), torch.randn(hsz, device=DEV, dtype=BF16)
        assert rel_err(tk.rms_norm(x, w, 1e-5), ops.rms_norm_ref(x, w, 1e-5)) < 1e-2
        gu = torch.randn(n, 2 * hsz, device=DEV, dtype=BF16)
        assert rel_err(tk.silu_mul(gu), ops.silu_mul_ref(gu)) < 1e-2

    nq, nkv, d, page, pages = 32, 8, 128, 64, 300
    kc = torch.randn(pages, page, nkv, d, device=DEV, dtype=BF16)
    vc = torch.randn_like(kc)
    b, maxp = 6, 40
    tables = (torch.randperm(pages - 1, device=DEV)[: b * maxp].reshape(b, maxp) + 1).int()
    lens = torch.tensor([1, 63, 64, 65, 700, 2560], device=DEV, dtype=torch.int32)
    q = torch.randn(b, nq, d, device=DEV, dtype=BF16)
    ref = ops.paged_decode_attention_ref(q, kc, vc, tables, lens, 1 / math.sqrt(d))
    for splits in (1, 2, 8, 16):
        out = tk.paged_decode_attention(q, kc, vc, tables, (lens - 1).long(), 1 / math.sqrt(d), splits)
        assert rel_err(out, ref) < 1e-2, splits

    cos = torch.randn(4096, d // 2, device=DEV)
    sin = torch.randn(4096, d // 2, device=DEV)
    qkv = torch.randn(b, (nq + 2 * nkv) * d, device=DEV, dtype=BF16)
    pos = torch.tensor([0, 5, 63, 64, 1000, 4095], device=DEV)
    slots = torch.randperm(pages * page, device=DEV)[:b]
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    qa = ops.rope_and_store_ref(qkv, cos, sin, pos, slots, k1, v1, nq, nkv, d)
    qb = tk.rope_and_store(qkv, cos, sin, pos, slots, k2, v2, nq, nkv, d)
    assert rel_err(qb, qa) < 1e-2
    assert rel_err(k2, k1) < 1e-2 and torch.equal(v2, v1)


# ------------------------------------------------------------------------------------------------ engine


def _prefill_then_tokens(engine, prompt, tokens):
    with engine.open_session(prompt.shape[0], prompt.shape[1] + len(tokens) + 1) as s:
        outs = [engine.step(s, prompt, 0)]
        outs += [engine.step(s, t, prompt.shape[1] + i) for i, t in enumerate(tokens)]
    return outs


YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0, "original_max_position_embeddings": 1024}


@torch.no_grad()
@pytest.mark.parametrize("rope_parameters", [None, YARN], ids=["default", "yarn"])
def test_engine_matches_blocks_in_bf16(rope_parameters) -> None:
    """The fused span's kernels (YaRN's attention factor in their rotary tables too) compute the blocks' steps."""
    blocks = make_blocks(hidden=1024, heads=8, kv_heads=2, rope_parameters=rope_parameters)  # head_dim 128
    engine = make_engine(blocks)
    assert engine.fused
    prompt = torch.randn(2, 150, 1024, dtype=BF16)
    tokens = [torch.randn(2, 1, 1024, dtype=BF16) for _ in range(4)]
    got = _prefill_then_tokens(engine, prompt, tokens)
    caches = [[d.make_zeros() for d in b.cache_descriptors(2, 160)] for b in blocks]
    position = 0
    for x, out in zip([prompt, *tokens], got, strict=True):
        h = x.to(DEV)
        for block, cache in zip(blocks, caches, strict=True):
            h = block(h, cache=cache, position=position)
        position += x.shape[1]
        assert out.device.type == "cpu" and out.shape == x.shape
        assert rel_err(out, h.cpu()) < 2e-2


@torch.no_grad()
@pytest.mark.parametrize("rows, layers", [(1, None), (3, None), (9, None), (3, (1, 3))])
def test_cuda_graph_step_equals_eager_step(rows: int, layers) -> None:
    blocks = make_blocks()
    graphed, eager = make_engine(blocks), make_engine(blocks, use_cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    torch.manual_seed(2)
    prompts = [torch.randn(1, 5 + 37 * i, 512, dtype=BF16) for i in range(rows)]  # ragged positions
    tokens = [[torch.randn(1, 1, 512, dtype=BF16) for _ in range(3)] for _ in range(rows)]
    outs = {}
    for name, engine in (("graphed", graphed), ("eager", eager)):
        sessions = [engine.open_session(1, 512, layers=layers) for _ in range(rows)]
        for s, p in zip(sessions, prompts, strict=True):
            engine.step(s, p, 0)
        outs[name] = []
        for i in range(3):
            reqs = [StepRequest(s, t[i], p.shape[1] + i) for s, t, p in zip(sessions, tokens, prompts, strict=True)]
            outs[name].append(engine.decode_many(reqs))
        for s in sessions:
            s.close()
    for g_step, e_step in zip(outs["graphed"], outs["eager"], strict=True):
        for g, e in zip(g_step, e_step, strict=True):
            assert rel_err(g, e) < 1e-2


@torch.no_grad()
def test_batched_decode_equals_each_session_alone_on_gpu() -> None:
    blocks = make_blocks()
    engine = make_engine(blocks)
    torch.manual_seed(3)
    prompts = [torch.randn(b, n, 512, dtype=BF16) for b, n in ((1, 3), (2, 70), (1, 129), (3, 20))]
    tokens = [[torch.randn(p.shape[0], 1, 512, dtype=BF16) for _ in range(3)] for p in prompts]
    alone = [_prefill_then_tokens(engine, p, t)[1:] for p, t in zip(prompts, tokens, strict=True)]
    sessions = [engine.open_session(p.shape[0], 256) for p in prompts]
    for s, p in zip(sessions, prompts, strict=True):
        engine.step(s, p, 0)
    for i in range(3):
        reqs = [StepRequest(s, t[i], p.shape[1] + i) for s, t, p in zip(sessions, tokens, prompts, strict=True)]
        for k, out in enumerate(engine.decode_many(reqs)):
            assert rel_err(out, alone[k][i]) < 1e-2
    for s in sessions:
        s.close()


@torch.no_grad()
def test_device_inputs_stay_on_device_and_padding_rows_touch_no_session() -> None:
    blocks = make_blocks(layers=1)
    engine = make_engine(blocks)
    a = engine.open_session(1, 128)
    engine.step(a, torch.randn(1, 10, 512, dtype=BF16, device=DEV), 0)
    k_before = engine.pool.k[:, a.slots[0].pages].clone()
    others = [engine.open_session(1, 128) for _ in range(3)]  # 3 rows -> bucket 4: one padding row
    for position in range(2):
        reqs = [StepRequest(s, torch.randn(1, 1, 512, dtype=BF16, device=DEV), position) for s in others]
        outs = engine.decode_many(reqs)
        assert all(o.device.type == "cuda" and o.shape == (1, 1, 512) for o in outs)
    assert torch.equal(engine.pool.k[:, a.slots[0].pages], k_before)  # session a was never written
    for s in (a, *others):
        s.close()


@torch.no_grad()
def test_device_inputs_equal_cpu_inputs_alone_merged_and_converted() -> None:
    """A graph step's hidden states on the device go straight into the graph's input (one request: one copy; several
    of the engine's dtype: one cat; a float32 or CPU one among them: converted first), its positions and tables in
    one copy: the same rows as the same steps given on the CPU (the launched path), bit for bit."""
    engine = make_engine(make_blocks(layers=2))
    torch.manual_seed(5)
    prompts = [torch.randn(b, 9 + 4 * i, 512, dtype=BF16) for i, b in enumerate((1, 2, 1))]
    runs = {kind: [engine.open_session(p.shape[0], 64) for p in prompts] for kind in ("cpu", "device")}
    for sessions in runs.values():
        for s, p in zip(sessions, prompts, strict=True):
            engine.step(s, p, 0)
    plans = [  # per step: (session index, how its device input is given)
        [(1, "bf16")],  # one request of two rows: one copy
        [(0, "bf16"), (1, "bf16"), (2, "bf16")],  # one cat
        [(0, "fp32"), (1, "bf16"), (2, "cpu")],  # converted
        [(2, "bf16"), (0, "bf16")],  # 2 rows of the bucket of 2, another order
    ]
    for plan in plans:
        xs = [torch.randn(prompts[i].shape[0], 1, 512, dtype=BF16) for i, _ in plan]
        want = engine.decode_many([
            StepRequest(runs["cpu"][i], x, runs["cpu"][i].length_tokens) for (i, _), x in zip(plan, xs, strict=True)
        ])  # fmt: skip
        given = {"bf16": lambda x: x.to(DEV), "fp32": lambda x: x.float().to(DEV), "cpu": lambda x: x}
        got = engine.decode_many([
            StepRequest(runs["device"][i], given[how](x), runs["device"][i].length_tokens)
            for (i, how), x in zip(plan, xs, strict=True)
        ])  # fmt: skip
        for (_, how), w, g in zip(plan, want, got, strict=True):
            assert g.device.type == ("cpu" if how == "cpu" else "cuda") and g.dtype == BF16
            assert g.shape == w.shape and torch.equal(g.cpu(), w)
    for sessions in runs.values():
        for s in sessions:
            s.close()


def test_fused_skinny_gemm_matches_reference() -> None:
    from corolla.engine.kernels import triton_kernels as tk
    from corolla.engine.ops import decode_ops as ops

    torch.manual_seed(4)
    n, k = 384, 1024
    w = torch.randn(n, k, device=DEV, dtype=BF16) / 32
    nw = torch.randn(k, device=DEV, dtype=BF16)
    for m in (1, 5):
        x = torch.randn(m, k, device=DEV, dtype=BF16)
        gu = torch.randn(m, 2 * k, device=DEV, dtype=BF16)
        res = torch.randn(m, n, device=DEV, dtype=BF16)
        for config in tk.SKINNY_GEMM_CONFIGS:
            out = tk.skinny_gemm(x, w, res, config)
            assert rel_err(out, res + x @ w.t()) < 1e-2, config
            out = tk.skinny_gemm(x, w, None, config, prologue=tk.PROLOGUE_RMSNORM, norm_weight=nw, eps=1e-5)
            assert rel_err(out, ops.rms_norm_ref(x, nw, 1e-5) @ w.t()) < 1e-2, config
            out = tk.skinny_gemm(gu, w, res, config, prologue=tk.PROLOGUE_SILU)
            assert rel_err(out, res + ops.silu_mul_ref(gu) @ w.t()) < 1e-2, config
        if m > 1:
            continue
        for config in tk.SPLITK_CONFIGS:  # single-row split-K variants
            out = tk.splitk_gemv(x, w, res, config)
            assert rel_err(out, res + x @ w.t()) < 1e-2, config
            out = tk.splitk_gemv(x, w, None, config, prologue=tk.PROLOGUE_RMSNORM, norm_weight=nw, eps=1e-5)
            assert rel_err(out, ops.rms_norm_ref(x, nw, 1e-5) @ w.t()) < 1e-2, config
            out = tk.splitk_gemv(gu, w, res, config, prologue=tk.PROLOGUE_SILU)
            assert rel_err(out, res + ops.silu_mul_ref(gu) @ w.t()) < 1e-2, config


@torch.no_grad()
def test_tuned_engine_equals_reference_engine() -> None:
    blocks = make_blocks(hidden=1024, heads=8, kv_heads=2, inter=2816)
    tuned = make_engine(blocks)
    report = tuned.warmup()  # picks fused Triton or cuBLAS per projection, then captures graphs
    assert report and all(r["best_us"] <= r["unfused_us"] for r in report.values())
    plain = make_engine(blocks, use_triton=False, use_cuda_graphs=False)
    torch.manual_seed(5)
    prompt = torch.randn(1, 77, 1024, dtype=BF16)
    tokens = [torch.randn(1, 1, 1024, dtype=BF16) for _ in range(5)]
    for a, b in zip(
        _prefill_then_tokens(tuned, prompt, tokens), _prefill_then_tokens(plain, prompt, tokens), strict=True
    ):
        assert rel_err(a, b) < 2e-2
