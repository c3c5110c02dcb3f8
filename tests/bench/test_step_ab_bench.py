"""The step A/B's CPU dry run (what the GPU run executes, on 2 tiny layers): a swapped function runs in the step
(a copy of the module function gives the tree's outputs bit for bit, a perturbed one is reported unequal), the
originals are back after the run, and a malformed swap is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.engine import step_ab
from corolla.engine.ops import decode_ops

TARGET = "corolla.engine.ops.decode_ops:paged_decode_attention_cpu"
PERTURBED = """
from corolla.engine.ops.decode_ops import paged_decode_attention_cpu as original


def paged_decode_attention_cpu(*args, **kwargs):
    return original(*args, **kwargs) * 1.5
"""


def test_swaps_run_in_the_step_and_are_put_back(tmp_path: Path) -> None:
    same = tmp_path / "same.py"
    same.write_text(Path(decode_ops.__file__).read_text())
    perturbed = tmp_path / "perturbed.py"
    perturbed.write_text(PERTURBED)
    original = decode_ops.paged_decode_attention_cpu
    argv = ["--device", "cpu", "--rounds", "2", "--out", str(tmp_path / "out"),
            "--swap", f"same={TARGET}={same}", f"scaled={TARGET}={perturbed}"]  # fmt: skip
    assert step_ab.main(argv) == 0
    assert decode_ops.paged_decode_attention_cpu is original
    record = json.loads((tmp_path / "out" / "step_ab-nf4-1.json").read_text())
    assert [r["variant"] for r in record["rounds"]] == ["tree", "same", "scaled"] * 2
    summary = record["summary"]
    assert summary["tree"]["equal"] and summary["same"]["equal"] and not summary["scaled"]["equal"]
    assert all(summary[v]["step_ms"] > 0 for v in summary)


@pytest.mark.parametrize("text", ["x=mod:fn", "tree=mod:fn=f.py", "x=mod=f.py", "=mod:fn=f.py"])
def test_a_malformed_swap_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="LABEL=MODULE:FUNCTION=FILE"):
        step_ab.Swap.parse(text)
