"""Drives corolla-api with a workload: each conversation's turns in order (every turn re-sends the whole
conversation, as the stateless OpenAI API makes clients do), streamed, timing the first token of each answer and
reading `usage.prompt_tokens_details.cached_tokens`. Conversations run `concurrency` at a time."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from benchmarks.prefix.workload import Conversation


@dataclass
class TurnResult:
    conversation: int
    turn: int
    ttft_s: float | None  # None: failed before its first token
    prompt_tokens: int
    cached_tokens: int
    answer: str
    error: str | None = None


def _turn(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int, extra: dict) -> TurnResult:
    started = time.perf_counter()
    ttft_s, parts, usage = None, [], None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if ttft_s is None:
                    ttft_s = time.perf_counter() - started
                parts.append(choice.delta.content)
    if usage is None:
        raise RuntimeError("the stream ended without its usage chunk")
    details = usage.prompt_tokens_details
    cached = int(details.cached_tokens or 0) if details is not None else 0
    return TurnResult(-1, -1, ttft_s, int(usage.prompt_tokens), cached, "".join(parts))


def replay_conversation(
    client: Any, model: str, index: int, conversation: Conversation, extra: dict
) -> list[TurnResult]:
    """The turns of one conversation; a failed turn ends it (recorded with its error)."""
    messages = [{"role": "system", "content": " ".join(conversation.system_words)}]
    results = []
    for number, turn in enumerate(conversation.turns):
        messages.append({"role": "user", "content": " ".join(turn.user_words)})
        try:
            result = _turn(client, model, messages, turn.answer_tokens, extra)
        except Exception as e:  # reported, never hidden: the run counts errors
            results.append(TurnResult(index, number, None, 0, 0, "", error=repr(e)[:300]))
            break
        result.conversation, result.turn = index, number
        results.append(result)
        messages.append({"role": "assistant", "content": result.answer})
    return results


def replay(
    client: Any, model: str, conversations: Sequence[Conversation], *, extra: dict, concurrency: int = 1
) -> list[TurnResult]:
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(replay_conversation, client, model, i, c, extra) for i, c in enumerate(conversations)]
        return [result for future in futures for result in future.result()]
