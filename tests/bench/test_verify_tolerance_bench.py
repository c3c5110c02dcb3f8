"""`benchmarks.field.verify_tolerance --tiny`: an honest server's merged decode steps against a replica's one forward
over each stretch, bf16 and NF4 weights, on the CPU: every position compared, nobody banned (the bench's GPU run is
the figure; this keeps it running)."""

import json
from pathlib import Path

from benchmarks.field import verify_tolerance


def test_every_position_is_compared_and_an_honest_server_is_not_banned(tmp_path: Path) -> None:
    argv = ["--tiny", "--layers", "1", "--sessions", "3", "--prompt", "4", "--steps", "5", "--out", str(tmp_path)]
    assert verify_tolerance.main(argv) == 0
    results = json.loads((tmp_path / "verify_tolerance.json").read_text())
    assert [r["weights"] for r in results] == ["bf16", "nf4"]
    for result in results:
        assert result["positions_compared"] == 3 * 5
        assert 0 < result["max_error"] < result["tolerance"] and not result["honest_server_banned"]
