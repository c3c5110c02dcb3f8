"""`transformers` baselines on the same card and weights: eager decode with a dynamic cache, decode under
`torch.compile(mode="reduce-overhead")` with a static cache, and prefill throughput."""

from __future__ import annotations

import time

import torch

from corolla.bench.measure import median, sync


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
