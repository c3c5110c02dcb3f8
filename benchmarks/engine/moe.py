"""Mixtral on the fast path, measured: `python -m benchmarks.engine.moe --out DIR`.

In one process on one card: the copy bandwidth; a span of Mixtral-8x7B-shaped layers (random bf16 weights, built
once as transformers' `MixtralModel` with sdpa attention; the engine reads the same expert tensors in place) after a
512-token prefix, at 1 session and at 8 sessions merged in one step, each against its floor (bytes the step reads:
attention, norms, routers, the distinct experts the step's tokens chose (counted on the step's own routes) and the
KV prefix, / bandwidth) and against transformers' forward of the same layers with a `DynamicCache` at the same
batch; the expert kernel's per-layer time at 1 and 8 tokens against two/eight experts' bytes; and the engine's
output against transformers' on the same inputs. `--quant none nf4 int8` measures each weight format in the same
run (NF4/Int8: every projection quantized in bitsandbytes' layouts by `engine.quant.quant_weights`'s quantizers, the experts read by
`moe_quant`'s kernels; the floor counts the chosen experts' packed bytes + scales; numerics against the engine on
the dequantized weights). `--numerics` adds the three-way comparison of `moe_numerics` (engine, transformers, fp32).
`--shape tiny --device cpu` dry-runs the code paths."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common.engine_steps import device_token_inputs, merged_decode_ms
from benchmarks.common.hf_steps import hf_step_ms
from benchmarks.common.measure import copy_bandwidth_bytes_per_s
from benchmarks.common.model import default_dtype
from benchmarks.common.quantize import quantize_int8, quantize_nf4
from benchmarks.common.report import log
from benchmarks.engine.moe_numerics import three_way
from corolla.engine.config import EngineConfig
from corolla.engine.kernels.graph_timing import graph_median_ms
from corolla.engine.moe.moe_quant import QuantizedExpertWeights
from corolla.engine.moe.routed_experts import (
    ExpertWeights,
    RoutedMoE,
    experts_forward,
    softmax_topk,
    tile_serves,
    tune_experts,
)
from corolla.engine.span_engine import SpanEngine, StepRequest
from corolla.engine.spans.fast_llama import FastLlamaSpan, LayerWeights, LlamaSpec

SHAPES = {
    "mixtral-8x7b": dict(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "small": dict(  # the CPU numerics run
        hidden_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=3584,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "tiny": dict(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=192,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
}


def hf_model(shape: str, layers: int, device: torch.device, dtype: torch.dtype):
    """transformers' MixtralModel of `layers` layers with random weights built directly in `dtype` on `device`."""
    from transformers import MixtralConfig, MixtralModel

    config = MixtralConfig(
        **SHAPES[shape],
        num_hidden_layers=layers,
        vocab_size=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        attn_implementation="sdpa",
    )
    with default_dtype(dtype), torch.device(device):
        torch.manual_seed(0)
        model = MixtralModel(config).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():  # our own init, whatever the transformers version initializes
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)
    return model


def engine_layers(model) -> list[LayerWeights]:
    """The engine's view of transformers' Mixtral layers: fused qkv (a copy), every other tensor in place (the
    experts through per-expert views of transformers' stacked [E, 2I, H] / [E, H, I] tensors)."""
    result = []
    top_k = int(model.config.num_experts_per_tok)
    for layer in model.layers:
        attn, moe = layer.self_attn, layer.mlp
        experts = ExpertWeights.from_stacked(moe.experts.gate_up_proj.data, moe.experts.down_proj.data)
        result.append(
            LayerWeights(
                ln1=layer.input_layernorm.weight.data,
                w_qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
                b_qkv=None,
                w_o=attn.o_proj.weight.data,
                b_o=None,
                ln2=layer.post_attention_layernorm.weight.data,
                w_gate_up=None,
                b_gate_up=None,
                w_down=None,
                b_down=None,
                moe=RoutedMoE(router=moe.gate.weight.data, experts=experts, top_k=top_k, normalize_top_k=True),
            )
        )
    return result


def quantized_layers(layers: list[LayerWeights], kind: str) -> list[LayerWeights]:
    """`layers` with every projection (attention and experts; not the routers) in bitsandbytes' `kind` layout."""
    quantize = quantize_nf4 if kind == "nf4" else quantize_int8
    result = []
    for layer in layers:
        assert layer.moe is not None and isinstance(layer.moe.experts, ExpertWeights)
        dense = layer.moe.experts
        experts = QuantizedExpertWeights(
            tuple(quantize(w) for w in dense.gate_up), tuple(quantize(w) for w in dense.down)
        )
        moe = RoutedMoE(layer.moe.router, experts, layer.moe.top_k, layer.moe.normalize_top_k)
        w_qkv, w_o = layer.w_qkv, layer.w_o
        assert isinstance(w_qkv, torch.Tensor) and isinstance(w_o, torch.Tensor)
        result.append(replace(layer, w_qkv=quantize(w_qkv), w_o=quantize(w_o), moe=moe))
    return result


def dequantized_layers(layers: list[LayerWeights]) -> list[LayerWeights]:
    """Dense copies of quantized `layers` (the reference the quantized span is compared with)."""
    result = []
    for layer in layers:
        assert layer.moe is not None and isinstance(layer.moe.experts, QuantizedExpertWeights)
        q = layer.moe.experts
        experts = ExpertWeights(tuple(w.dequantize() for w in q.gate_up), tuple(w.dequantize() for w in q.down))
        moe = RoutedMoE(layer.moe.router, experts, layer.moe.top_k, layer.moe.normalize_top_k)
        w_qkv, w_o = layer.w_qkv, layer.w_o
        assert not isinstance(w_qkv, torch.Tensor) and not isinstance(w_o, torch.Tensor)
        result.append(replace(layer, w_qkv=w_qkv.dequantize(), w_o=w_o.dequantize(), moe=moe))
    return result


class ExpertCounter:
    """Stands in for `FastLlamaSpan._experts` during one eager step: routes as the span does, records how many
    distinct experts each layer's tokens chose (host sync: never inside the timed or graphed steps)."""

    def __init__(self, model: FastLlamaSpan):
        self.model = model
        self.counts: list[int] = []

    def __call__(self, moe: RoutedMoE, x: torch.Tensor, *, graph_safe: bool = False) -> torch.Tensor:
        weights, ids = softmax_topk(F.linear(x, moe.router), moe.top_k, normalize=moe.normalize_top_k)
        self.counts.append(int(torch.unique(ids).numel()))
        return experts_forward(x, ids, weights, moe.experts, config=self.model.moe_configs.get(moe.shape))


def engine_step_ms(engine: SpanEngine, sessions: list, prefix: int, steps: int, gen: torch.Generator) -> dict:
    """Median merged decode step of `sessions` (GPU inputs, CUDA graphs) and the distinct experts per layer that
    the same steps' tokens chose, counted in an eager replay of the first three steps."""
    inputs = device_token_inputs(engine, len(sessions), steps, gen)
    model = engine.model
    assert isinstance(model, FastLlamaSpan)
    counter = ExpertCounter(model)
    graphs, engine.graphs = engine.graphs, None
    model._experts = counter  # type: ignore[method-assign]  # an instance attribute shadows the method
    try:
        for i in range(min(3, steps)):
            engine.decode_many([StepRequest(s, x, prefix + i) for s, x in zip(sessions, inputs[i], strict=True)])
    finally:
        engine.graphs = graphs
        del model._experts
    times = merged_decode_ms(engine, sessions, prefix, inputs)
    return {"step_ms": sorted(times)[len(times) // 2], "distinct_experts_per_layer": counter.counts}


@torch.inference_mode()
def engines_agreement(engine: SpanEngine, reference: SpanEngine, prefix: int, gen: torch.Generator) -> float:
    """Relative error of `engine`'s decode output against `reference`'s on the same prompt and token."""
    h, dev, dt = engine.hidden_size, engine.device, engine.dtype
    prompt = torch.randn(1, prefix, h, device=dev, generator=gen).to(dt)
    token = torch.randn(1, 1, h, device=dev, generator=gen).to(dt)
    outs = []
    for e in (engine, reference):
        with e.open_session(1, prefix + 8) as session:
            e.step(session, prompt, 0)
            outs.append(e.step(session, token, prefix).float())
    return float((outs[0] - outs[1]).norm() / outs[1].norm())


# x [N, H], expert_ids [N, k], expert_weights [N, k], experts: `moe_quant_kernels.grouped_quant_experts`' first four
ExpertsCall = tuple[torch.Tensor, torch.Tensor, torch.Tensor, QuantizedExpertWeights]


def triton_experts_us(moes: list[RoutedMoE], rows: tuple[int, ...]) -> dict[int, dict[str, float]]:
    """Per layer call, microseconds of every grouped Triton config (`moe_quant_kernels`, the quantized experts' path
    above `moe_nf4_tile.TILE_MAX_TOKENS`) at token counts the tile GEMV serves: its baseline in the same run (each
    layer's tokens routed by its own router, all layers in one CUDA graph)."""
    from corolla.engine.moe import moe_quant_kernels  # (needs Triton: CUDA runs only)

    first = moes[0].experts
    assert isinstance(first, QuantizedExpertWeights)
    result: dict[int, dict[str, float]] = {}
    for n in rows:
        x = torch.randn(n, first.hidden_size, device=first.device, dtype=first.dtype)  # [n, H]
        routes = [softmax_topk(F.linear(x, m.router), m.top_k, normalize=m.normalize_top_k) for m in moes]
        result[n] = {}
        calls: list[ExpertsCall] = []  # each layer's grouped_quant_experts arguments but the config
        for m, (w, ids) in zip(moes, routes, strict=True):
            assert isinstance(m.experts, QuantizedExpertWeights)  # (as the first: one engine's layers)
            calls.append((x, ids, w, m.experts))
        for config in moe_quant_kernels.configs_for(first.kind):

            def run(config: tuple[int, ...] = config, calls: list[ExpertsCall] = calls) -> list[torch.Tensor]:
                return [moe_quant_kernels.grouped_quant_experts(*call, config) for call in calls]

            result[n][str(config)] = graph_median_ms(run, 7) * 1000 / len(moes)
    return result


def build_engine(spec: LlamaSpec, layers: list[LayerWeights], inv_freq: torch.Tensor, args, lines: list[str]):
    """A span engine over `layers` with tuned kernels (expert configs logged against their floors)."""
    dev = layers[0].ln1.device
    span = FastLlamaSpan(spec, layers, inv_freq, max_positions=2048, use_triton=dev.type == "cuda")
    moes = [layer.moe for layer in layers if layer.moe is not None]
    tuned: dict = {}
    if dev.type == "cuda":
        quantized = isinstance(moes[0].experts, QuantizedExpertWeights)
        report = span.tune() if quantized else {}  # quantized attention projections: their kernels' configs
        tuned = report.get(("moe", *moes[0].shape)) or tune_experts(moes, rows=(1, args.sessions))
        span.moe_configs[moes[0].shape] = tuned["best"]
        expert_bytes = moes[0].experts.expert_nbytes()
        for n, per_config in tuned["us"].items():
            used = min(int(n) * moes[0].top_k, moes[0].experts.num_experts)
            floor_us = used * expert_bytes / args.bandwidth * 1e6
            log(lines, f"experts kernel, {n} tokens: " + ", ".join(f"{c} {us:.0f} us" for c, us in per_config.items())
                + f"; floor of {used} experts {floor_us:.0f} us")  # fmt: skip
        log(lines, f"chosen expert config {tuned['best']}")
        if any(tile_serves(moes[0].experts, n) for n in (1, args.sessions)):
            triton = triton_experts_us(moes, (1, args.sessions))
            tuned["triton_at_tile_rows"] = triton
            for n, per_config in triton.items():
                best = min(per_config, key=per_config.__getitem__)
                log(lines, f"the grouped Triton kernels at {n} tokens (the tile GEMV's range, same call): best {best} "
                           f"{per_config[best]:.0f} us; " + ", ".join(f"{c} {us:.0f}" for c, us in per_config.items()))  # fmt: skip
    engine = SpanEngine(
        span,
        EngineConfig(
            kv_pool_bytes=1 << 30,
            max_seq_len_tokens=1024,
            max_batch_rows=args.sessions,
            graph_buckets=tuple(sorted({1, args.sessions})),
            tune_gemm=False,  # tuned above (dense attention projections stay on cuBLAS)
        ),
    )
    engine.warmup()
    return engine, tuned


def measure_steps(engine: SpanEngine, layers: list[LayerWeights], args, hf_ms: dict, gen, lines, kind: str) -> dict:
    """Batch 1 and `args.sessions` decode steps against their floors and transformers' bf16 step at that batch."""
    span = engine.model
    assert isinstance(span, FastLlamaSpan)
    spec, dev, dtype = span.spec, engine.device, engine.dtype
    moe0 = layers[0].moe
    assert moe0 is not None
    expert_bytes = moe0.experts.expert_nbytes()
    dense_bytes = sum(layer.nbytes() - layer.moe.experts.nbytes() for layer in layers if layer.moe is not None)
    kv_bytes_per_row = spec.kv_layout.bytes_per_token(dtype, args.layers) * args.prefix_tokens
    rows = {}
    for batch in sorted({1, args.sessions}):
        sessions = []
        for _ in range(batch):
            s = engine.open_session(1, args.prefix_tokens + args.steps + 8)
            engine.step(s, torch.randn(1, args.prefix_tokens, spec.hidden_size, device=dev, generator=gen).to(dtype), 0)
            sessions.append(s)
        measured = engine_step_ms(engine, sessions, args.prefix_tokens, args.steps, gen)
        for s in sessions:
            s.close()
        counts = measured["distinct_experts_per_layer"]
        experts_per_step = sum(counts) / len(counts) * args.layers  # mean over the counted steps, whole span
        floor_bytes = dense_bytes + experts_per_step * expert_bytes + batch * kv_bytes_per_row
        floor_ms = floor_bytes / args.bandwidth * 1000
        row = {
            "step_ms": measured["step_ms"],
            "floor_ms": floor_ms,
            "x_floor": measured["step_ms"] / floor_ms,
            "floor_bytes": floor_bytes,
            "expert_bytes": expert_bytes,
            "distinct_experts_per_layer": counts,
        }
        if batch in hf_ms:
            row["transformers_bf16_ms"] = hf_ms[batch]
            row["speedup_vs_transformers"] = hf_ms[batch] / measured["step_ms"]
        rows[f"batch_{batch}"] = row
        hf = (
            f", transformers bf16 {hf_ms[batch]:.2f} ms ({row['speedup_vs_transformers']:.1f}x)"
            if batch in hf_ms
            else ""
        )
        log(lines, f"{kind} batch {batch}: engine {row['step_ms']:.3f} ms/step, floor {floor_ms:.3f} ms "
                   f"({row['x_floor']:.2f}x; {experts_per_step / args.layers:.2f} experts/layer){hf}")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mixtral-8x7b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prefix_tokens", type=int, default=512)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quant", nargs="+", choices=("none", "nf4", "int8"), default=["none"])
    parser.add_argument("--numerics", action="store_true", help="engine vs transformers vs fp32 (moe_numerics)")
    parser.add_argument("--fp32_engine", action="store_true", help="with --numerics: the engine in fp32 too")
    parser.add_argument("--no_timing", action="store_true", help="numerics only (the CPU run)")
    parser.add_argument("--skip_transformers", action="store_true", help="no transformers step timings")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    parser.add_argument("--device", default="cuda", help="cpu only for a dry run of the code paths")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if dev.type == "cuda" else torch.float32
    lines: list[str] = []
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    args.bandwidth = copy_bandwidth_bytes_per_s(dev) if dev.type == "cuda" else 1e10
    results: dict = {"device": name, "shape": args.shape, "layers": args.layers, "prefix_tokens": args.prefix_tokens}
    results["bandwidth_bytes_per_s"] = args.bandwidth
    log(lines, f"device {name}; copy bandwidth {args.bandwidth / 1e12:.2f} TB/s; {args.layers} {args.shape} layers")
    gen = torch.Generator(device=dev).manual_seed(1)
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    base = args.out / f"moe-{args.shape}-{name.lower().replace(' ', '-')}-{stamp}"

    def save() -> None:  # after every section: a run cut short keeps what it measured
        base.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
        base.with_suffix(".log").write_text("\n".join(lines) + "\n")

    model = hf_model(args.shape, args.layers, dev, dtype)
    dense = engine_layers(model)
    spec = LlamaSpec.from_hf_config(model.config)
    inv_freq = model.rotary_emb.inv_freq.float()
    hf_ms: dict[int, float] = {}
    if not args.no_timing and not args.skip_transformers:
        for batch in sorted({1, args.sessions}):
            hf_ms[batch] = hf_step_ms(model, batch, args.prefix_tokens, args.steps, gen)
            log(lines, f"transformers {str(dtype).removeprefix('torch.')}, batch {batch}: {hf_ms[batch]:.2f} ms/step")
    for kind in args.quant:
        section: dict = {}
        results[kind] = section
        layers = dense if kind == "none" else quantized_layers(dense, kind)
        engine, tuned = build_engine(spec, layers, inv_freq, args, lines)
        if tuned:
            section["expert_kernel"] = {"best": str(tuned["best"]), "us": tuned["us"]}
            if "triton_at_tile_rows" in tuned:
                section["expert_kernel"]["triton_at_tile_rows"] = tuned["triton_at_tile_rows"]
        if kind == "none" and args.numerics:
            section["numerics"] = three_way(
                model, engine, engine_layers, args.prefix_tokens, gen, fp32_engine=args.fp32_engine
            )
            log(lines, f"numerics ({args.layers} layers, one decode step after {args.prefix_tokens} tokens, after "
                       f"the final norm): {section['numerics']}")  # fmt: skip
        elif kind != "none":
            reference = SpanEngine(
                FastLlamaSpan(spec, dequantized_layers(layers), inv_freq, max_positions=2048, use_triton=False),
                EngineConfig(kv_pool_bytes=256 << 20, max_seq_len_tokens=1024, use_cuda_graphs=False),
            )
            rel = engines_agreement(engine, reference, args.prefix_tokens, gen)
            section["rel_err_vs_dequantized_reference"] = rel
            log(lines, f"{kind} engine vs the reference ops on the dequantized weights: relative error {rel:.5f}")
            del reference
        save()
        if not args.no_timing:
            section.update(measure_steps(engine, layers, args, hf_ms, gen, lines, kind))
            save()
        del engine, layers
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
