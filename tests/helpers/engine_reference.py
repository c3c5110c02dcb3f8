"""The references the fast-path engine tests compare with: the blocks' own cached forward, step by step, and each
session decoded alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from corolla.engine.span_engine import StepRequest


@torch.no_grad()
def blocks_forward(blocks: Sequence[torch.nn.Module], hidden: torch.Tensor) -> torch.Tensor:
    """`hidden` [B, T, H] through `blocks` in turn, without a cache."""
    for block in blocks:
        hidden = block(hidden)
    return hidden


@torch.no_grad()
def cached_block_steps(
    blocks: Sequence[torch.nn.Module], max_length_tokens: int, steps: list[tuple[torch.Tensor, int]]
) -> list[torch.Tensor]:
    """Runs (hidden [B, T, H], position) steps through `blocks` with one fresh cache per block of
    `max_length_tokens` (each block's own `cache_descriptors`: K/V, latents or a sliding ring); returns the outputs."""
    batch = steps[0][0].shape[0]
    caches = [[d.make_zeros() for d in block.cache_descriptors(batch, max_length_tokens)] for block in blocks]
    outs = []
    for x, position in steps:
        h = x
        for block, cache in zip(blocks, caches, strict=True):
            h = block(h, cache=cache, position=position)
        outs.append(h)
    return outs


def decode_after_prompts(
    engine: Any, prompts: list[torch.Tensor], tokens: list[torch.Tensor], max_length_tokens: int
) -> list[torch.Tensor]:
    """Each prompt [B, T, H] prefilled in a session of its own on `engine`, then one `decode_many` of every session's
    token [B, 1, H] at its prompt's end; returns that step's outputs (the sessions closed)."""
    sessions = [engine.open_session(p.shape[0], max_length_tokens) for p in prompts]
    try:
        for s, prompt in zip(sessions, prompts, strict=True):
            engine.step(s, prompt, 0)
        return engine.decode_many(
            [StepRequest(s, t, p.shape[1]) for s, t, p in zip(sessions, tokens, prompts, strict=True)]
        )
    finally:
        for s in sessions:
            s.close()


def check_merged_decode_equals_solo(
    solo: Any, merged: Any, prompts: list[torch.Tensor], tokens: list[list[torch.Tensor]], max_length_tokens: int
) -> None:
    """Each session (prompt [B, T, H], then its one-token steps [B, 1, H]) run alone on engine `solo`, then all of
    them on engine `merged` with every decode step of all sessions in one `decode_many`: equal outputs (atol 1e-5)."""
    expected = []
    for prompt, toks in zip(prompts, tokens, strict=True):
        with solo.open_session(prompt.shape[0], max_length_tokens) as s:
            solo.step(s, prompt, 0)
            expected.append([solo.step(s, t, prompt.shape[1] + i) for i, t in enumerate(toks)])
    sessions = [merged.open_session(p.shape[0], max_length_tokens) for p in prompts]
    try:
        for s, prompt in zip(sessions, prompts, strict=True):
            merged.step(s, prompt, 0)
        for i in range(len(tokens[0])):
            reqs = [StepRequest(s, t[i], p.shape[1] + i) for s, t, p in zip(sessions, tokens, prompts, strict=True)]
            for k, out in enumerate(merged.decode_many(reqs)):
                torch.testing.assert_close(out, expected[k][i], atol=1e-5, rtol=0)
    finally:
        for s in sessions:
            s.close()


def check_rollback(engine: Any, blocks: Sequence[torch.nn.Module], hidden_size: int, max_length_tokens: int) -> None:
    """A prompt of 9 tokens, 3 more, then 2 written at position 6 (a speculative rollback): the last step equals
    the blocks' own cached steps of the prompt's first 6 then those 2 (as if nothing else were ever sent)."""
    h = hidden_size
    prompt, a, b = torch.randn(1, 9, h), torch.randn(1, 3, h), torch.randn(1, 2, h)
    expected = cached_block_steps(blocks, max_length_tokens, [(prompt, 0), (b, 6)])
    with engine.open_session(1, max_length_tokens) as session:
        engine.step(session, prompt, 0)
        engine.step(session, a, 9)
        out = engine.step(session, b, 6)
        assert session.length_tokens == 8
    torch.testing.assert_close(out, expected[1], atol=1e-4, rtol=0)


def check_hypo_reorder(
    engine: Any, blocks: Sequence[torch.nn.Module], hidden_size: int, max_length_tokens: int
) -> None:
    """Three rows of 7 tokens, then a step with hypo_ids [2, 0, 0] (beam search's reorder): equal to the blocks'
    cached steps of the rows reordered first."""
    h = hidden_size
    prompt, tok, hypo = torch.randn(3, 7, h), torch.randn(3, 1, h), torch.tensor([2, 0, 0])
    expected = cached_block_steps(blocks, max_length_tokens, [(prompt[hypo], 0), (tok, 7)])[1]
    with engine.open_session(3, max_length_tokens) as session:
        engine.step(session, prompt, 0)
        out = engine.step(session, tok, 7, hypo_ids=hypo)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)


def quantized_tuning_asked(span: Any) -> dict:
    """Runs `span.tune()` with its ops' quantized tuner replaced by a recorder that tunes nothing: {"weights": the
    weights it was asked to time, "prologues": the prologues asked for each}."""
    seen: dict = {}

    def tune_quantized(weights, *, reps=7, prologues=None):
        seen.update(weights=weights, prologues=prologues)
        return {}

    span.ops.tune_quantized = tune_quantized
    span.tune()
    return seen
