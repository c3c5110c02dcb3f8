"""How far the engine's Mixtral span is from transformers', and why (`benchmarks.engine.moe --numerics`).

One decode step after a prefix (the same rounded inputs everywhere), each output through the model's final norm:

- `engine_vs_transformers`: the engine in the span's dtype against transformers' MixtralModel in the same dtype;
- `engine_vs_fp32` / `transformers_vs_fp32`: each against transformers in float32 on the *same* (rounded) weights,
  the reference free of rounding in the computation. If the gap between the two is rounding, both are about
  equally far from the fp32 reference and their distance is about sqrt(2) times that (independent errors);
- `fp32_engine_vs_fp32` (when asked): the engine itself in float32 (reference ops) against the fp32 reference:
  ~1e-6 means the two compute the same function (routing rule, top-k renormalization, softmax dtype, expert sum)
  and any bf16 gap is rounding and what rounding does to the routes;
- `route_flips`: of the (layer, token) routes of the step's token, how many chose different experts in the engine
  and in the fp32 reference (near-ties of the router flip under rounding; a flip swaps an expert's whole output)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from corolla.engine.config import EngineConfig
from corolla.engine.moe.routed_experts import softmax_topk
from corolla.engine.span_engine import SpanEngine
from corolla.engine.spans.fast_llama import FastLlamaSpan, LayerWeights, LlamaSpec


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@torch.inference_mode()
def hf_decode(model, prompt: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' output (after the final norm) for `token` after `prompt`, and each layer's chosen experts
    for the token ([k] int64 per layer, from the router's own rule)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(inputs_embeds=prompt, past_key_values=cache)
    routes: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: routes.append(out[2].reshape(-1).sort().values))
        for layer in model.layers
    ]
    try:
        out = model(inputs_embeds=token, past_key_values=cache).last_hidden_state
    finally:
        for hook in hooks:
            hook.remove()
    return out, routes


@torch.inference_mode()
def engine_decode(engine: SpanEngine, norm, prompt: torch.Tensor, token: torch.Tensor) -> tuple:
    """The engine's output for `token` after `prompt` through `norm`, and each layer's chosen experts."""
    model = engine.model
    assert isinstance(model, FastLlamaSpan)
    routes: list[torch.Tensor] = []

    def recording(moe, x, *, graph_safe: bool = False):
        _, ids = moe_topk(moe, x)
        routes.append(ids.reshape(-1).sort().values)
        return FastLlamaSpan._experts(model, moe, x, graph_safe=graph_safe)

    with engine.open_session(1, prompt.shape[1] + 8) as session:
        engine.step(session, prompt, 0)
        graphs, engine.graphs = engine.graphs, None  # eager: the recorder runs in Python
        model._experts = recording  # type: ignore[method-assign]  # an instance attribute shadows the method
        try:
            out = engine.step(session, token, prompt.shape[1])
        finally:
            engine.graphs = graphs
            del model._experts
    return norm(out), routes


def moe_topk(moe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return softmax_topk(F.linear(x, moe.router), moe.top_k, normalize=moe.normalize_top_k)


@torch.inference_mode()
def three_way(
    model,
    engine: SpanEngine,
    layers_of,
    prefix_tokens: int,
    gen: torch.Generator,
    *,
    fp32_engine: bool,
) -> dict:
    """See the module docstring. `model`: transformers' MixtralModel in the engine's dtype; `engine`: its span;
    `layers_of(model) -> list[LayerWeights]` builds the engine's view of a model (for the fp32 engine)."""
    from transformers import MixtralModel

    h, dev, dt = engine.hidden_size, engine.device, engine.dtype
    prompt = torch.randn(1, prefix_tokens, h, device=dev, generator=gen).to(dt)
    token = torch.randn(1, 1, h, device=dev, generator=gen).to(dt)
    hf_lo, _ = hf_decode(model, prompt, token)
    eng_lo, eng_routes = engine_decode(engine, model.norm, prompt, token)
    model32 = MixtralModel(model.config).to(device=dev, dtype=torch.float32).eval()
    model32.load_state_dict(model.state_dict())  # the same rounded weights, held in fp32
    ref, ref_routes = hf_decode(model32, prompt.float(), token.float())
    result = {
        "dtype": str(dt).removeprefix("torch."),
        "engine_vs_transformers": rel(eng_lo, hf_lo),
        "engine_vs_fp32": rel(eng_lo, ref),
        "transformers_vs_fp32": rel(hf_lo, ref),
        "route_flips": sum(int(not torch.equal(a, b)) for a, b in zip(eng_routes, ref_routes, strict=True)),
        "routes": len(ref_routes),
    }
    if fp32_engine:
        span = engine.model
        assert isinstance(span, FastLlamaSpan)
        layers: list[LayerWeights] = layers_of(model32)
        spec: LlamaSpec = span.spec
        span32 = FastLlamaSpan(spec, layers, model32.rotary_emb.inv_freq.float(), max_positions=prefix_tokens + 64,
                               use_triton=False)  # fmt: skip
        config = EngineConfig(kv_pool_bytes=256 << 20, max_seq_len_tokens=prefix_tokens + 64, graph_buckets=())
        eng32, _ = engine_decode(SpanEngine(span32, config), model32.norm, prompt.float(), token.float())
        result["fp32_engine_vs_fp32"] = rel(eng32, ref)
    del model32
    return result
