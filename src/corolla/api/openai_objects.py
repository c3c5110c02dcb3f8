"""The JSON objects of the OpenAI API that `corolla-api` answers with: the envelope every completion object and
stream chunk shares, `usage`, and the `logprobs` objects of completions (legacy format) and chat completions."""

from __future__ import annotations

from typing import Any

from corolla.api.generation import TokenLogprob


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The `usage` object: prompt, completion and total token counts, and (as OpenAI) the prompt tokens that came
    from a cache in `prompt_tokens_details.cached_tokens`."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def envelope(rid: str, kind: str, created: int, model: str, choices: list[Any], **extra: Any) -> dict[str, Any]:
    """The fields every completion object and stream chunk shares, then `choices` and `extra` (e.g. usage)."""
    return {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
        **extra,
    }


def completion_logprobs(entries: list[TokenLogprob], offsets: list[int], index: int) -> dict[str, Any]:
    """The legacy completions `logprobs` object; the sampled token is always among `top_logprobs` (as OpenAI does)."""
    text_offset = []
    for entry in entries:
        text_offset.append(offsets[index])
        offsets[index] += len(entry.text)
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict([*e.top, (e.text, e.logprob)]) if e.top else {e.text: e.logprob} for e in entries],
        "text_offset": text_offset,
    }


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """The chat `logprobs` object: `content`, one entry per token with its `top_logprobs`."""

    def item(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [{**item(e.text, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries],
        "refusal": None,
    }
