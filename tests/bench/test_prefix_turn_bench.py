"""The prefix-turn engine benchmark's CPU dry run (what the GPU run executes, on a tiny model): the next turn reuses
the cached history's whole pages and gives the full prefill's output, and the report names both targets."""

from __future__ import annotations

import json

from benchmarks.engine import prefix_turn


def test_dry_run_reuses_the_history_and_reports_the_targets(tmp_path, capsys) -> None:
    argv = ["--shape", "tiny", "--layers", "2", "--device", "cpu", "--history_tokens", "100", "--new_tokens", "12",
            "--decode_sessions", "2", "--steps", "2", "--rounds", "1", "--repeats", "1", "--kv_pool_gib", "1",
            "--out", str(tmp_path)]  # fmt: skip
    assert prefix_turn.main(argv) == 0
    record = json.loads((tmp_path / "prefix_turn.json").read_text())
    assert record["hit_tokens"] == 96  # the history's six whole 16-token pages; the rest is computed
    assert record["last_output_max_abs_diff"] < 1e-4
    report = capsys.readouterr().out
    assert "target <= 0.1x" in report and "target within 3%" in report
    assert (tmp_path / "prefix_turn.md").read_text().count("\n|---|---|---|\n") == 2  # two tables
