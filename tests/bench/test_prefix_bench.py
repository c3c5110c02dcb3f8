"""The prefix benchmark, bounded: a few interleaved multi-turn conversations with shared system prompts through
corolla-api on a loopback chain of two CPU servers (a tiny random model), prefix reuse off and on, request by request
in turn: no errors, identical greedy answers (but for float-rounding near ties, reported), at least 40% of the
prompt tokens taken from the servers' caches. The servers run in this process (the benchmark's own chain is two
server processes: what they serve is the same code, and their start-up is most of this test's cost)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from benchmarks.prefix.checkpoint import ModelShape
from benchmarks.prefix.run import run
from benchmarks.prefix.workload import WorkloadConfig
from helpers.swarm import inprocess_servers, start_inprocess_server

pytestmark = pytest.mark.timeout(300)

TINY = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_words=300)
WORKLOAD = WorkloadConfig(
    num_conversations=5,
    turns_per_conversation=3.0,
    prompt_tokens=24,
    response_tokens=16,
    system_prompt_tokens=64,
    num_system_prompts=2,
    max_turns=4,
    seed=3,
)


@contextlib.contextmanager
def inprocess_chain(path: Path, server_args: Sequence[str]) -> Iterator[Sequence[str]]:
    """Blocks 0:1 and 1:2 on two servers in this process, float32 (as the benchmark's flags ask)."""
    assert tuple(server_args) == ("--torch_dtype", "float32"), server_args
    cache_dir = path.parent / "cache"
    first = start_inprocess_server(path, cache_dir, block_indices=(0, 1), throughput=1.0, torch_dtype="float32")
    try:
        with inprocess_servers([(path, "1:2")], cache_dir, first.join_maddrs):
            yield first.join_maddrs
    finally:
        first.shutdown()


def test_multi_turn_replay_saves_prefill_with_identical_answers(tmp_path):
    report = run(tmp_path, workload=WORKLOAD, shape=TINY, start_chain=inprocess_chain)
    summary = report.summary()
    assert report.off.errors == report.on.errors == 0, summary
    # identical greedy answers, except where the greedy choice was a float-rounding near tie (then that conversation
    # goes on from another token): each such divergence is named with its margin
    assert report.unexplained_mismatches == 0, report.notes
    assert report.mismatched_answers <= report.num_turns // 4, report.notes
    assert report.off.cached_tokens == 0  # the off pass sends no keys: nothing reused, nothing left behind
    assert report.on.saved_fraction >= 0.4, summary
    assert report.num_turns > report.num_conversations  # several turns each: answers are re-sent and reused
    assert report.on.request_hit_rate > 0.5, summary
