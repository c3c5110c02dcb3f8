"""A framed session over a server table: a client that verifies every step, over in-process fake servers
(`fake_chain`) some of which are an attacker's identities framing the others, runs one inference session with the
referees and outside servers drawn as the attack hopes (the witness rule's attacks, decisions 0190-0234). Every such
test checks the same thing first: whatever the framing did, the user's outputs are the reference's."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from corolla.client.session.inference_session import InferenceSession
from helpers.fake_chain import FakeManager, FakeServer, reference, vouch

PROMPT_TOKENS = 4  # the session's first step; one token a step after it


def framed_client(servers: dict[str, FakeServer], *vouched: str, num_blocks: int = 4, **config) -> FakeManager:
    """A client over `servers` (blocks [0, num_blocks)) that verifies every step (`verify_fraction` 1.0) and waits up
    to 10 s for an honest server; `vouched` have a witness's standing with it (`fake_chain.vouch`: a client that
    verified them before). `config`: other `ClientConfig` fields, or these overridden."""
    manager = FakeManager(servers, num_blocks, **({"max_wait_s": 10, "verify_fraction": 1.0} | config))
    vouch(manager, *vouched)
    return manager


@dataclass(frozen=True)
class Framed:
    """What one framed session left: its route as it ended (peer ids, first span first) and its verifier's counts."""

    route: list[str]
    num_verified: int
    num_rejected: int


def run_framed(
    manager: FakeManager,
    tokens: torch.Tensor,
    draw: random.Random | None = None,
    *,
    after_step: Callable[[int], None] | None = None,
) -> Framed:
    """One session over `tokens` [1, T, H] (its first `PROMPT_TOKENS` as one step, then one token a step), its
    referees and outside servers drawn by `draw` (default: the verifier's own random draw); `after_step(t)` after the
    step of position t (t >= PROMPT_TOKENS). Asserts that its outputs are the reference's (`fake_chain.reference`)."""
    outputs = []
    with InferenceSession(manager, max_length=tokens.shape[1]) as session:
        if draw is not None:
            session.verifier.rng = draw
        outputs.append(session.step(tokens[:, :PROMPT_TOKENS]))
        for t in range(PROMPT_TOKENS, tokens.shape[1]):
            outputs.append(session.step(tokens[:, t : t + 1]))
            if after_step is not None:
                after_step(t)
        framed = Framed(
            [span.peer_id for span, _ in session.route], session.verifier.num_verified, session.verifier.num_rejected
        )
    expected = reference(tokens, len(manager.block_uids))
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, atol=1e-5, rtol=0)
    return framed
