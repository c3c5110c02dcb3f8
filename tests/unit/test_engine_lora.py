"""LoRA adapters on the fast-path engine (CPU, fp32): sessions on three adapters of different ranks (one on some
modules and layers only) and a base-model session, merged in one decode step, equal the plain blocks under
`using_adapter` (prefill, cached steps, rollback); the blocks' adapter tensors are views of the engine's stacks,
which hold exactly the blocks' adapter bytes, what the server's sizing counts; a session's adapter is fixed;
unknown adapters and adapters on modules the engine does not cover are refused; adapters on an NF4 span
(bitsandbytes layers quantized on the CPU) equal the quantized blocks; the serving rule names the families without
adapter support."""

from __future__ import annotations

import pytest
import torch

from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.serving import SpanTraits, unsupported_reason
from corolla.engine.span_engine import StepRequest, fused_model
from corolla.engine.spans.fast_lora import FusedProjection
from corolla.models.block_base import using_adapter
from corolla.models.lora import LoraWeights, add_adapter
from corolla.models.registry import get_family
from helpers.engine_reference import cached_block_steps
from helpers.lora_blocks import make_lora_blocks as make_blocks
from helpers.tiny_models import tiny_config

MAX_LEN = 64


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def make_engine(blocks) -> SpanEngine:
    config = EngineConfig(kv_pool_bytes=2 << 20, page_size_tokens=16, max_seq_len_tokens=MAX_LEN, max_batch_rows=8)
    return SpanEngine.from_blocks(blocks, config)


def reference(blocks, adapter: str, steps: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    with using_adapter(adapter):
        return cached_block_steps(blocks, MAX_LEN, steps)


def test_merged_steps_of_sessions_on_different_adapters_equal_the_blocks() -> None:
    blocks = make_blocks()
    engine = make_engine(blocks)
    assert engine.adapters is not None and engine.adapters.names == ("big", "mid", "some")
    h = int(blocks[0].config.hidden_size)
    names = ["big", "", "some", "mid"]
    batch = [1, 2, 1, 1]
    prefix = [7, 12, 5, 9]
    torch.manual_seed(1)
    plan: list[list[tuple[torch.Tensor, int]]] = []
    for b, p in zip(batch, prefix, strict=True):
        steps = [(torch.randn(b, p, h), 0)] + [(torch.randn(b, 1, h), p + i) for i in range(3)]
        steps.append((torch.randn(b, 3, h), p - 2))  # rollback: rewrite from two tokens back, on a cached prefix
        steps.append((torch.randn(b, 1, h), p + 1))  # a decode step after the rollback
        plan.append(steps)
    expected = [reference(blocks, n, steps) for n, steps in zip(names, plan, strict=True)]
    sessions = [engine.open_session(b, MAX_LEN, adapter=n) for b, n in zip(batch, names, strict=True)]
    got: list[list[torch.Tensor]] = [[] for _ in names]
    for k in range(len(plan[0])):
        requests = [StepRequest(s, plan[i][k][0], plan[i][k][1]) for i, s in enumerate(sessions)]
        if all(r.is_decode for r in requests):  # one merged step: rows on big, base, base, some, mid
            outs = engine.decode_many(requests)
        else:
            outs = [engine.step(r.session, r.hidden, r.position) for r in requests]
        for i, out in enumerate(outs):
            got[i].append(out)
    for i, name in enumerate(names):
        for out, ref in zip(got[i], expected[i], strict=True):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    for s in sessions:
        s.close()


@pytest.mark.parametrize("prologue_fused", [True, False])
def test_single_row_steps_equal_the_blocks_with_the_prologue_in_both_gemms_or_ahead(prologue_fused: bool) -> None:
    blocks = make_blocks()
    engine = make_engine(blocks)
    engine.model.lora_prologue_fused = prologue_fused  # True: norm / gating inside the base and the shrink GEMM
    h = int(blocks[0].config.hidden_size)
    torch.manual_seed(4)
    for name in ("big", "some", ""):
        steps = [(torch.randn(1, 6, h), 0)] + [(torch.randn(1, 1, h), 6 + i) for i in range(3)]
        expected = reference(blocks, name, steps)
        with engine.open_session(1, MAX_LEN, adapter=name) as session:
            for (x, position), ref in zip(steps, expected, strict=True):
                got = engine.decode_many([StepRequest(session, x, position)])[0] if position else None
                got = engine.step(session, x, position) if got is None else got
                torch.testing.assert_close(got, ref, atol=1e-4, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_adapters_change_the_output_and_share_the_blocks_memory() -> None:
    blocks = make_blocks()
    before = sum(p.numel() * p.element_size() for b in blocks for n, p in b.named_parameters() if ".lora_" in n)
    engine = make_engine(blocks)
    assert engine.adapters is not None
    qkv = blocks[0].attn.qkv
    stack = engine.adapters.layers[0]["qkv"]
    assert isinstance(stack, FusedProjection)
    assert stack.ranks == (0, 24, 12, 4)  # big: q, k, v at rank 8; mid: at 4; some: q and v at 2; no padding
    for name, k in (("big", 1), ("mid", 2), ("some", 3)):
        key = qkv.slots[name]
        assert qkv.lora_a[key].data_ptr() == stack.a[stack.offsets[k]].data_ptr()  # the plain path reads the stack
        assert qkv.lora_b[key].data_ptr() == stack.bt[stack.offsets[k]].data_ptr()
    assert engine.adapters.layers[1]["down"].ranks == (0, 8, 4, 0)  # "some" changes layers 0 and 2 only
    assert engine.adapters.nbytes() == before  # the stacks are the blocks' adapter tensors, nothing added
    h = int(blocks[0].config.hidden_size)
    x = torch.randn(1, 4, h)
    outs = []
    for name in ("", "big", "some"):
        with engine.open_session(1, MAX_LEN, adapter=name) as session:
            outs.append(engine.step(session, x, 0))
    assert not torch.allclose(outs[0], outs[1], atol=1e-3) and not torch.allclose(outs[0], outs[2], atol=1e-3)


def test_a_session_keeps_its_adapter_and_unknown_ones_are_refused() -> None:
    blocks = make_blocks()
    engine = make_engine(blocks)
    with pytest.raises(ValueError, match="Unknown adapter 'missing'"):
        engine.open_session(1, MAX_LEN, adapter="missing")
    with engine.open_session(1, MAX_LEN) as session:  # fixed by its first step
        engine.bind_adapter(session, "mid")
        engine.bind_adapter(session, "mid")
        assert session.adapter_index == 2
        with pytest.raises(ValueError, match="fixed when it opened"):
            engine.bind_adapter(session, "big")
        with pytest.raises(ValueError, match="fixed when it opened"):
            engine.bind_adapter(session, "")
    plain = make_engine(make_blocks(adapters={}))
    assert plain.adapters is None
    with pytest.raises(ValueError, match="no adapters"):
        plain.open_session(1, MAX_LEN, adapter="big")


def test_adapters_on_modules_the_fused_span_does_not_cover_run_eagerly() -> None:
    config = tiny_config("mixtral", 1)
    block = get_family(config).build_block(config, 0).eval()
    router = ("block_sparse_moe.gate", (torch.randn(2, 64), torch.randn(4, 2), 1.0))
    attention = ("self_attn.k_proj", (torch.randn(2, 64), torch.randn(32, 2), 1.0))
    add_adapter(block, "attn", LoraWeights("test", 0, dict([attention])))
    config = EngineConfig(kv_pool_bytes=1 << 20, max_seq_len_tokens=32)
    assert SpanEngine.from_blocks([block], config).fused  # attention: served by the fused span
    add_adapter(block, "router", LoraWeights("test", 0, dict([router])))
    with pytest.raises(ValueError, match="does not apply adapters"):
        fused_model([block], config, max_positions=32)
    assert not SpanEngine.from_blocks([block], config).fused  # the blocks apply it themselves


def test_serving_rule_keeps_adapters_off_spans_without_support() -> None:
    def traits(family: str, quant_type: str = "none") -> SpanTraits:
        return SpanTraits("cuda", torch.bfloat16, quant_type, family, num_adapters=2, tensor_parallel_devices=0)

    assert unsupported_reason(traits("llama")) is None
    assert unsupported_reason(traits("llama", "nf4")) is None  # the delta is added beside the quantized linear
    assert unsupported_reason(traits("qwen3_moe")) is None
    reason = unsupported_reason(traits("deepseek_v3"))
    assert reason is not None and "2 LoRA adapters with deepseek_v3" in reason


def test_adapters_on_an_nf4_span_equal_the_quantized_blocks() -> None:
    pytest.importorskip("bitsandbytes")
    from corolla.models.quantization import QuantType, quantized_linear

    blocks = make_blocks(adapters={})
    for block in blocks:  # as the server places a block: quantized first (CPU here), adapters after
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    setattr(parent, name, quantized_linear(child, QuantType.NF4).to("cpu"))
    torch.manual_seed(3)
    rank_modules = {"mid": (4, ["self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"])}
    config = blocks[0].config
    h, inter = int(config.hidden_size), int(config.intermediate_size)
    shapes = {"self_attn.q_proj": (h, h), "self_attn.o_proj": (h, h), "mlp.up_proj": (inter, h)}
    shapes["mlp.down_proj"] = (h, inter)
    for index, block in enumerate(blocks):
        rank, modules = rank_modules["mid"]
        weights = {
            m: (torch.randn(rank, shapes[m][1]) * 0.3, torch.randn(shapes[m][0], rank) * 0.3, 0.5) for m in modules
        }
        add_adapter(block, "mid", LoraWeights("test", index, weights))
    engine = make_engine(blocks)
    steps = [(torch.randn(1, 6, h), 0), (torch.randn(1, 1, h), 6), (torch.randn(1, 1, h), 7)]
    for name in ("mid", ""):
        expected = reference(blocks, name, steps)
        with engine.open_session(1, MAX_LEN, adapter=name) as session:
            for (x, position), ref in zip(steps, expected, strict=True):
                torch.testing.assert_close(engine.step(session, x, position), ref, atol=2e-3, rtol=0)


def test_server_sizing_counts_the_bytes_the_engine_stores(tmp_path) -> None:
    import json

    from safetensors.torch import save_file

    from corolla.models.lora import load_adapter
    from corolla.server import sizing
    from helpers.lora_blocks import module_shapes

    num_layers = 2
    config = tiny_config("llama", num_layers)
    shapes = module_shapes(config)
    plan = {"r8": (8, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"]), "r2": (2, None)}
    plan["r2"] = (2, ["self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"])
    torch.manual_seed(5)
    for name, (rank, modules) in plan.items():
        tensors = {}
        for layer in range(num_layers):
            for m in modules:
                prefix = f"base_model.model.model.layers.{layer}.{m}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, shapes[m][1])
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(shapes[m][0], rank)
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "adapter_model.safetensors"))
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank}))

    def loaded() -> list[torch.nn.Module]:
        blocks = make_blocks(num_layers=num_layers, adapters={})
        for index, block in enumerate(blocks):
            for name in plan:
                add_adapter(block, name, load_adapter(tmp_path / name, index))
        return blocks

    paths = [str(tmp_path / name) for name in plan]
    estimate = num_layers * sizing.adapter_bytes_per_block(paths, dtype=torch.float32, model_config=config)
    engine = make_engine(loaded())
    assert engine.adapters is not None
    assert engine.adapters.layers[0]["qkv"].ranks == (0, 4, 24)  # names sorted: r2 (q, v), r8 (q, k, v)
    stored = sum(t.nbytes for layer in engine.adapters.layers for p in layer.values() for t in (p.a, p.bt))
    assert estimate == stored == engine.adapters.nbytes()
