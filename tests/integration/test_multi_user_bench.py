"""The multi-user benchmark's CPU mode as a smoke test: one real server (fast path on the CPU), sessions driven
from two separate client processes over p2p; every session finishes, steps of different sessions merge into one
forward, and the figures are in a sane (loose) range."""

from __future__ import annotations

import math

import pytest
import torch

from corolla.bench import multi_user as mu
from corolla.bench.model import ModelShape

SHAPE = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


def test_sessions_are_spread_over_processes_without_empty_ones():
    assert mu.UsersConfig(sessions=16, client_processes=4, transport="p2p").split() == [4, 4, 4, 4]
    assert mu.UsersConfig(sessions=5, client_processes=4, transport="p2p").split() == [2, 1, 1, 1]
    assert mu.UsersConfig(sessions=1, client_processes=4, transport="socket").split() == [1]
    with pytest.raises(ValueError, match="transport"):
        mu.UsersConfig(sessions=1, client_processes=1, transport="tcp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decode_steps"):
        mu.UsersConfig(sessions=1, client_processes=1, transport="p2p", decode_steps=3, warmup_steps=3)


def test_lost_sessions_and_client_errors_are_reported():
    config = mu.UsersConfig(sessions=3, client_processes=2, transport="p2p", decode_steps=8)
    collected = [
        {"errors": [], "latencies": [[1.0, 2.0], [3.0, 4.0]], "finished": 2, "windows": [(10.0, 11.0), (10.0, 12.0)]},
        {"errors": ["client process failed: TimeoutError()"], "latencies": [], "finished": 0},
    ]
    result = mu._summarize(config, "fast", collected, {}, {}, 10.0, 12.0)
    assert result.sessions_finished == 2 and result.errors == ["client process failed: TimeoutError()"]
    assert result.aggregate_tokens_per_s == pytest.approx(2 * 8 / 2.0)
    assert result.step_worst_ms == 4.0 and result.worst_session_median_ms == 3.5
    assert result.steps_per_merged_forward == 0.0  # no runtime batches seen


def test_many_sessions_through_one_server_from_two_processes():
    executor = mu.build_executor(
        SHAPE,
        torch.float32,
        torch.device("cpu"),
        num_layers=SHAPE.num_layers,
        serving_path="fast",
        cache_bytes=32 << 20,
    )
    server = mu.BenchServer(
        executor,
        hidden_size=SHAPE.hidden_size,
        num_layers=SHAPE.num_layers,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    config = mu.UsersConfig(
        sessions=6, client_processes=2, transport="p2p", prefix_tokens=4, decode_steps=8, start_timeout_s=120
    )
    with server.running():
        result = mu.run_users(server, config, "fast")
    assert result.errors == [] and result.sessions_finished == 6
    assert result.client_processes == 2
    assert result.steps_per_merged_forward > 1.0  # steps of several sessions ran as one forward
    assert 0.0 < result.device_busy_share <= 1.0
    assert math.isfinite(result.step_median_ms) and result.step_median_ms < 20_000
    assert result.aggregate_tokens_per_s > 0.5
