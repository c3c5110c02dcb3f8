"""What the gateway needs from a model (`GenerationBackend`: a text codec and a blocking stream of logits; the app
samples, so that every sampling parameter is applied in one place whatever the backend), and `SwarmBackend`, which
runs a distributed model with one inference session per request, so concurrent requests reach the servers as
concurrent sessions."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from corolla.api.prompt_cache import report_cached_tokens
from corolla.api.route_trace import GenerationTrace, NoTrace, current_trace
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.client.speculative.loop import SessionTarget, VerifyTarget


class GenerationBackend(Protocol):
    model_id: str
    max_context_tokens: int
    eos_token_ids: frozenset[int]
    generation_defaults: dict[str, Any]  # SamplingParams field -> default (from generation_config.json)

    @property
    def vocab_size(self) -> int | None: ...  # read-only, so a backend may declare a plain int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]: ...

    def step_logits(self, prompt_ids: list[int], max_length: int) -> Generator[torch.Tensor, int, None]:
        """Yields the next-token logits [V] after the prompt, then after each token sent in (blocking; run in a
        worker thread); the sequence never exceeds `max_length` tokens. Closing the generator early must release
        the inference session. May raise `corolla.utils.errors.MissingBlocksError`."""
        ...

    def verify_target(self, max_length: int) -> AbstractContextManager[VerifyTarget]:
        """For speculative decoding: a fresh rollback-able target (`corolla.client.speculative.loop.VerifyTarget`,
        empty cache) for a sequence of at most `max_length` tokens, released on exit. Backends without one raise
        `NotImplementedError` (the app then refuses `--speculative` at start)."""
        ...


def plain_chat_prompt(messages: list[dict[str, str]]) -> str:
    """The fallback chat format for tokenizers without a template: one "role: content" line per message."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


class TokenizerCodec:
    """Encode/decode/chat-prompt through a Hugging Face tokenizer."""

    def __init__(self, tokenizer: Any, *, max_context_tokens: int):
        self.tokenizer = tokenizer
        self.max_context_tokens = max_context_tokens
        self.eos_token_ids = frozenset(_ids(tokenizer.eos_token_id))
        self.generation_defaults: dict[str, Any] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            # the template already holds BOS and other special tokens: do not add them twice
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self.encode(plain_chat_prompt(messages))


class SwarmBackend(TokenizerCodec):
    """Runs a `corolla.client` distributed causal LM: prefill once, then one token per step. The gateway is one
    client identity, so any prompt prefix it sent before (the earlier turns of a conversation, a system prompt
    shared by its users) is reused where the servers still hold it (reported by `api.prompt_cache`)."""

    def __init__(self, model: Any, tokenizer: Any, *, model_id: str, max_context_tokens: int | None = None):
        if max_context_tokens is None:
            max_context_tokens = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        super().__init__(tokenizer, max_context_tokens=max_context_tokens)
        self.model = model
        self.model_id = model_id
        self.vocab_size = int(model.config.vocab_size)
        generation_config = getattr(model, "generation_config", None)
        self.generation_defaults = generation_defaults(generation_config)
        self.eos_token_ids = self.eos_token_ids | frozenset(_ids(getattr(generation_config, "eos_token_id", None)))

    @contextlib.contextmanager
    def _session(self, max_length: int) -> Iterator[tuple[Any, GenerationTrace | NoTrace]]:
        """An explicit session per request (never the model's shared `active_session`: requests run in parallel)
        and the request's trace (its servers, for /corolla/route; a no-op outside a request), both ended on exit."""
        session = self.model.inference_session(max_length=max_length)
        trace = current_trace()
        try:
            with torch.inference_mode():
                yield session, trace
        finally:
            session.close()
            trace.finish()

    def step_logits(self, prompt_ids: list[int], max_length: int) -> Generator[torch.Tensor, int, None]:
        with self._session(max_length) as (session, trace):
            input_ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, T]
            hidden = self.model.session_step(session, input_ids, may_reuse=True)  # [1, T - reused, H]
            report_cached_tokens(session.reused_tokens)
            while True:
                logits = self.model.head(hidden[:, -1:])  # [1, 1, V]
                trace.step(session.route)
                token = yield logits[0, -1]
                hidden = self.model.session_step(session, torch.tensor([[token]], dtype=torch.long))  # [1, 1, H]

    @contextlib.contextmanager
    def verify_target(self, max_length: int) -> Iterator[VerifyTarget]:
        with self._session(max_length) as (session, trace):
            yield _TracedTarget(self.model, session, trace)


class _TracedTarget(SessionTarget):
    """`SessionTarget` that reports each verification pass's servers to the request's route trace."""

    def __init__(self, model: Any, session: Any, trace: GenerationTrace | NoTrace):
        super().__init__(model, session)
        self.trace = trace

    def forward(self, ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        logits = super().forward(ids, num_logits)  # [num_logits, V]
        self.trace.step(self.session.route)
        return logits


# generation_config.json fields the API applies as defaults, by SamplingParams field (vLLM's `--generation-config`)
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(generation_config: Any) -> dict[str, Any]:
    """The sampling defaults a model's generation config sets (only the fields it differs from transformers' own
    defaults on, as vLLM reads them), keyed by `SamplingParams` field."""
    if generation_config is None:
        return {}
    diff = generation_config.to_diff_dict()
    return {name: diff[name] for name in GENERATION_DEFAULT_FIELDS if diff.get(name) is not None}


def default_model_id(name_or_path: str) -> str:
    """The name clients use by default: a local directory's basename, a hub repo id as it is."""
    path = os.path.expanduser(str(name_or_path))
    if os.path.isdir(path):
        return os.path.basename(os.path.normpath(path)) or str(name_or_path)
    return str(name_or_path)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def load_swarm_backend(
    name_or_path: str,
    *,
    initial_peers: Sequence[str],
    dht_prefix: str | None = None,
    model_id: str | None = None,
    max_retries: int | None = 3,
    torch_dtype: str = "float32",
    swarm_key_file: str | None = None,
) -> SwarmBackend:
    """Connects a distributed model and its tokenizer to a swarm. `max_retries` bounds fail-over so that a swarm
    missing blocks yields a prompt 503 rather than a request waiting forever."""
    from transformers import AutoTokenizer

    client_config = ClientConfig(
        initial_peers=tuple(initial_peers),
        dht_prefix=dht_prefix,
        max_retries=max_retries,
        swarm_key_file=swarm_key_file,
    )
    dtype = torch_dtype if torch_dtype == "auto" else getattr(torch, torch_dtype)
    if not isinstance(dtype, (str, torch.dtype)):
        raise ValueError(f"torch_dtype must be 'auto' or a torch dtype name like 'float32', got {torch_dtype!r}")
    model = AutoDistributedModelForCausalLM.from_pretrained(
        name_or_path, client_config=client_config, torch_dtype=dtype
    )
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    return SwarmBackend(model, tokenizer, model_id=model_id or default_model_id(str(name_or_path)))
