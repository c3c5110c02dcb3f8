"""Drives corolla-api with a workload: each conversation's turns in order (every turn re-sends the whole
conversation, as the stateless OpenAI API makes clients do), the conversations interleaved turn by turn, streamed,
timing the first token of each answer and reading `usage.prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

import functools
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
    # per answer token: its log-probability minus the best other word's among the top 5 (how near a tie the greedy
    # choice was: a tiny margin flips under float rounding, e.g. when a prefix's KV came from another computation)
    margins: list[float] | None = None
    decode_s_per_token: float | None = None  # from the first answer token to the last, per token after the first


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
        logprobs=True,
        top_logprobs=5,
        extra_body=extra,
    )
    margins: list[float] = []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if ttft_s is None:
                    ttft_s = time.perf_counter() - started
                parts.append(choice.delta.content)
            for entry in (choice.logprobs.content or []) if choice.logprobs is not None else []:
                others = [t.logprob for t in entry.top_logprobs if t.token != entry.token and t.token.startswith("w")]
                margins.append(entry.logprob - max(others, default=float("-inf")))
    if usage is None:
        raise RuntimeError("the stream ended without its usage chunk")
    ended_s = time.perf_counter() - started
    tokens = int(usage.completion_tokens)
    per_token_s = (ended_s - ttft_s) / (tokens - 1) if ttft_s is not None and tokens > 1 else None
    details = usage.prompt_tokens_details
    cached = int(details.cached_tokens or 0) if details is not None else 0
    return TurnResult(
        -1,
        -1,
        ttft_s,
        int(usage.prompt_tokens),
        cached,
        "".join(parts),
        margins=margins,
        decode_s_per_token=per_token_s,
    )


@dataclass
class _Chat:
    """A conversation being replayed: its messages so far, and whether a turn failed (which ends it)."""

    index: int
    conversation: Conversation
    messages: list[dict[str, str]]
    failed: bool = False


def _next_turn(client: Any, model: str, chat: _Chat, number: int, extra: dict) -> TurnResult:
    turn = chat.conversation.turns[number]
    chat.messages.append({"role": "user", "content": " ".join(turn.user_words)})
    try:
        result = _turn(client, model, chat.messages, turn.answer_tokens, extra)
    except Exception as e:  # reported, never hidden: the run counts errors
        chat.failed = True
        return TurnResult(chat.index, number, None, 0, 0, "", error=repr(e)[:300])
    result.conversation, result.turn = chat.index, number
    chat.messages.append({"role": "assistant", "content": result.answer})
    return result


def replay(
    clients: Sequence[Any], model: str, conversations: Sequence[Conversation], *, extra: dict, concurrency: int = 1
) -> list[list[TurnResult]]:
    """Every one of `clients` (one gateway per way: the cache off, on) replays the conversations, each way's turn of a
    conversation right after the other's, so the ways run under the same load on a shared machine (passes one after
    the other saw the load change between them). Round k runs the k-th turn of every conversation that has one
    (`concurrency` conversations at a time), as users who read an answer before they write the next: between two
    turns of a conversation, every other one takes a turn (which is what makes a cache sized for a few conversations
    lose some). Returns each client's results."""
    chats = [
        [_Chat(i, c, [{"role": "system", "content": " ".join(c.system_words)}]) for i, c in enumerate(conversations)]
        for _ in clients
    ]
    results: list[list[TurnResult]] = [[] for _ in clients]

    def ways_of(index: int, number: int) -> list[TurnResult | None]:
        return [
            None if chats[way][index].failed else _next_turn(client, model, chats[way][index], number, extra)
            for way, client in enumerate(clients)
        ]

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for number in range(max((len(c.turns) for c in conversations), default=0)):
            due = [i for i, c in enumerate(conversations) if number < len(c.turns)]
            for row in pool.map(functools.partial(ways_of, number=number), due):
                for way, result in enumerate(row):
                    if result is not None:
                        results[way].append(result)
    return results
