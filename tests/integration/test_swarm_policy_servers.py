"""Real servers under `--swarm_policy corolla`: a server alone takes the first blocks; when a pinned server joins on
the same blocks, leaving the rest uncovered, the movable one moves there at its next balance check (no dwelling
while a block has no server), and the move shows in its log and metrics."""

from __future__ import annotations

import urllib.request

import pytest

from helpers.swarm import Swarm, swarm  # noqa: F401  (fixture)
from helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(240)


def test_corolla_server_places_and_moves_into_a_gap(swarm: Swarm, tmp_path):  # noqa: F811
    model = make_tiny_model("llama", tmp_path / "models", num_layers=4)
    swarm.start_bootstrap()
    policy = ("--swarm_policy", "corolla", "--throughput", "1", "--mean_balance_check_period", "1")
    a = swarm.start_server(model, "--num_blocks", "2", "--metrics_port", "0", *policy)
    assert (a.start_block, a.end_block) == (0, 2)
    assert any("server.placed(policy=corolla, blocks=0:2)" in line for line in a.lines)
    b = swarm.start_server(model, "--block_indices", "0:2", *policy)
    assert (b.start_block, b.end_block) == (0, 2)
    a.wait_ready(90, start=a.lines.index(a.ready_lines()[0]) + 1)
    assert (a.start_block, a.end_block) == (2, 4), a.tail()
    assert any("server.balance_check(policy=corolla, move=True" in line for line in a.lines)
    url = next(line.split("metrics at ")[1].strip() for line in a.lines if "corolla-server: metrics at " in line)
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    assert "corolla_moves_total 1.0" in text and "corolla_span_loads_total 2.0" in text
