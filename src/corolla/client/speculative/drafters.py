"""Drafters for speculative decoding: prompt lookup (n-gram matches in the context, no model) and a small local
draft model (a `transformers` causal LM with the target's tokenizer, e.g. the demo model's draft in
`corolla.demo.checkpoint.ensure_demo_draft`), which keeps its own KV cache in step with the accepted text."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from corolla.client.speculative.acceptance import Draft, Sampler, SpeculativeConfig
from corolla.demo.checkpoint import ensure_demo_draft
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

_LOADED: dict[str, torch.nn.Module] = {}  # draft models by path: read-only at inference, shared between drafters
_LOADED_LOCK = threading.Lock()


class PromptLookupDrafter:
    """Finds the longest n-gram (`max_ngram` down to `min_ngram` tokens) ending the context that also occurs
    earlier, and proposes the tokens that followed its latest earlier occurrence. q is a point mass."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: torch.Tensor, k: int, sample: Sampler | None) -> Draft:
        ids = context.tolist()
        length = len(ids)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            tail = ids[length - n :]
            # latest earlier start s with ids[s:s+n] == tail and at least one token after it (s + n < length)
            for start in range(length - n - 1, -1, -1):
                if ids[start : start + n] == tail:
                    proposal = ids[start + n : start + n + k]
                    return Draft(torch.tensor(proposal, dtype=torch.int64))
        return Draft(torch.empty(0, dtype=torch.int64))


class DraftModelDrafter:
    """A small causal LM run locally. Drafts greedily (`sample` None) or by sampling from the processed draft
    distribution; keeps a KV cache of the context it has seen and crops it to the common prefix each round."""

    def __init__(self, model: torch.nn.Module, generator: torch.Generator | None = None):
        self.model = model.eval()
        self.generator = generator
        self._cache: DynamicCache | None = None
        self._seen: list[int] = []  # tokens whose keys/values are in the cache

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DraftModelDrafter:
        """A drafter over the model at `path`, loaded once per process (drafters share weights, not caches)."""
        key = str(Path(path).resolve()) if Path(path).exists() else str(path)
        with _LOADED_LOCK:
            model = _LOADED.get(key)
            if model is None:
                model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
                _LOADED[key] = model
                logger.info(f"draft_model.loaded(path={path}, params={sum(p.numel() for p in model.parameters())})")
        return cls(model)

    def _sync(self, ids: list[int]) -> list[int]:
        """Crops the cache to the longest common prefix with `ids`; returns the tokens still to run."""
        common = 0
        for a, b in zip(self._seen, ids, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # always run at least the last token: its logits are needed
        if self._cache is None or common == 0:
            self._cache, self._seen = DynamicCache(), []
            return ids
        if common < len(self._seen):
            self._cache.crop(common - len(self._seen))  # transformers 5: a negative count of tokens to drop
        self._seen = self._seen[:common]
        return ids[common:]

    @torch.no_grad()
    def propose(self, context: torch.Tensor, k: int, sample: Sampler | None) -> Draft:
        if k <= 0:
            return Draft(torch.empty(0, dtype=torch.int64))
        ids = context.tolist()
        pending = self._sync(ids)
        prefix = list(ids)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for _ in range(k):
            out = self.model(
                input_ids=torch.tensor([pending]), past_key_values=self._cache, use_cache=True
            )  # logits [1, n, V]
            self._cache = out.past_key_values
            self._seen.extend(pending)
            logits = out.logits[0, -1].to(torch.float32)  # [V]
            if sample is None:
                token = int(torch.argmax(logits))
            else:
                q = sample(torch.tensor(prefix, dtype=torch.int64), logits)  # [V]
                token = int(torch.multinomial(q, 1, generator=self.generator))
                probs.append(q)
            tokens.append(token)
            prefix.append(token)
            pending = [token]
        return Draft(torch.tensor(tokens, dtype=torch.int64), torch.stack(probs) if probs else None)


def make_drafter(config: SpeculativeConfig) -> PromptLookupDrafter | DraftModelDrafter:
    """The drafter a `SpeculativeConfig` names (the demo draft model when `draft_model_path` is None)."""
    if config.drafter == "lookup":
        return PromptLookupDrafter(config.lookup_max_ngram, config.lookup_min_ngram)
    path = config.draft_model_path if config.draft_model_path is not None else ensure_demo_draft()
    return DraftModelDrafter.from_pretrained(path)
