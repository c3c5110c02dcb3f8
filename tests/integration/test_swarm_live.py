"""The live check of the swarm policies, bounded: 8 corolla servers of three speeds and memory sizes in three regions
behind WAN proxies, 32 concurrent clients, Petals' placement and routing against corolla's on the same servers and
clients in one run (`benchmarks.swarm_live`, whose full run gives the figures in benchmarks/RESULTS.md). Timing-bound
and CPU-hungry: runs alone."""

from __future__ import annotations

import pytest

from benchmarks.swarm_live.live import LiveConfig, default_servers, run_live

# slow: a bounded run of a benchmark program (133 s alone on the 2-core VM, half the serial part): `make test-full`;
# the policies it runs are tested in tests/unit and in simulation in `make test`
pytestmark = [pytest.mark.serial, pytest.mark.slow, pytest.mark.timeout(900)]


def test_corolla_policies_beat_petals_on_a_live_swarm(tmp_path):
    config = LiveConfig(
        servers=default_servers()[:8], num_clients=32, rounds=2, warmup_s=4.0, measure_s=8.0,
        phases=(("petals", "petals"), ("corolla", "corolla")),
    )  # fmt: skip
    result = run_live(config, tmp_path)
    petals, corolla = result["phases"]["petals/petals"], result["phases"]["corolla/corolla"]
    assert petals["tokens"] > 0 and corolla["tokens"] > 0, result
    assert corolla["errors"] == 0, result
    # Petals' routing sends every client of the same view down one chain; corolla's spreads them by load
    assert len(corolla["sessions_by_server"]) > len(petals["sessions_by_server"]), result
    # the benchmark's target is 1.3x; two short windows on a shared CPU are noisier, so the suite asks for 1.15x
    assert corolla["tok_s"] >= 1.15 * petals["tok_s"], result
