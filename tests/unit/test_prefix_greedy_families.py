"""Greedy tokens with the prefix cache on and off, on every family the servers serve (issue 34's target), at the
engine: a two-turn conversation where the second turn starts on the pages the first published gives the tokens a
fresh session computing the whole conversation gives.

Why the engine and not a server per family: what a family changes about prefix caching lives in the engine (its
span type, fused or eager, chosen by `SpanEngine.from_blocks` as the server chooses it; its pool layout: K/V heads,
MLA latents, sliding windows, sinks). The keys (the client's hashes of token ids), the trust rule, the probe and the
wire are the same code for every family and run end to end in test_prefix_cache_families (every family through a
server, the client and corolla-api against local transformers; llama through a chain of two servers). The toy head here (a tied
random embedding) turns hidden states into tokens; the claim is equality of the two ways, which it tests exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import helpers.tiny_models_fam_a as fam_a  # registers qwen3, qwen3_moe, phi3, deepseek_v3
import helpers.tiny_models_fam_b as fam_b  # registers gemma2, gemma3_text, gpt_oss
from corolla.engine.config import EngineConfig
from corolla.engine.span_engine import SpanEngine
from corolla.models.registry import SUPPORTED_MODEL_TYPES, get_family
from corolla.protocol.prefix import PrefixKeys, chain_hashes, prefix_root
from helpers.tiny_models import tiny_config

VOCAB = 256
MAX_LENGTH = 128
FIRST_PROMPT, FOLLOW_UP, NEW_TOKENS = 40, 20, 12
NAMESPACE = "alice"


def make_engine(family: str) -> SpanEngine:
    assert fam_a is not None and fam_b is not None
    torch.manual_seed(0)
    config = tiny_config(family, 2)
    blocks = [get_family(config).build_block(config, i).eval() for i in range(2)]
    engine_config = EngineConfig(
        kv_pool_bytes=1 << 20, page_size_tokens=16, max_seq_len_tokens=MAX_LENGTH, max_batch_rows=4
    )
    return SpanEngine.from_blocks(blocks, engine_config)  # fused where the family's span type takes the blocks


def keys_of(tokens: list[int], first_block: int = 0) -> PrefixKeys:
    hashes = chain_hashes(prefix_root(model="tiny"), tokens)
    return PrefixKeys(first_block, tuple(hashes[first_block:]))


@torch.no_grad()
def greedy(engine: SpanEngine, embed: torch.Tensor, prompt: list[int], *, reuse: bool) -> tuple[list[int], int]:
    """NEW_TOKENS greedy tokens after `prompt` in a fresh session (reusing cached pages if `reuse`; the session's
    pages are published when it closes) -> (tokens, positions reused)."""
    with engine.open_session(1, MAX_LENGTH) as session:
        hit = engine.attach_prefix(session, NAMESPACE, keys_of(prompt)) if reuse else 0
        out = engine.step(session, embed[prompt[hit:]][None], hit)  # [1, T - hit, H]
        tokens: list[int] = []
        while True:
            h = F.layer_norm(out[0, -1], (embed.shape[1],))  # [H]
            tokens.append(int((embed @ h).argmax()))
            if len(tokens) == NEW_TOKENS:
                break
            out = engine.step(session, embed[tokens[-1:]][None], len(prompt) + len(tokens) - 1)  # [1, 1, H]
        if reuse:  # the generated tokens' blocks, as the client names them once known
            known = prompt + tokens[:-1]
            engine.add_prefix_keys(session, NAMESPACE, keys_of(known, first_block=len(prompt) // 16))
    return tokens, hit


@pytest.mark.parametrize("family", SUPPORTED_MODEL_TYPES)
def test_greedy_tokens_equal_with_the_cache_on_and_off(family: str) -> None:
    engine = make_engine(family)
    gen = torch.Generator().manual_seed(1)
    embed = torch.randn(VOCAB, engine.hidden_size, generator=gen).to(engine.dtype)  # [V, H], tied head
    first = torch.randint(3, VOCAB, (FIRST_PROMPT,), generator=gen).tolist()
    follow_up = torch.randint(3, VOCAB, (FOLLOW_UP,), generator=gen).tolist()

    answer, hit = greedy(engine, embed, first, reuse=True)
    assert hit == 0
    second = first + answer + follow_up  # the stateless next turn re-sends the whole conversation
    cached, hit = greedy(engine, embed, second, reuse=True)
    # turn 1 computed 40 + 11 positions (its last token never went in): pages ending at 16, 32 and 48
    assert hit == 48, f"{family} ({'fused' if engine.fused else 'eager'}): {hit} positions reused"
    plain, _ = greedy(engine, embed, second, reuse=False)
    assert cached == plain, f"{family} ({'fused' if engine.fused else 'eager'})"
