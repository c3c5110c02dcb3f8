"""`transformers` baselines on the same card and weights, each as a competent user would run it: `generate()`
(greedy, the default `DynamicCache`, the model's sdpa attention) timed per token; the same forward called step by
step (one sync per step, to time each step and keep its output for the accuracy check); decode under
`torch.compile(mode="reduce-overhead")` with a static cache; and prefill throughput."""

from __future__ import annotations

import time

import torch

from benchmarks.common.measure import median, sync


def _forward(model, embeds: torch.Tensor, cache, position: int):
    positions = torch.arange(position, position + embeds.shape[1], device=embeds.device)[None]  # [1, T]
    return model(inputs_embeds=embeds, past_key_values=cache, position_ids=positions, use_cache=True)


@torch.inference_mode()
def eager_decode(model, prefix: torch.Tensor, steps: list[torch.Tensor]) -> tuple[list[float], list[torch.Tensor]]:
    """Per-step milliseconds and outputs (last hidden state, after the final norm) of eager decoding."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    _forward(model, prefix, cache, 0)
    times, outs = [], []
    position = prefix.shape[1]
    for x in steps:
        sync()
        start = time.perf_counter()
        out = _forward(model, x, cache, position).last_hidden_state
        sync()
        times.append((time.perf_counter() - start) * 1000)
        outs.append(out)
        position += 1
    return times, outs


@torch.inference_mode()
def generate_ms_per_token(model, *, prompt_tokens: int, new_tokens: int, repeats: int = 3) -> float:
    """Milliseconds per decoded token of `LlamaForCausalLM.generate` around `model` (its layers and final norm, a
    small LM head added): greedy, default cache and attention, no per-step sync beyond generate's own. The prompt's
    prefill cancels out: (time of 1 + `new_tokens` tokens - time of 1 token) / `new_tokens`, medians of `repeats`."""
    from transformers import LlamaForCausalLM

    config = model.config
    weight = model.norm.weight
    with torch.device("meta"):
        lm = LlamaForCausalLM(config)
    lm.model = model
    lm.lm_head = torch.nn.Linear(
        config.hidden_size, config.vocab_size, bias=False, device=weight.device, dtype=weight.dtype
    )
    lm = lm.eval().requires_grad_(False)
    gen = lm.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = 0, None, None
    ids = torch.randint(1, config.vocab_size, (1, prompt_tokens), device=weight.device)

    def timed(n: int) -> float:
        sync()
        start = time.perf_counter()
        lm.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))
        sync()
        return (time.perf_counter() - start) * 1000

    timed(4)  # warm-up (kernels, allocator)
    one = median([timed(1) for _ in range(repeats)])
    many = median([timed(1 + new_tokens) for _ in range(repeats)])
    return (many - one) / new_tokens


@torch.inference_mode()
def compiled_decode(model, prefix: torch.Tensor, steps: list[torch.Tensor], warmup_steps: int = 4) -> dict:
    """Static cache + `torch.compile(mode="reduce-overhead")`: compile seconds and per-step milliseconds."""
    from transformers import StaticCache

    max_len = prefix.shape[1] + warmup_steps + len(steps) + 8
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    _forward(model, prefix, cache, 0)  # prefill stays eager, as transformers' generate does
    compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    position = prefix.shape[1]

    def step(x: torch.Tensor):
        nonlocal position
        torch.compiler.cudagraph_mark_step_begin()
        out = _forward(compiled, x, cache, position).last_hidden_state
        position += 1
        return out

    start = time.perf_counter()
    for _ in range(warmup_steps):
        step(steps[0])
    sync()
    compile_s = time.perf_counter() - start
    times = []
    for x in steps:
        sync()
        t0 = time.perf_counter()
        step(x)
        sync()
        times.append((time.perf_counter() - t0) * 1000)
    return {"compile_s": compile_s, "step_ms": times}


@torch.inference_mode()
def prefill_ms(model, prompt: torch.Tensor, iters: int = 3) -> float:
    """Median milliseconds of one prompt through all layers (no cache kept)."""
    positions = torch.arange(prompt.shape[1], device=prompt.device)[None]
    times = []
    for i in range(iters + 1):
        sync()
        start = time.perf_counter()
        model(inputs_embeds=prompt, position_ids=positions, use_cache=False)
        sync()
        if i:  # the first call warms up
            times.append((time.perf_counter() - start) * 1000)
    return median(times)
