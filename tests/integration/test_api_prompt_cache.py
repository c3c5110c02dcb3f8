"""corolla-api's `usage.prompt_tokens_details.cached_tokens`: what the backend reports for a choice's session (the
positions its servers reused), in plain and streamed responses, through the official `openai` client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tests.integration.test_api_app import MODEL, ScriptedBackend

from corolla.api.app import ApiConfig, create_app
from corolla.api.prompt_cache import report_cached_tokens
from corolla.api.serving import serve_in_thread
from helpers.api_client import openai_client


class CachingBackend(ScriptedBackend):
    """Reports the whole 16-token blocks of the longest prompt prefix it saw before as cached."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int]] = []

    def step_logits(self, prompt_ids: list[int], max_length: int) -> Iterator[torch.Tensor]:
        common = 0
        for old in self.seen:
            n = next(
                (i for i, (a, b) in enumerate(zip(old, prompt_ids, strict=False)) if a != b),
                min(len(old), len(prompt_ids)),
            )
            common = max(common, n)
        self.seen.append(list(prompt_ids))
        report_cached_tokens(min(common, len(prompt_ids) - 1) // 16 * 16)
        yield from super().step_logits(prompt_ids, max_length)


@pytest.fixture(scope="module")
def client():
    with serve_in_thread(create_app(CachingBackend(), ApiConfig())) as running:
        yield openai_client(running.url)


def test_chat_usage_reports_cached_prompt_tokens(client):
    system = {"role": "system", "content": "You are a helpful assistant who answers in one line. " * 2}
    first = [system, {"role": "user", "content": "What is a prefix cache?"}]
    out = client.chat.completions.create(model=MODEL, messages=first, max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    second = [*first, {"role": "assistant", "content": out.choices[0].message.content}]
    second.append({"role": "user", "content": "And why does it help?"})
    out2 = client.chat.completions.create(model=MODEL, messages=second, max_tokens=3, temperature=0)
    cached = out2.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached <= out2.usage.prompt_tokens
    stream = client.chat.completions.create(
        model=MODEL, messages=second, max_tokens=3, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens >= cached
    # another user with the same system prompt shares its blocks (the gateway is one identity)
    other = [system, {"role": "user", "content": "Unrelated question"}]
    out3 = client.chat.completions.create(model=MODEL, messages=other, max_tokens=3, temperature=0)
    assert out3.usage.prompt_tokens_details.cached_tokens >= 96
    legacy = client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    assert legacy.usage.prompt_tokens_details.cached_tokens == 0
