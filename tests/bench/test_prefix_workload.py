"""The prefix benchmark's workload: the generator follows its published averages (LMSYS-Chat-1M) and shares its
system prompts; the Mooncake trace reader turns equal hash ids into equal prompt blocks and refuses malformed
lines; a generated workload written as a Mooncake trace reads back with the same prefix sharing."""

from __future__ import annotations

import json
import statistics

import pytest

from benchmarks.prefix.workload import (
    LMSYS_PROMPT_TOKENS,
    LMSYS_RESPONSE_TOKENS,
    WorkloadConfig,
    generate_conversations,
    read_mooncake_trace,
    to_mooncake_lines,
)

VOCAB = [f"w{i}" for i in range(500)]


def test_generator_follows_the_published_averages():
    conversations = generate_conversations(WorkloadConfig(num_conversations=3000, max_turns=50, seed=1), VOCAB)
    turns = [t for c in conversations for t in c.turns]
    assert statistics.mean(len(c.turns) for c in conversations) == pytest.approx(2.0, rel=0.08)
    assert statistics.mean(len(t.user_words) for t in turns) == pytest.approx(LMSYS_PROMPT_TOKENS, rel=0.1)
    assert statistics.mean(t.answer_tokens for t in turns) == pytest.approx(LMSYS_RESPONSE_TOKENS, rel=0.1)
    assert len({c.system_words for c in conversations}) == 4  # shared system prompts
    assert generate_conversations(WorkloadConfig(seed=1), VOCAB) == generate_conversations(
        WorkloadConfig(seed=1), VOCAB
    )


def test_mooncake_trace_blocks_follow_hash_ids(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 20, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 17, "output_length": 3, "hash_ids": [0, 1, 3]},
        {"timestamp": 2000, "input_length": 8, "output_length": 3, "hash_ids": [4]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    a, b, c = read_mooncake_trace(path, VOCAB, block_tokens=8)
    assert len(a.prompt_words) == 20 and len(b.prompt_words) == 17 and b.arrival_s == 1.5
    assert a.prompt_words[:16] == b.prompt_words[:16] and a.prompt_words[16:17] != b.prompt_words[16:17]
    assert c.prompt_words[:8] != a.prompt_words[:8]
    half = list(read_mooncake_trace(path, VOCAB, block_tokens=8, scale=0.5))
    assert len(half[0].prompt_words) == 10 and half[0].prompt_words[:8] == half[1].prompt_words[:8]
    for bad in ('{"timestamp": 0}', '{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [0]}'):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match="trace.jsonl:1"):
            list(read_mooncake_trace(path, VOCAB, block_tokens=8))


def test_generated_workload_as_a_mooncake_trace(tmp_path):
    conversations = generate_conversations(WorkloadConfig(num_conversations=6, seed=2), VOCAB)
    path = tmp_path / "generated.jsonl"
    path.write_text("\n".join(to_mooncake_lines(conversations, block_tokens=64)) + "\n")
    requests = list(read_mooncake_trace(path, VOCAB, block_tokens=64))
    assert len(requests) == sum(len(c.turns) for c in conversations)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    first_blocks = {r["hash_ids"][0] for r in records}
    assert len(first_blocks) <= 4  # every conversation starts with one of the shared system prompts
