"""The simulator's inputs: the roofline catalogue, churn's heavy tail, RTTs, and the workload generator and trace."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from benchmarks.sim.catalogue import GPUS, LLAMA2_70B, STEP_OVERHEAD_S, ServerPerf
from benchmarks.sim.churn import ChurnConfig
from benchmarks.sim.metrics import Metrics, Report
from benchmarks.sim.regions import RttModel, base_rtt_s
from benchmarks.sim.server_model import SimServer
from benchmarks.sim.workload import WorkloadConfig, WorkloadGenerator, read_trace


def test_decode_is_weights_over_bandwidth_at_one_row() -> None:
    perf = ServerPerf(GPUS["A100-40GB"], LLAMA2_70B, "fp16")
    block_bytes = LLAMA2_70B.params_per_block * 2
    assert 855e6 < LLAMA2_70B.params_per_block < 857e6  # LLaMA-2-70B: ~68.5B params in 80 blocks
    assert perf.decode_block_s(1, 0) == pytest.approx(block_bytes / (1.555e12 * 0.6))
    assert perf.decode_block_s(64, 64_000) > perf.decode_block_s(1, 0)  # KV reads grow with the batch's context
    # prefill of a long prompt is compute-bound: 2 FLOPs per parameter per token at half the dense peak
    compute_s = 2 * LLAMA2_70B.params_per_block * 2048 / (312e12 * 0.5)
    assert perf.prefill_s(1, 2048) == pytest.approx(compute_s + STEP_OVERHEAD_S)


def test_capacity_falls_with_blocks_held_and_memory_bounds_blocks() -> None:
    perf = ServerPerf(GPUS["L4"], LLAMA2_70B, "fp16")
    caps = [perf.capacity_tps(k, 990) for k in range(1, perf.max_blocks(990) + 1)]
    assert caps == sorted(caps, reverse=True) and caps[-1] > 0
    assert perf.max_blocks(990) <= 12  # 24 GB of fp16 blocks of 1.7 GB
    assert perf.capacity_tps(perf.max_blocks(990) + 1, 990) == 0.0
    # Petals' worked example: a 70B block in bf16 reserves 64 MiB of cache beside 1.7 GB of weights
    assert ServerPerf(GPUS["A100-80GB"], LLAMA2_70B, "fp16").petals_max_blocks() == 44


def test_a_step_batches_the_rows_waiting_not_every_session_held() -> None:
    # 64 sessions of 1,000 tokens on an RTX 3060's 10 blocks (compute-bound above ~25 rows)
    perf = ServerPerf(GPUS["RTX-3060"], LLAMA2_70B, "nf4")
    server = SimServer("s", "europe", perf, 20, joined_s=0.0, start=0, end=10, rows=64, context_tokens=64_000)
    saturated_s = perf.decode_step_s(10, 64, 64_000)
    # their tokens come back rarely (one each 8 s): a token meets a row or two, and the server is mostly idle
    server.visit_rate = 8.0
    rows, step_s, busy = server.batch(own_rate=0.125)
    assert 1.0 < rows < 2.0 and step_s < 0.5 * saturated_s and busy < 0.3
    assert server.hop_s(10, own_rate=0.125) < 0.5 * (1.5 * saturated_s)
    # they come back as fast as it steps: every session in every step (the saturated server)
    server.visit_rate = 64.0 / saturated_s * 2
    rows, step_s, busy = server.batch()
    assert rows == 64.0 and step_s == pytest.approx(saturated_s) and busy == 1.0
    wire_s = LLAMA2_70B.hidden_bytes_per_token * 8 / GPUS["RTX-3060"].nic_bits_per_s
    assert server.hop_s(10) == pytest.approx(1.5 * (saturated_s - STEP_OVERHEAD_S) + STEP_OVERHEAD_S + wire_s)
    # a lone session never waits for itself
    lone = SimServer("t", "europe", perf, 20, joined_s=0.0, start=0, end=10, rows=1, context_tokens=1000)
    lone.visit_rate = 100.0
    assert lone.batch(own_rate=100.0)[2] == 0.0


def test_a_session_reserves_kv_on_the_blocks_its_hop_uses_only() -> None:
    """As a real server allocates KV for the blocks a request names (not its whole span): on corolla's (pages per
    layer) a session over blocks 0..5 of a 0..10 span leaves 5..10 free for another session of the whole capacity;
    Petals' pools its bytes over the span (decision 0036)."""
    server = SimServer("s", "europe", ServerPerf(GPUS["L4"], LLAMA2_70B, "nf4"), 20, joined_s=0.0, start=0, end=10)
    capacity = server.kv_capacity_tokens
    assert capacity > 0 and server.cache_tokens_left == 2 * 10 * capacity
    server.reserve(0, 5, capacity)
    assert server.kv_free_tokens(0, 10) == 0 and server.kv_free_tokens(0, 1) == 0
    assert server.kv_free_tokens(5, 10) == capacity
    # it announces the room a session over its whole span gets (none: blocks 0..5 are full)
    assert server.cache_tokens_left == 0 and server.kv_reserved_token_blocks == 5 * capacity
    server.reserve(0, 5, -capacity)
    assert not server.kv_reserved and server.cache_tokens_left == 2 * 10 * capacity
    # Petals' server pools its cache bytes: a request over 5 blocks may take the whole span's share
    pooled = SimServer("p", "europe", server.perf, 20, joined_s=0.0, start=0, end=10, pooled_kv=True)
    assert pooled.kv_free_tokens(0, 5) == 2 * capacity
    pooled.reserve(0, 5, 2 * capacity)
    assert pooled.kv_free_tokens(5, 10) == 0 and pooled.cache_tokens_left == 0


def test_churn_is_heavy_tailed_with_the_median_and_mean_asked_for() -> None:
    churn, rng = ChurnConfig(median_session_s=7200.0, mean_session_s=36000.0), random.Random(1)
    draws = [churn.session_s(rng) for _ in range(40_000)]
    assert statistics.median(draws) == pytest.approx(7200.0, rel=0.05)
    assert statistics.fmean(draws) == pytest.approx(36000.0, rel=0.25)
    assert churn.leaving_per_hour() == pytest.approx(0.1)
    with pytest.raises(ValueError):
        ChurnConfig(median_session_s=10.0, mean_session_s=5.0)


def test_rtts_are_symmetric_reproducible_and_in_published_ranges() -> None:
    rtt = RttModel(seed=3)
    a = rtt.rtt_s("s1", "europe", "s2", "australia")
    assert (
        a == rtt.rtt_s("s2", "australia", "s1", "europe") == RttModel(seed=3).rtt_s("s1", "europe", "s2", "australia")
    )
    assert 0.19 <= a <= 0.35
    assert 0.002 <= rtt.rtt_s("s1", "us-east", "s3", "us-east") <= 0.020
    assert 0.035 <= base_rtt_s("us-east", "us-west") <= 0.130
    with pytest.raises(ValueError):
        base_rtt_s("us-east", "mars")


def test_generated_conversations_follow_the_published_averages() -> None:
    config = WorkloadConfig(sessions_per_hour=36_000.0)
    conversations = WorkloadGenerator(config, random.Random(0)).open_arrivals(600.0)
    assert len(conversations) == pytest.approx(6000, rel=0.05)
    turns = [t for c in conversations for t in c.turns]
    assert statistics.fmean(len(c.turns) for c in conversations) == pytest.approx(2.0, rel=0.1)
    assert statistics.fmean(p for p, _ in turns) == pytest.approx(69.5, rel=0.1)
    assert statistics.fmean(o for _, o in turns) == pytest.approx(214.5, rel=0.1)
    assert all(c.total_tokens <= config.max_context_tokens for c in conversations)


def test_trace_round_trip_and_hostile_lines(tmp_path: Path) -> None:
    good = tmp_path / "trace.jsonl"
    good.write_text(
        json.dumps({"arrival_s": 5.0, "region": "asia", "turns": [[10, 20]]})
        + "\n"
        + json.dumps({"arrival_s": 1, "region": "europe", "turns": [[3, 4], [5, 6]]})
        + "\n"
    )
    conversations = read_trace(good)
    assert [c.arrival_s for c in conversations] == [1.0, 5.0] and conversations[0].turns == ((3, 4), (5, 6))
    for bad in ({"arrival_s": -1, "region": "asia", "turns": [[1, 1]]}, {"arrival_s": 0, "region": "x", "turns": []},
                {"arrival_s": 0, "region": "asia", "turns": [[1, True]]},
                {"arrival_s": 0, "region": "asia", "turns": [[5000, 1]]}):  # fmt: skip
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError):
            read_trace(path)


def test_report_weights_tpot_by_tokens_and_skips_the_warm_up() -> None:
    metrics = Metrics(measure_from_s=100.0, interval_s=60.0)
    metrics.add_tokens(50.0, 1000, 9.0)  # during the warm-up: not counted
    metrics.add_tokens(150.0, 90, 0.1)
    metrics.add_tokens(200.0, 10, 2.0)
    metrics.add_ttft(120.0, 30.0)  # its turn began in the warm-up
    metrics.add_ttft(160.0, 0.5)
    report = Report.build(metrics, scenario="t", policy="p", seed=0, servers_start=1, duration_s=200.0, wall_s=1.0,
                          cpu_s=1.0, events=1)  # fmt: skip
    assert report.decode_tps == pytest.approx(100 / 100.0)
    assert report.tpot_s["p50"] == 0.1 and report.tpot_s["p99"] == 2.0  # 90% of the tokens came at 0.1 s
    assert report.ttft_s["p50"] == 0.5
    assert json.loads(report.to_json())["sessions"]["started"] == 0
