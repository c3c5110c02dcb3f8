"""`python -m corolla.cli.finetune_demo` (what `make finetune-demo` runs), bounded: 30 prompt-tuning steps through its
own loopback swarm (one server: a span split over two servers is tests/integration/test_training_families.py's) take
the held-out topic accuracy from chance to >= 90% with the training loss falling (100% at step 30 in a 2-server run,
95.8% at 25), the figures land in the JSON it writes, and its swarm stops with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from corolla.demo.checkpoint import DEMO_CHECKPOINT_DIR, is_complete

RUN_TIMEOUT_S = 480.0
STEPS = 30

pytestmark = [
    pytest.mark.timeout(RUN_TIMEOUT_S + 60),
    pytest.mark.skipif(not is_complete(DEMO_CHECKPOINT_DIR), reason="demo checkpoint is not built"),
]


def test_prompt_tuning_through_the_demo_swarm_reaches_90_percent(tmp_path: Path):
    figures = tmp_path / "figures.json"
    result = subprocess.run(
        [sys.executable, "-m", "corolla.cli.finetune_demo", "--num_steps", str(STEPS), "--eval_every_steps", str(STEPS),
         "--num_servers", "1",
         "--json_out", str(figures)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(figures.read_text())
    (start, before), (steps, after) = report["evals"]
    assert (start, steps) == (0, STEPS) and len(report["losses"]) == STEPS
    assert before < 0.5 and after >= 0.9, report["evals"]  # four topics: chance is 25%
    losses = report["losses"]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])
    assert "held-out accuracy" in result.stdout and f"Done: {STEPS} steps" in result.stdout
