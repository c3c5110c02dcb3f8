"""Whether a corolla block computes what the transformers decoder layer of its family computes, loaded from the
same tiny checkpoint: the check every family's equivalence tests run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from helpers.tiny_models import capture_hf_layer, hf_layers

SEQ = 13  # = the inference steps 10, 1, 1, 1
ROLLBACK_TO, ROLLBACK_TOKENS = 8, 3


def check_block_matches_transformers(model_dir: Path, layer: int = 1, *, check_grads: bool = True) -> None:
    """Block `layer` loaded from `model_dir` computes what the transformers decoder layer computes: forward (fp32,
    atol 1e-4), KV-cached steps of 10, 1, 1, 1 tokens and a rollback to position 8 with other tokens (atol 1e-3),
    and (with `check_grads`) `check_grads_match`."""
    torch.manual_seed(123)
    config = load_config(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    block = load_pretrained_block(model_dir, layer, config=config, torch_dtype=torch.float32)
    ids = torch.randint(3, config.vocab_size, (2, SEQ))
    x, ref, ref_kwargs = capture_hf_layer(hf, layer, ids)  # [2, SEQ, H]

    with torch.no_grad():
        torch.testing.assert_close(block(x), ref, atol=1e-4, rtol=0)
        cache = [d.make_zeros() for d in block.cache_descriptors(2, 32)]
        position = 0
        for n in (10, 1, 1, 1):
            out = block(x[:, position : position + n], cache=cache, position=position)
            torch.testing.assert_close(out, ref[:, position : position + n], atol=1e-3, rtol=0)
            position += n
        # Rollback to position 8 with other tokens: the stale entries beyond must not count.
        ids2 = torch.cat([ids[:, :ROLLBACK_TO], torch.randint(3, config.vocab_size, (2, ROLLBACK_TOKENS))], dim=1)
        x2, ref2, _ = capture_hf_layer(hf, layer, ids2)
        out = block(x2[:, ROLLBACK_TO:], cache=cache, position=ROLLBACK_TO)
        torch.testing.assert_close(out, ref2[:, ROLLBACK_TO:], atol=1e-3, rtol=0)

    if check_grads:
        check_grads_match(block, hf_layers(hf)[layer], x, ref, ref_kwargs)


def check_grads_match(
    block: Any, hf_layer: torch.nn.Module, x: torch.Tensor, ref: torch.Tensor, ref_kwargs: dict
) -> None:
    """The gradients of a random weighting of `block(x)` w.r.t. its input and every checkpoint tensor equal those of
    the transformers layer's output `ref` (captured with `ref_kwargs`) w.r.t. its input and parameters."""
    block.requires_grad_(True)
    weight = torch.randn_like(ref)
    ours_in = x.clone().requires_grad_(True)
    (block(ours_in) * weight).sum().backward()
    ref_in = x.clone().requires_grad_(True)
    ref_out = hf_layer(ref_in, **ref_kwargs)
    ref_out = ref_out[0] if isinstance(ref_out, tuple) else ref_out
    (ref_out * weight).sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, atol=1e-4, rtol=1e-4)

    ref_grads = block.normalize_checkpoint_names({n: p.grad for n, p in hf_layer.named_parameters()})
    params = dict(block.named_parameters())
    layout = block.checkpoint_layout()
    buffers = {n for n, _ in hf_layer.named_buffers()}
    assert set(layout) - buffers <= set(ref_grads)
    for name, target in layout.items():
        if name in buffers:  # e.g. DeepSeek's e_score_correction_bias: a buffer there, frozen here
            continue
        grad = params[target.param].grad
        if grad is None:  # an expert no token chose: no gradient here, none (or zeros) there
            assert ref_grads[name] is None or not ref_grads[name].any(), f"grad of {name}"
            continue
        grad = grad if target.rows is None else grad[target.rows]
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-4, rtol=1e-4, msg=f"grad of {name}")
