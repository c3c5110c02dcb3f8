"""The bounded field soak (issue 37 item 4, the part that runs in the suite): the churn soak's loopback swarm
(2 spans x 2 replicas of the demo model, servers SIGKILLed, SIGTERMed and restarted at random) with small caches,
while a hostile process with 2 identities keeps every server's cache full of sessions held by zero-token steps and
two clients generate greedily: 0 failed and 0 differing generations, nothing left behind, and the hoarders did hold
sessions that the servers ended for the clients. `make soak-field` runs the long one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.soak.churn import ChurnConfig, run_churn

CI_DURATION_S = float(os.environ.get("COROLLA_FIELD_SOAK_DURATION_S", "40"))


@pytest.mark.timeout(CI_DURATION_S + 400)
def test_field_soak_with_hoarders_loses_nothing(tmp_path: Path) -> None:
    config = ChurnConfig(
        duration_s=CI_DURATION_S, seed=3, work_dir=tmp_path, outage_probability=0.0, force_outage=False,
        probe_abandoned_client=False, hoarders=2, hoarder_max_length=512,
        server_args=("--busy_poll_ms", "0", "--attn_cache_tokens", "1024"),
    )  # fmt: skip
    report = run_churn(config)
    (tmp_path / "report.json").write_text(json.dumps(report.to_dict(), indent=2))
    print(report.summary())
    details = "\n".join([*report.failures, *report.differences, *report.client_problems, *report.leaked])
    details += "\n" + "\n".join(report.chaos.events) + f"\nlogs: {report.log_dir}"
    assert report.failed == 0 and report.differing == 0, details
    assert not report.client_problems and report.chaos.crashes == 0, details
    assert not report.leaked and not report.orphans, details
    assert report.chaos.kills + report.chaos.terms >= 2, details
    assert report.generations >= 5 * config.num_clients, details
    # the hoarders held sessions, and the servers ended them for the clients
    assert report.hoarding.get("opened", 0) > 0 and report.hoarding.get("ended", 0) > 0, (report.hoarding, details)
    assert report.ok
