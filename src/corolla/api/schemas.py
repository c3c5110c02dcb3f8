"""Request bodies of the OpenAI and vLLM APIs we serve, as pydantic models; responses are built as plain dicts in `app`
to match OpenAI exactly.

No field is silently ignored: every field a model declares is honored, `ONLY_DEFAULT` lists the fields accepted only at
their no-op value (anything else is refused by `refuse_unsupported` with a 400 naming the field), `METADATA_FIELDS`
are request metadata that change no output, and any other field is refused (pydantic `extra="forbid"`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_SEQUENCES = 4

# fields that carry no instruction for generation (accepted, recorded nowhere)
METADATA_FIELDS = ("user", "metadata", "request_id", "service_tier", "store")

# field -> the values that mean "off": accepted (and dropped); any other value is a 400 naming the field
_COMMON_ONLY_DEFAULT: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "truncate_prompt_tokens": (),
    "prompt_logprobs": (),
    "bad_words": ([],),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "structured_outputs": (),
    "priority": (0,),
    "echo": (False,),
    "response_format": ({"type": "text"},),
}
ONLY_DEFAULT: dict[str, dict[str, tuple[Any, ...]]] = {
    "completion": {**_COMMON_ONLY_DEFAULT, "suffix": ("",), "best_of": (1,)},
    "chat": {
        **_COMMON_ONLY_DEFAULT,
        "tools": ([],),
        "tool_choice": ("none", "auto"),
        "parallel_tool_calls": (True, False),
        "functions": ([],),
        "function_call": ("none", "auto"),
        "add_generation_prompt": (True,),
        "continue_final_message": (False,),
        "chat_template": (),
        "chat_template_kwargs": ({},),
        "documents": ([],),
        "modalities": (["text"],),
        "audio": (),
        "reasoning_effort": (),
        "prediction": (),
        "web_search_options": (),
    },
}


def refuse_unsupported(body: dict[str, Any], kind: str) -> tuple[dict[str, Any], str | None, str | None]:
    """Drops the no-op fields of `body` (a new dict); returns it with the first field set to something we do not
    implement (and why), else None."""
    kept = {}
    for name, value in body.items():
        allowed = ONLY_DEFAULT[kind].get(name)
        if allowed is None:
            kept[name] = value
        elif value is not None and value not in allowed:
            shown = f" (only {', '.join(repr(v) for v in allowed)} or unset)" if allowed else " (leave it unset)"
            return kept, name, f"{name}={value!r} is not supported by this server{shown}"
    return kept, None, None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    n: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    # request metadata (METADATA_FIELDS): no effect on the output
    user: str | None = None
    metadata: dict[str, Any] | None = None
    request_id: str | None = None
    service_tier: str | None = None
    store: bool | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # fields of an assistant message as a response carried them, sent back in the history: `refusal` and
    # `annotations` are output-only (not shown to the model); tool and audio fields are refused unless empty
    refusal: str | None = None
    annotations: list[Any] | None = None
    reasoning_content: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    audio: Any = None

    def as_dict(self) -> dict[str, str]:
        """The message as a chat template takes it (ValueError for non-text content or tool/audio fields)."""
        for field in ("tool_calls", "tool_call_id", "function_call", "audio"):
            if getattr(self, field):
                raise ValueError(f"messages with {field} are not supported (tools and audio are not implemented)")
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message

    def text(self) -> str:
        """The message's text; content parts must all be of type "text"."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
