"""Many simulated clients judging servers by what they deliver (decisions 0189, 0195, 0196), through the product's
own judge (`client.session.delivery.judge`, `ObservedSteps`, `MovePacer`): in a small swarm with lorises (records
claiming 1e6 blocks/s, every decode step just under the 1 s deadline floor) most sessions that meet one leave it within
a minute, where under the announced figures alone (main before 0189) nearly all of them stay on it; honest servers
under heavy load are not moved back and forth (few moves a session, hardly any back to a server left), and judging
costs no throughput."""

from __future__ import annotations

import pytest

from benchmarks.sim.churn import ChurnConfig
from benchmarks.sim.metrics import Report
from benchmarks.sim.simulation import SimConfig, Simulation
from benchmarks.sim.workload import WorkloadConfig

TWO_REGIONS = {"us-east": 1.0, "europe": 1.0}


def _run(rule: str, *, lorises: float, clients: int, per_client: int, seed: int) -> Report:
    """12 servers in two regions (no churn), `clients` applications keeping `per_client` conversations open each,
    15 simulated minutes, the first 5 left out."""
    config = SimConfig(
        name="delivery-test",
        servers=12,
        duration_s=900.0,
        warmup_s=300.0,
        workload=WorkloadConfig(
            concurrent_clients=clients,
            sessions_per_client=per_client,
            mean_think_s=2.0,
            mean_idle_s=1.0,
            region_weights=TWO_REGIONS,
        ),
        fleet={"RTX-3090": 0.5, "A100-80GB": 0.25, "L4": 0.25},
        server_regions=TWO_REGIONS,
        churn=ChurnConfig(enabled=False),
        delivery_rule=rule,
        loris_fraction=lorises,
        seed=seed,
    )
    return Simulation(config).run()


@pytest.mark.parametrize("seed", [1, 2])
def test_lorises_lose_their_sessions_within_a_minute(seed: int) -> None:
    """20% lorises (3 and 1 of 12 at these seeds): under the announced figures nearly every session that meets one
    keeps it over a minute (62 of 64, 35 of 35); judged by delivery, at most 1 in 4 does (13 of 83, 10 of 48; 0189
    as first landed, before decisions 0193 and 0196: 29 of ~80 and 35 of 46), and the swarm serves 1.3x the tokens
    or more."""
    announced = _run("announced", lorises=0.2, clients=24, per_client=4, seed=seed)
    judged = _run("judged", lorises=0.2, clients=24, per_client=4, seed=seed)
    assert announced.delivery["lorises"] == judged.delivery["lorises"] > 0
    assert announced.delivery["on_loris"] > 20 and judged.delivery["on_loris"] > 20
    assert announced.delivery["stuck_on_loris"] >= 0.9 * announced.delivery["on_loris"]
    assert judged.delivery["stuck_on_loris"] <= 0.25 * judged.delivery["on_loris"], judged.delivery
    assert judged.decode_tps >= 1.3 * announced.decode_tps
    assert announced.delivery["moves"] == 0


def test_honest_loaded_servers_are_not_flapped() -> None:
    """Honest servers only, every block's KV cache mostly reserved (48 clients of 12 conversations): judged, a
    session moves under once on average, almost never back to a server it left, at most 15 moves a session-hour,
    and the swarm serves no fewer tokens than under the announced figures at a lower median time per token."""
    announced = _run("announced", lorises=0.0, clients=48, per_client=12, seed=1)
    judged = _run("judged", lorises=0.0, clients=48, per_client=12, seed=1)
    moves = judged.delivery["moves"]
    assert 0 < moves <= judged.sessions["started"]
    assert judged.delivery["moves_back"] <= 0.01 * moves
    assert judged.delivery["moves_per_session_hour"] <= 15.0
    assert judged.decode_tps >= announced.decode_tps
    assert judged.tpot_s["p50"] <= announced.tpot_s["p50"]
