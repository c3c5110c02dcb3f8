"""The speculative decoding loop of one sequence: draft k tokens, verify them in ONE inference step of k + 1 tokens
through the swarm, accept by the rule of `corolla.client.speculative.acceptance`, roll the servers' caches back to the accepted
text (the session's `position`), repeat. `VerifyTarget` hides where the target runs (`SessionTarget`: the swarm)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers.generation.logits_process import LogitsProcessorList

from corolla.client.session.inference_session import InferenceSession
from corolla.client.speculative.acceptance import Draft, Drafter, KChooser, accept_greedy, accept_sampled
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class VerifyTarget(Protocol):
    """The target model with a rollback-able cache. `position`: tokens in its cache (settable to roll back)."""

    position: int

    def forward(self, ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        """Runs `ids` `[T]` from `position` on; returns the last `num_logits` positions' logits `[num_logits, V]`
        (fp32)."""
        ...


class LocalEnds(Protocol):
    """The parts of a distributed model that run on the client: token embeddings and the LM head."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids `[B, T]` -> hidden states `[B, T, H]`."""
        ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states `[B, T, H]` -> logits `[B, T, V]`."""
        ...


class SessionTarget:
    """The swarm: one `InferenceSession` step per call, embeddings and head run locally."""

    def __init__(self, model: LocalEnds, session: InferenceSession, prompts: Any = None):
        self.model, self.session, self.prompts = model, session, prompts

    @property
    def position(self) -> int:
        return self.session.position

    @position.setter
    def position(self, value: int) -> None:
        self.session.position = value  # the next step overwrites the servers' caches from here

    def forward(self, ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        prompts = self.prompts if self.session.position == 0 else None
        hidden = self.session.step(self.model.embed(ids[None]), prompts)  # [1, T, H]
        return self.model.head(hidden[:, -num_logits:]).to(torch.float32)[0]  # [num_logits, V]


@dataclass
class SpeculativeStats:
    """What one speculative generation measured."""

    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    chosen_k: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def tokens_per_round(self) -> float:
        return self.generated_tokens / self.rounds if self.rounds else 0.0


@dataclass
class SpeculativeLoop:
    """Generates up to `max_new_tokens` after `ids` for one sequence. `processors` are the plain loop's (p at each
    position is `processors(prefix, logits)`). After each emitted token, `stop(ids, logits)` (the text so far and the
    raw logits `[V]` the token was chosen from) says whether generation ends there (EOS, stop strings, a cancelled
    request)."""

    target: VerifyTarget
    drafter: Drafter
    chooser: KChooser
    processors: LogitsProcessorList
    do_sample: bool
    generator: torch.Generator | None = None  # draws of the acceptance rule (None: torch's global generator)
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)

    def _probs(self, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The processed sampling distribution `[V]` after `prefix` `[L]` for raw `logits` `[V]`."""
        return torch.softmax(self.processors(prefix[None], logits[None].clone())[0], dim=-1)

    def run(
        self, ids: list[int], max_new_tokens: int, stop: Callable[[list[int], torch.Tensor], bool], streamer: Any = None
    ) -> list[int]:
        """Returns `ids` + the new tokens. On return `target.position == len(result) - 1` (the last token was never
        sent, as in the plain loop)."""
        ids = list(ids)
        generated = 0
        sampler = self._probs if self.do_sample else None
        while generated < max_new_tokens:
            k = self.chooser.choose(max_new_tokens - generated - 1)
            started = time.perf_counter()
            draft = self.drafter.propose(torch.tensor(ids, dtype=torch.int64), k, sampler) if k > 0 else None
            drafted = len(draft) if draft is not None else 0
            draft_s = time.perf_counter() - started
            self.chooser.record_draft(drafted, draft_s)

            base, start = len(ids), self.target.position
            draft_list = draft.tokens.tolist() if draft is not None else []
            send = torch.tensor(ids[start:] + draft_list, dtype=torch.int64)  # [T]
            started = time.perf_counter()
            logits = self.target.forward(send, drafted + 1)  # [drafted + 1, V]
            verify_s = time.perf_counter() - started

            context = torch.tensor(ids + draft_list, dtype=torch.int64)  # [base + drafted]
            scores = torch.stack(
                [self.processors(context[None, : base + i], logits[i : i + 1].clone())[0] for i in range(drafted + 1)]
            )  # [drafted + 1, V]
            if self.do_sample:
                probs = torch.softmax(scores, dim=-1)  # [drafted + 1, V]
                if draft is None:
                    draft = Draft(torch.empty(0, dtype=torch.int64))
                verdict = accept_sampled(draft, probs, self.generator)
            else:
                verdict = accept_greedy(torch.tensor(draft_list, dtype=torch.int64), scores)
            # the prompt's pass is not a verification round: keep it out of the round-trip fit
            self.chooser.record_round(drafted, verdict.num_accepted, len(send), verify_s if start > 0 else math.nan)
            self._count(k, drafted, verdict.num_accepted, draft_s, verify_s)

            finished = False
            for j, token in enumerate(verdict.tokens):
                ids.append(token)
                generated += 1
                if streamer is not None:
                    streamer.put(torch.tensor([token]))
                if stop(ids, logits[j]) or generated >= max_new_tokens:
                    finished = True
                    break
            self.stats.generated_tokens = generated
            self.target.position = len(ids) - 1  # roll back rejected (and discarded) positions
            logger.debug(
                f"speculative.round(k={k}, drafted={drafted}, accepted={verdict.num_accepted}, "
                f"verify_ms={verify_s * 1000:.1f}, draft_ms={draft_s * 1000:.1f})"
            )
            if finished:
                break
        return ids

    def _count(self, k: int, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        stats = self.stats
        stats.rounds += 1
        stats.drafted_tokens += drafted
        stats.accepted_tokens += accepted
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        stats.chosen_k.append(k)
