"""`python -m benchmarks.sim`: the Helix reproduction prints its figures, and a run writes one JSON report per policy."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.sim.__main__ import main


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    yield
    logging.disable(logging.NOTSET)  # the CLI quiets INFO logs process-wide unless -v


def test_helix_prints_the_reproduction(capsys: pytest.CaptureFixture[str]) -> None:
    main(["helix", "--time_limit_s", "0"])
    figures = json.loads(capsys.readouterr().out)
    assert figures["petals_layout_tps"] == pytest.approx(531.7, rel=0.10)
    assert figures["best_known_tps"] >= figures["helix_ilp_layout_tps"] > figures["petals_layout_tps"]


def test_run_compares_policies_on_one_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "reports.json"
    main(["run", "--scenario", "tiny", "--duration_s", "900", "--clients", "2", "--sessions_per_client", "2",
          "--policy", "petals", "corolla", "--json", str(out)])  # fmt: skip
    reports = json.loads(out.read_text())
    assert [r["policy"] for r in reports] == ["petals", "corolla"]
    assert all(r["seed"] == 0 and r["duration_s"] == 900.0 for r in reports)
    assert "decode_tok_s" in capsys.readouterr().out


def test_unknown_scenario_is_refused() -> None:
    with pytest.raises(SystemExit):
        main(["run", "--scenario", "nope"])
