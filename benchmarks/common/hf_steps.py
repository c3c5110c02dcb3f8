"""transformers' own decode step, the baseline the engine benches set their figures beside."""

from __future__ import annotations

import torch

from benchmarks.common.measure import host_median_ms


def hf_step_ms(model, batch: int, prefix: int, steps: int, gen: torch.Generator) -> float:
    """Median host milliseconds of one decode step of `batch` rows of a transformers base model after a `prefix`
    tokens long prompt (random `inputs_embeds` on the model's device, its DynamicCache)."""
    from transformers import DynamicCache

    h, dev, dt = model.config.hidden_size, model.device, model.dtype
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(inputs_embeds=torch.randn(batch, prefix, h, device=dev, generator=gen).to(dt), past_key_values=cache)
        tokens = iter([torch.randn(batch, 1, h, device=dev, generator=gen).to(dt) for _ in range(steps + 3)])
        return host_median_ms(
            lambda: model(inputs_embeds=next(tokens), past_key_values=cache, use_cache=True), steps, dev
        )
