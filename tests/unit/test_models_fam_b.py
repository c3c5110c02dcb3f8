"""Gemma 2, Gemma 3 (text) and gpt-oss blocks, loaded from tiny random checkpoints, compute what the transformers
decoder layers compute: forward over sliding and full layers, KV-cached steps through a wrapping sliding-window
ring with rollbacks (and the refusal of a rollback past the slack), and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import helpers.tiny_models_fam_b as fam_b
from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from corolla.models.registry import get_family
from helpers.hf_equivalence import check_grads_match
from helpers.tiny_models import capture_hf_layer, hf_layers, make_tiny_model, tiny_config

SEQ = 20  # > the tiny window (6) and > the ring (window + slack 2 = 8)
STEPS = (10, 1, 1, 1, 3, 1)  # first step longer than the ring: only its last 8 keys stay
SLACK = 2


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module", params=fam_b.FAM_B_FAMILIES)
def tiny(request, tmp_path_factory):
    family = request.param
    path = make_tiny_model(family, tmp_path_factory.mktemp(family), num_layers=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return family, path, load_config(path), hf


def _layers_to_check(config) -> list[int]:
    types = list(config.layer_types)
    return [types.index("sliding_attention"), types.index("full_attention")]


def test_registry_prefix(tiny):
    family, _, config, _ = tiny
    fam = get_family(config)
    assert fam.default_dht_prefix(f"org/{family}-9b.1") == f"{family}-9b-1-hf"


def test_forward_cached_steps_rollback_and_grads(tiny):
    _, path, config, hf = tiny
    torch.manual_seed(7)
    ids = torch.randint(3, config.vocab_size, (2, SEQ))
    for layer in _layers_to_check(config):
        block = load_pretrained_block(path, layer, config=config, torch_dtype=torch.float32)
        x, ref, ref_kwargs = capture_hf_layer(hf, layer, ids)  # [2, SEQ, H]
        sliding = block.attn.sliding_window is not None
        with torch.no_grad():
            torch.testing.assert_close(block(x), ref, atol=1e-4, rtol=0)
            block.attn.slack_tokens = SLACK
            cache = [d.make_zeros() for d in block.cache_descriptors(2, 40)]
            assert cache[0].shape[2] == (fam_b.WINDOW + SLACK if sliding else 40)
            position = 0
            for n in STEPS:
                out = block(x[:, position : position + n], cache=cache, position=position)
                torch.testing.assert_close(out, ref[:, position : position + n], atol=1e-4, rtol=0)
                position += n
            # Rollback by slack + 1 tokens (the most a sliding ring guarantees) with different tokens.
            back = position - (SLACK + 1)
            ids2 = torch.cat([ids[:, :back], torch.randint(3, config.vocab_size, (2, SEQ - back))], dim=1)
            x2, ref2, _ = capture_hf_layer(hf, layer, ids2)
            out = block(x2[:, back : back + 2], cache=cache, position=back)
            torch.testing.assert_close(out, ref2[:, back : back + 2], atol=1e-4, rtol=0)
            out = block(x2[:, back + 2 : SEQ], cache=cache, position=back + 2)
            torch.testing.assert_close(out, ref2[:, back + 2 : SEQ], atol=1e-4, rtol=0)
            far_back = SEQ - (SLACK + 2)
            if sliding:
                with pytest.raises(ValueError, match=r"rollbacks of more than 3 tokens"):
                    block(x2[:, far_back : far_back + 1], cache=cache, position=far_back)
            else:  # full layers keep every position
                out = block(x2[:, far_back : far_back + 1], cache=cache, position=far_back)
                torch.testing.assert_close(out, ref2[:, far_back : far_back + 1], atol=1e-4, rtol=0)
        check_grads_match(block, hf_layers(hf)[layer], x, ref, ref_kwargs)


@pytest.mark.parametrize("family", fam_b.FAM_B_FAMILIES)
@pytest.mark.parametrize("window", [0, -3])
def test_a_sliding_window_below_one_token_is_refused(family, window):
    """A sliding layer's ring needs a window of one token at least: a config with less is refused as the block is
    built (main: a window of 0 built a ring that lets no key in, every output NaN)."""
    config = tiny_config(family, 2)
    config.sliding_window = window
    assert config.layer_types[0] == "sliding_attention"
    with pytest.raises(ValueError, match="window >= 1"):
        get_family(config).build_block(config, 0)
