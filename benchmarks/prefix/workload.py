"""The multi-turn chat replay: conversations of several turns sharing a few system prompts, with prompt and answer
lengths drawn around published averages (LMSYS-Chat-1M, Zheng et al., ICLR 2024, Table 1: 2.0 turns per
conversation, 69.5 tokens per user prompt, 214.5 tokens per response), or requests read from a trace in the public
Mooncake format (`{"timestamp", "input_length", "output_length", "hash_ids"}` per line, one hash id per block of
`block_tokens` tokens; equal ids = equal blocks). Text is words of a fixed vocabulary, one token each."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# LMSYS-Chat-1M (arXiv 2309.11998), Table 1: averages over one million real conversations
LMSYS_TURNS_PER_CONVERSATION = 2.0
LMSYS_PROMPT_TOKENS = 69.5
LMSYS_RESPONSE_TOKENS = 214.5
# not a published figure: a deployment's system prompt, the same for every user of it (ours: 4 of ~256 tokens)
SYSTEM_PROMPT_TOKENS = 256
NUM_SYSTEM_PROMPTS = 4
MOONCAKE_BLOCK_TOKENS = 512  # the public Mooncake traces hash 512-token blocks
LENGTH_SIGMA = 0.8  # spread of the log-normal lengths around their published means
MAX_TRACE_LINE_BYTES = 1 << 20
MAX_TRACE_TOKENS = 1 << 20


@dataclass(frozen=True)
class Turn:
    user_words: tuple[str, ...]
    answer_tokens: int  # max_tokens of the request (the answer is generated to this length: ignore_eos)


@dataclass(frozen=True)
class Conversation:
    system_words: tuple[str, ...]
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class WorkloadConfig:
    num_conversations: int = 16
    turns_per_conversation: float = LMSYS_TURNS_PER_CONVERSATION
    prompt_tokens: float = LMSYS_PROMPT_TOKENS
    response_tokens: float = LMSYS_RESPONSE_TOKENS
    system_prompt_tokens: int = SYSTEM_PROMPT_TOKENS
    num_system_prompts: int = NUM_SYSTEM_PROMPTS
    max_turns: int = 6
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_conversations < 1 or self.turns_per_conversation < 1 or self.max_turns < 1:
            raise ValueError("a workload needs >= 1 conversation of >= 1 turn (turns_per_conversation >= 1)")


def _length(rng: random.Random, mean: float, *, low: int = 4) -> int:
    """A log-normal length with the given mean (heavy-tailed as chat lengths are), at least `low`, at most 4x mean."""
    mu = math.log(mean) - LENGTH_SIGMA**2 / 2
    return int(min(max(low, round(rng.lognormvariate(mu, LENGTH_SIGMA))), 4 * mean))


def _words(rng: random.Random, vocabulary: Sequence[str], n: int) -> tuple[str, ...]:
    return tuple(rng.choice(vocabulary) for _ in range(n))


def generate_conversations(config: WorkloadConfig, vocabulary: Sequence[str]) -> list[Conversation]:
    """Seeded conversations: a system prompt among `num_system_prompts`, a geometric number of turns with the given
    mean (capped at `max_turns`), log-normal prompt and answer lengths around the given means."""
    rng = random.Random(config.seed)
    systems = [_words(rng, vocabulary, config.system_prompt_tokens) for _ in range(config.num_system_prompts)]
    p_end = 1.0 / config.turns_per_conversation
    conversations = []
    for _ in range(config.num_conversations):
        num_turns = 1
        while num_turns < config.max_turns and rng.random() > p_end:
            num_turns += 1
        turns = tuple(
            Turn(_words(rng, vocabulary, _length(rng, config.prompt_tokens)), _length(rng, config.response_tokens))
            for _ in range(num_turns)
        )
        conversations.append(Conversation(rng.choice(systems), turns))
    return conversations


@dataclass(frozen=True)
class TraceRequest:
    """One request of a Mooncake trace: its prompt (words: block `i` is made from `hash_ids[i]`, so requests that
    share leading hash ids share a prefix), answer length and arrival time."""

    arrival_s: float
    prompt_words: tuple[str, ...]
    answer_tokens: int


def read_mooncake_trace(
    path: str | Path,
    vocabulary: Sequence[str],
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    scale: float = 1.0,
    limit: int | None = None,
) -> Iterator[TraceRequest]:
    """The trace's requests in order (ValueError on a malformed line, naming it). `scale` shrinks every length
    (and the block size) for a small model: the hash structure, hence the prefix sharing, is kept."""
    if block_tokens < 1 or not 0 < scale <= 1:
        raise ValueError(f"block_tokens must be >= 1 and scale in (0, 1], got {block_tokens}, {scale}")
    block = max(1, round(block_tokens * scale))
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and number > limit:
                return
            if len(line) > MAX_TRACE_LINE_BYTES:
                raise ValueError(f"{path}:{number}: line longer than {MAX_TRACE_LINE_BYTES} bytes")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                arrival_s = float(record["timestamp"]) / 1000  # milliseconds since the first request
                input_length, output_length = int(record["input_length"]), int(record["output_length"])
                hash_ids = [int(h) for h in record["hash_ids"]]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: not a Mooncake trace record: {e!r}") from None
            if not 0 < input_length <= MAX_TRACE_TOKENS or not 0 <= output_length <= MAX_TRACE_TOKENS:
                raise ValueError(f"{path}:{number}: lengths must be in [1, {MAX_TRACE_TOKENS}]")
            if len(hash_ids) != math.ceil(input_length / block_tokens):
                raise ValueError(f"{path}:{number}: {len(hash_ids)} hash ids for {input_length} tokens")
            length = max(1, round(input_length * scale))
            words: list[str] = []
            for hash_id in hash_ids:
                words.extend(_words(random.Random(hash_id), vocabulary, block))
            yield TraceRequest(arrival_s, tuple(words[:length]), max(1, round(output_length * scale)))


def to_mooncake_lines(conversations: Sequence[Conversation], *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[str]:
    """The generated workload as Mooncake trace lines (one per turn, hash ids numbered in order of first use; answers
    counted at their requested length), so that other tools can replay the same prefix structure."""
    ids: dict[tuple[str, ...], int] = {}
    lines = []
    for conversation in conversations:
        context: list[str] = list(conversation.system_words)
        for turn in conversation.turns:
            context.extend(turn.user_words)
            hashes = []
            for start in range(0, len(context), block_tokens):
                key = tuple(context[: start + block_tokens])
                hashes.append(ids.setdefault(key, len(ids)))
            record = {"timestamp": 0, "input_length": len(context), "output_length": turn.answer_tokens}
            lines.append(json.dumps({**record, "hash_ids": hashes}))
            context.extend(["<answer>"] * turn.answer_tokens)
    return lines
