"""What the gateway needs from a model: a text codec (encode, decode, chat prompt) and a blocking token generator.

`GenerationBackend` is the protocol `create_app` drives; `TokenizerCodec` adapts a Hugging Face tokenizer (its chat
template, or plain "role: content" lines when it has none); `SwarmBackend` generates through a distributed model,
one inference session per request, so concurrent requests reach the servers as concurrent sessions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from corolla.api.sampling import SamplingParams, sample_next_token
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class GenerationBackend(Protocol):
    model_id: str
    max_context_tokens: int
    eos_token_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]: ...

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """Yields up to `params.max_new_tokens` token ids (blocking; run in a worker thread). Closing the iterator
        early must release the inference session. May raise `corolla.utils.errors.MissingBlocksError`."""
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
        eos = tokenizer.eos_token_id
        self.eos_token_ids = frozenset([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            # the template already holds BOS and other special tokens: do not add them twice
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self.encode(plain_chat_prompt(messages))


class SwarmBackend(TokenizerCodec):
    """Generates with a `corolla.client` distributed causal LM: prefill once, then one token per step."""

    def __init__(self, model: Any, tokenizer: Any, *, model_id: str, max_context_tokens: int | None = None):
        if max_context_tokens is None:
            max_context_tokens = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        super().__init__(tokenizer, max_context_tokens=max_context_tokens)
        self.model = model
        self.model_id = model_id
        self.vocab_size = int(model.config.vocab_size)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        generator = params.make_generator()
        # An explicit session per request (never the model's shared `active_session`): requests run in parallel.
        session = self.model.inference_session(max_length=len(prompt_ids) + params.max_new_tokens)
        try:
            with torch.inference_mode():
                input_ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, T]
                for _ in range(params.max_new_tokens):
                    logits = self.model(input_ids, session=session).logits  # [1, T, V]
                    token = sample_next_token(logits[0, -1], params, generator)
                    yield token
                    input_ids = torch.tensor([[token]], dtype=torch.long)  # [1, 1]
        finally:
            session.close()


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

    from corolla.client import AutoDistributedModelForCausalLM, ClientConfig

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
    return SwarmBackend(model, tokenizer, model_id=model_id or str(name_or_path))
