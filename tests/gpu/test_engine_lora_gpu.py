"""LoRA adapters on the fast path on a real GPU (bf16): a merged step of sessions on three adapters of different
ranks (one on some modules only) and the base model gives the same rows from the CUDA graph as eagerly, and
both agree with the blocks under `using_adapter`; single-row steps with
the norm/gating prologue inside both the base and the shrink GEMM (tuned kernels) or ahead of both equal the blocks;
warm-up captures both graph variants and a base-model step from the graphs equals the eager one. Skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.span_engine import StepRequest
from corolla.models.block_base import using_adapter
from corolla.models.lora import LoraWeights, add_adapter
from corolla.models.registry import get_family
from helpers.engine_reference import cached_block_steps
from helpers.lora_blocks import ALL_MODULES, module_shapes
from helpers.numerics import rel_err

DEV = torch.device("cuda")
BF16 = torch.bfloat16
MAX_LEN = 256
ADAPTERS = {"r16": (16, ALL_MODULES), "r8": (8, ALL_MODULES), "r4": (4, ["self_attn.v_proj", "mlp.up_proj"])}


def make_blocks(layers: int = 3) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        intermediate_size=1024,
        max_position_embeddings=4096,
    )
    shapes = module_shapes(config)
    blocks = []
    for i in range(layers):
        block = get_family(config).build_block(config, i)
        for p in block.parameters():
            torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.1 if p.ndim == 1 else 0.03)
        block = block.to(DEV, BF16).eval()
        for name, (rank, modules) in ADAPTERS.items():
            weights = {m: (torch.randn(rank, shapes[m][1]) * 0.05, torch.randn(shapes[m][0], rank) * 0.05, 2.0)
                       for m in modules}  # fmt: skip
            add_adapter(block, name, LoraWeights("test", i, weights))
        blocks.append(block)
    return blocks


def make_engine(blocks, graphs: bool) -> SpanEngine:
    config = EngineConfig(kv_pool_bytes=64 << 20, max_seq_len_tokens=MAX_LEN, max_batch_rows=8, use_cuda_graphs=graphs)
    engine = SpanEngine.from_blocks(blocks, config)
    engine.warmup()
    return engine


def run(engine: SpanEngine, names: list[str], prompts: list[torch.Tensor], tokens: list[list[torch.Tensor]]):
    """Prefills each session, then merged decode steps; returns each session's outputs [prefill, step, ...]."""
    sessions = [engine.open_session(1, MAX_LEN, adapter=n) for n in names]
    outs = [[engine.step(s, p, 0)] for s, p in zip(sessions, prompts, strict=True)]
    for k in range(len(tokens[0])):
        reqs = [StepRequest(s, tokens[i][k], prompts[i].shape[1] + k) for i, s in enumerate(sessions)]
        for i, out in enumerate(engine.decode_many(reqs)):
            outs[i].append(out)
    for s in sessions:
        s.close()
    return outs


def test_graph_equals_eager_equals_blocks_with_mixed_adapters() -> None:
    blocks = make_blocks()
    names = ["r16", "", "r4", "r8", "r16"]
    gen = torch.Generator(device=DEV).manual_seed(1)
    prompts = [torch.randn(1, n, 512, device=DEV, generator=gen).to(BF16) for n in (40, 65, 7, 130, 12)]
    tokens = [[torch.randn(1, 1, 512, device=DEV, generator=gen).to(BF16) for _ in range(3)] for _ in names]
    graph = run(make_engine(blocks, graphs=True), names, prompts, tokens)
    eager = run(make_engine(blocks, graphs=False), names, prompts, tokens)
    for i, name in enumerate(names):
        steps = [(prompts[i], 0)] + [(t, prompts[i].shape[1] + k) for k, t in enumerate(tokens[i])]
        with using_adapter(name):
            ref = cached_block_steps(blocks, MAX_LEN, steps)
        for g, e, r in zip(graph[i], eager[i], ref, strict=True):
            assert rel_err(g, e) < 1e-2, (name, rel_err(g, e))
            assert rel_err(g, r) < 3e-2, (name, rel_err(g, r))
    with using_adapter("r16"):  # the adapters matter at this scale
        adapted = cached_block_steps(blocks, MAX_LEN, [(prompts[1], 0)])[0]
    assert rel_err(adapted, graph[1][0]) > 5e-2


@pytest.mark.parametrize("prologue_fused", [True, False])
def test_single_row_steps_equal_the_blocks_with_the_prologue_in_both_gemms_or_ahead(prologue_fused: bool) -> None:
    blocks = make_blocks(layers=2)
    engine = make_engine(blocks, graphs=True)
    engine.model.lora_prologue_fused = prologue_fused
    assert engine.graphs is not None
    engine.graphs.clear()
    engine.graphs.capture_all()
    gen = torch.Generator(device=DEV).manual_seed(3)
    for name in ("r16", "r4", ""):
        prompt = torch.randn(1, 33, 512, device=DEV, generator=gen).to(BF16)
        tokens = [torch.randn(1, 1, 512, device=DEV, generator=gen).to(BF16) for _ in range(3)]
        got = run(engine, [name], [prompt], [tokens])[0]
        with using_adapter(name):
            ref = cached_block_steps(blocks, MAX_LEN, [(prompt, 0)] + [(t, 33 + k) for k, t in enumerate(tokens)])
        for g, r in zip(got, ref, strict=True):
            assert rel_err(g, r) < 3e-2, (name, prologue_fused, rel_err(g, r))


def test_base_rows_equal_eager_and_both_variants_are_captured() -> None:
    blocks = make_blocks(layers=2)
    engine = make_engine(blocks, graphs=True)
    assert engine.graphs is not None
    gen = torch.Generator(device=DEV).manual_seed(2)
    prompt = torch.randn(1, 20, 512, device=DEV, generator=gen).to(BF16)
    token = torch.randn(1, 1, 512, device=DEV, generator=gen).to(BF16)
    eager_engine = make_engine(blocks, graphs=False)
    outs = []
    for e in (engine, eager_engine):
        with e.open_session(1, MAX_LEN) as s:
            e.step(s, prompt, 0)
            outs.append(e.step(s, token, 20))
    assert rel_err(outs[0], outs[1]) < 1e-2
    keys = set(engine.graphs._graphs)
    assert (0, 2, 1, False) in keys and (0, 2, 1, True) in keys  # both variants captured at warm-up
