"""`python -m benchmarks.two_gpu`'s exact code path on the CPU (`--cpu_dry_run`): a random 80-layer checkpoint (tiny
dims, spread over two directories), the transformers baseline, a loopback DHT with two corolla servers (blocks 0-39
and 40-79, fast path) and corolla's client generating through both. Slow (~4 min on a loaded 2-core host: six
interpreters import torch); the fast checks of its pieces are in tests/unit/test_random_checkpoint.py."""

from __future__ import annotations

import json

import pytest

from benchmarks.two_gpu import run as two_gpu
from benchmarks.two_gpu.phases import GenerationPlan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_cpu_dry_run_matches_transformers_through_two_servers(tmp_path):
    plan = GenerationPlan(prompt_tokens=8, new_tokens=10, warmup_tokens=2, sessions=(1, 3), concurrent_new_tokens=4)
    config = two_gpu.TwoGpuConfig(
        workdir=tmp_path / "work",
        out_dir=tmp_path / "out",
        checkpoint_dirs=(tmp_path / "a", tmp_path / "b"),
        dtype="float32",
        budget_s=800,
        cpu_dry_run=True,
        plan=plan,
    )
    results = two_gpu.run(config)
    phases = results.data["phases"]
    assert not [name for name, phase in phases.items() if "error" in phase], phases
    assert phases["plan"]["layers"] == 80 and phases["checkpoint"]["num_shards"] == 82
    servers = phases["servers"]["servers"]
    assert [s["serving_path"] for s in servers] == ["fused", "fused"]
    assert [s["engine_layers"] for s in servers] == [40, 40]
    hf, corolla = phases["hf"], phases["corolla"]
    assert hf["device_map"] == {"cpu": 1} and not hf["offloaded_to"]
    assert corolla["first_token_logits_vs_hf"]["argmax_equal"]  # float32 on both sides
    assert corolla["first_token_logits_vs_hf"]["rel_l2_err"] < 1e-4
    assert corolla["tokens_equal_hf"] and len(corolla["tokens"]) == plan.new_tokens
    for side in (hf, corolla):
        assert side["batch1"]["timed_tokens"] == plan.new_tokens - 1 - plan.warmup_tokens
        assert side["batch1"]["ms_per_token_median"] > 0
    rows = corolla["concurrency"]
    assert [r["sessions"] for r in rows] == [1, 3]
    assert all(r["sessions_finished"] == r["sessions"] and not r["errors"] for r in rows)
    assert all(r["aggregate_tokens_per_s"] > 0 for r in rows)
    written = json.loads(results.stem.with_suffix(".json").read_text())
    assert written["phases"].keys() == phases.keys()
    assert "| corolla: 2 servers" in results.stem.with_suffix(".md").read_text()
    logs = results.stem.with_suffix(".log").read_text()
    assert all(f"===== {name}.log" in logs for name in ("checkpoint", "hf", "server0", "server1", "client"))
