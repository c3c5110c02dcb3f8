"""`generate()` for distributed models: our own decoding loop with `transformers`' logits processors (same order
and defaults as `transformers.generate`), greedy or sampling, sessions that continue, `stop_strings` (with
`tokenizer=`, through `transformers`' `StopStringCriteria`), left-padded batches (rows grouped by padding length,
`padding_groups`, so that no pad position enters a server's cache; `forward` groups them so too) and opt-in
speculative decoding (`speculative=SpeculativeConfig(...)`: `corolla.client.speculative.loop`). An argument it does
not implement is a ValueError, never silently ignored."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Protocol

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.stopping_criteria import StopStringCriteria

from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session.inference_session import InferenceSession
from corolla.client.speculative.acceptance import KChooser, SpeculativeConfig
from corolla.client.speculative.drafters import make_drafter
from corolla.client.speculative.loop import LocalEnds, SessionTarget, SpeculativeLoop, SpeculativeStats
from corolla.client.training.remote_sequential import RemoteSequential
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

_UNSUPPORTED = {  # generate() arguments we refuse rather than silently ignore
    "num_beams": 1,
    "num_return_sequences": 1,
    "penalty_alpha": None,
    "assistant_model": None,
    "return_dict_in_generate": False,
    "output_scores": False,
    "output_logits": False,
}
# generate() arguments (GenerationConfig fields) this loop implements; any other one passed is a ValueError
_IMPLEMENTED = {
    "max_new_tokens", "max_length", "min_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "min_p", "typical_p", "repetition_penalty", "no_repeat_ngram_size", "eos_token_id", "pad_token_id",
    "bos_token_id", "stop_strings", "use_cache", *_UNSUPPORTED,
}  # fmt: skip


def padding_groups(attention_mask: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """Groups rows of a left-padded mask `[B, L]` by padding length: [(row indices, pad length)]."""
    mask = attention_mask.bool()
    pads = (~mask).int().cumprod(dim=1).sum(dim=1)  # leading zeros per row
    for row, pad in enumerate(pads.tolist()):
        if not bool(mask[row, pad:].all()):
            raise ValueError("attention_mask must use left padding (zeros only before the first token)")
    return [(torch.nonzero(pads == pad).flatten(), int(pad)) for pad in sorted(set(pads.tolist()))]


class GeneratingModel(LocalEnds, Protocol):
    """What `generate()` needs of a `DistributedModelForCausalLM` (which imports this module: named here by shape)."""

    speculative_stats: SpeculativeStats | None  # set by a speculative generate()

    @property
    def generation_config(self) -> Any: ...

    @property
    def manager(self) -> RemoteSequenceManager: ...

    @property
    def transformer(self) -> RemoteSequential: ...

    @property
    def pre_seq_len(self) -> int: ...

    def session_step(
        self,
        session: InferenceSession,
        input_ids: torch.Tensor,
        prompts: torch.Tensor | None = None,
        *,
        may_reuse: bool = False,
    ) -> torch.Tensor: ...


class GenerationLoop:
    """One `generate()` call of a distributed model."""

    def __init__(self, model: GeneratingModel):
        self.model = model

    def _generation_config(
        self, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
    ) -> GenerationConfig:
        config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
        model_defaults = self.model.generation_config or GenerationConfig()
        config.update(**model_defaults.to_dict(), defaults_only=True, allow_custom_entries=True)
        config.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
        not_implemented = set(kwargs) - _IMPLEMENTED
        if not_implemented:
            raise ValueError(f"generate() got unsupported arguments {sorted(not_implemented)}")
        config.update(**kwargs)
        for name, default in _UNSUPPORTED.items():
            if getattr(config, name, default) not in (default, None):
                raise ValueError(f"generate(): {name}={getattr(config, name)!r} is not supported by distributed models")
        return config

    @staticmethod
    def _processors(
        config: GenerationConfig, prompt_length: int, eos: torch.Tensor | None, attention_mask: torch.Tensor | None
    ) -> LogitsProcessorList:
        """The subset of `transformers`' processors we support, built in `_get_logits_processor`'s order."""
        processors = LogitsProcessorList()
        if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
            ignore = (attention_mask != 0).int().argmax(dim=1) if attention_mask is not None else None
            processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty, prompt_ignore_length=ignore))
        if config.no_repeat_ngram_size is not None and config.no_repeat_ngram_size > 0:
            processors.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
        if eos is not None and config.min_length is not None and config.min_length > 0:
            processors.append(MinLengthLogitsProcessor(config.min_length, eos))
        if eos is not None and config.min_new_tokens is not None and config.min_new_tokens > 0:
            processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, config.min_new_tokens, eos))
        if config.do_sample:
            if config.temperature is not None and config.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(config.temperature))
            if config.top_k is not None and config.top_k != 0:
                processors.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
            if config.top_p is not None and config.top_p < 1.0:
                processors.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
            if config.min_p is not None:
                processors.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
            if config.typical_p is not None and config.typical_p < 1.0:
                processors.append(TypicalLogitsWarper(mass=config.typical_p, min_tokens_to_keep=1))
        return processors

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        session: InferenceSession | None = None,
        generation_config: GenerationConfig | None = None,
        logits_processor: LogitsProcessorList | None = None,
        streamer: Any = None,
        prompts: torch.Tensor | None = None,
        tokenizer: Any = None,
        speculative: SpeculativeConfig | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        model = self.model
        if inputs is not None and input_ids is not None:
            raise ValueError("pass the prompt as `inputs` or `input_ids`, not both")
        new_ids = inputs if inputs is not None else input_ids
        session = session or model.transformer.active_session
        previous = session.output_ids if session is not None else None
        if new_ids is None:
            if previous is None:
                raise ValueError("generate() needs input_ids unless it continues a session that already generated")
            new_ids = previous.new_zeros(previous.shape[0], 0)
        if new_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {list(new_ids.shape)}")
        new_ids = new_ids.to(torch.int64)
        config = self._generation_config(generation_config, kwargs)

        padded = attention_mask is not None and not bool(attention_mask.all())
        if padded and (session is not None or prompts is not None):
            raise ValueError("left-padded batches are generated in fresh sessions, without deep prompts")
        if previous is not None and previous.shape[0] != new_ids.shape[0]:
            raise ValueError(f"session holds {previous.shape[0]} sequences, got a batch of {new_ids.shape[0]}")
        all_ids = torch.cat([previous, new_ids], dim=1) if previous is not None else new_ids  # what processors see
        # the last token of a previous call was sampled but never run through the blocks
        to_send = torch.cat([previous[:, -1:], new_ids], dim=1) if previous is not None else new_ids

        prompt_length = all_ids.shape[1]
        if config.max_new_tokens is not None:
            max_new_tokens = config.max_new_tokens
        else:
            max_new_tokens = config.max_length - prompt_length
        if max_new_tokens < 0:
            raise ValueError(f"max_length={config.max_length} is shorter than the {prompt_length}-token prompt")
        eos = config.eos_token_id
        eos_tensor = torch.tensor([eos] if isinstance(eos, int) else list(eos)) if eos is not None else None
        pad_token_id = config.pad_token_id
        if pad_token_id is None and eos_tensor is not None:
            pad_token_id = int(eos_tensor[0])
        processors = self._processors(config, prompt_length, eos_tensor, attention_mask)
        if logits_processor is not None:
            processors.extend(logits_processor)
        stop_strings = None
        if config.stop_strings:
            if tokenizer is None:
                raise ValueError("generate(stop_strings=...) needs tokenizer= (as in transformers)")
            stop_strings = StopStringCriteria(tokenizer, config.stop_strings)
        stops = eos_tensor is not None or stop_strings is not None
        prefix_length = model.pre_seq_len  # a tuned prefix takes cache positions of every fresh session
        if speculative is not None:
            if prefix_length:
                raise ValueError("speculative decoding of a prompt-tuned model (tuning_mode) is not supported")
            if new_ids.shape[0] != 1 or padded:
                raise ValueError("speculative decoding generates one unpadded sequence at a time (batch size 1)")

        with contextlib.ExitStack() as stack:
            if padded and attention_mask is not None:  # (padded implies a mask)
                groups = []
                for rows, pad in padding_groups(attention_mask):
                    max_length = prefix_length + prompt_length - pad + max_new_tokens
                    group_session = stack.enter_context(InferenceSession(model.manager, max(max_length, 1)))
                    groups.append((rows, pad, group_session))
            else:
                if session is None:
                    max_length = max(prefix_length + prompt_length + max_new_tokens, 1)
                    session = stack.enter_context(InferenceSession(model.manager, max_length))
                groups = [(torch.arange(new_ids.shape[0]), 0, session)]
            if streamer is not None:
                streamer.put(new_ids.cpu())
            if speculative is not None and session is not None:
                all_ids = self._speculative(
                    session, speculative, all_ids, max_new_tokens, processors, config, eos_tensor, stop_strings,
                    prompts, streamer,
                )  # fmt: skip
            else:
                unfinished = torch.ones(all_ids.shape[0], dtype=torch.bool)
                for step in range(max_new_tokens):
                    logits = self._step(groups, to_send, step == 0, prompts)  # [B, V] fp32
                    scores = processors(all_ids, logits)
                    if config.do_sample:
                        next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
                    else:
                        next_tokens = torch.argmax(scores, dim=-1)
                    if stops and pad_token_id is not None:
                        next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, pad_token_id))
                    all_ids = torch.cat([all_ids, next_tokens[:, None]], dim=1)
                    if streamer is not None:
                        streamer.put(next_tokens.cpu())
                    if eos_tensor is not None:
                        unfinished &= ~torch.isin(next_tokens, eos_tensor)
                    if stop_strings is not None:
                        unfinished &= ~stop_strings(all_ids, scores).to(unfinished.device)
                    if stops and not bool(unfinished.any()):
                        break
                    to_send = next_tokens[:, None]
            if streamer is not None:
                streamer.end()
            if session is not None and not padded:
                session.output_ids = all_ids
        return all_ids[:, previous.shape[1] :] if previous is not None else all_ids

    def _speculative(
        self,
        session: InferenceSession,
        speculative: SpeculativeConfig,
        all_ids: torch.Tensor,
        max_new_tokens: int,
        processors: LogitsProcessorList,
        config: GenerationConfig,
        eos: torch.Tensor | None,
        stop_strings: StopStringCriteria | None,
        prompts: Any,
        streamer: Any,
    ) -> torch.Tensor:
        """One sequence `all_ids` [1, L] through `SpeculativeLoop`; returns [1, L + N] and records the stats on the
        model (`model.speculative_stats`)."""
        eos_ids = set(eos.tolist()) if eos is not None else set()

        def stop(ids: list[int], logits: torch.Tensor) -> bool:
            if ids[-1] in eos_ids:
                return True
            if stop_strings is None:
                return False
            return bool(stop_strings(torch.tensor([ids]), None)[0])

        loop = SpeculativeLoop(
            target=SessionTarget(self.model, session, prompts),
            drafter=make_drafter(speculative),
            chooser=KChooser(max_k=speculative.max_draft_tokens, fixed_k=speculative.num_draft_tokens),
            processors=processors,
            do_sample=bool(config.do_sample),
        )
        self.model.speculative_stats = loop.stats
        ids = loop.run(all_ids[0].tolist(), max_new_tokens, stop, streamer)
        stats: SpeculativeStats = loop.stats
        rate = stats.acceptance_rate
        logger.info(
            f"speculative.done(drafter={speculative.drafter}, tokens={stats.generated_tokens}, rounds={stats.rounds}, "
            f"acceptance={'n/a' if rate is None else f'{rate:.3f}'}, tokens_per_round={stats.tokens_per_round:.2f})"
        )
        return torch.tensor([ids], dtype=torch.int64)

    def _step(
        self, groups: list[tuple[torch.Tensor, int, InferenceSession]], to_send: torch.Tensor, first: bool, prompts: Any
    ) -> torch.Tensor:
        """Runs the new tokens through every group's session; returns the last position's logits [B, V] in fp32 on
        the ids' device (the embeddings and head may live on a GPU; the loop's ids, processors and sampling don't)."""
        model = self.model
        logits = None
        for rows, pad, session in groups:
            ids = to_send[rows, pad:] if first else to_send[rows]
            step_prompts = prompts if session.position == 0 else None
            # [b, t', H] (a tuned prefix removed; t' < t where the servers held a prefix of a fresh session)
            hidden = model.session_step(session, ids, step_prompts, may_reuse=True)
            group_logits = model.head(hidden[:, -1:]).to(torch.float32)[:, -1]  # [b, V]
            if logits is None:
                logits = group_logits.new_zeros(to_send.shape[0], group_logits.shape[-1])
            logits[rows] = group_logits
        assert logits is not None
        return logits.to(to_send.device)
