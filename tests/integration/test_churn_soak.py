"""The churn soak in CI, also the bounded field soak (issues 11 and 37): a loopback swarm of the demo model (2 spans x
2 replicas) with small caches, two client processes generating greedily (one over the same-host socket, one over
p2p), servers SIGKILLed, SIGTERMed and restarted at random (seeded; at least one outage of a whole span), while a
hostile process with 2 identities keeps every server's cache full of sessions held by zero-token steps, every
server's p2p link stalls, drops and is partitioned in turn (`benchmarks.wan_emulator` proxies) and one extra server of the first
span returns finite garbage for a fifth of its answers (the clients verify every step): 0 failed and 0 differing
generations, nothing left behind or orphaned, the servers ended the hoarders' sessions for the clients, and the
liar's lies were caught. `make soak` and `make soak-field` run the long versions. Also checks that the soak's own checks can fail: a planted
orphan is found, a wrong or failed generation and a client that never finished are counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.soak.churn import ChurnConfig, ChurnReport, collect_results, run_churn
from benchmarks.soak.leftovers import RUN_MARKER_ENV, find_leftovers, kill_all, orphans_among
from benchmarks.soak.worker import DONE_LINE, GenerationResult

CI_DURATION_S = float(os.environ.get("COROLLA_CHURN_DURATION_S", "50"))
CI_SEED = int(os.environ.get("COROLLA_CHURN_SEED", "0"))


@pytest.mark.timeout(CI_DURATION_S + 400)
def test_churn_soak_loses_nothing(tmp_path: Path) -> None:
    # exactly one outage of a whole span (forced after a third): each costs a restart (15-45 s on 2 busy cores); the
    # abandoned client's bounded wait is shorter than make soak's (the same check, less idle time at the end). Chaos
    # acts every 10-16 s (not 3-8): every step is verified, so a span left with one server waits for a second one
    # (`client.verification.step_verifier`), and each kill of one of two replicas leaves one until its restart is ready
    config = ChurnConfig(
        duration_s=CI_DURATION_S, seed=CI_SEED, work_dir=tmp_path, outage_probability=0.0, force_outage=True,
        probe_max_wait_s=10.0, hoarders=2, hoarder_max_length=512,
        server_args=("--busy_poll_ms", "0", "--attn_cache_tokens", "1024"),
        wan_faults=True, wan_stall_s=3.0, wan_drop_s=6.0, wan_partition_s=8.0, wan_min_interval_s=6.0,
        wan_max_interval_s=10.0, liar_rate=0.2, chaos_min_interval_s=10.0, chaos_max_interval_s=16.0,
    )  # fmt: skip
    report = run_churn(config)
    (tmp_path / "report.json").write_text(json.dumps(report.to_dict(), indent=2))
    print(report.summary())
    details = "\n".join([*report.failures, *report.differences, *report.client_problems, *report.leaked])
    details += "\n" + "\n".join(report.chaos.events) + f"\nlogs: {report.log_dir}"
    assert report.failed == 0 and report.differing == 0, details
    assert not report.client_problems and report.chaos.crashes == 0, details
    assert not report.leaked and not report.orphans and report.chaos.kill_leftovers == 0, details
    # the churn really happened, and the clients made progress through it
    assert report.chaos.kills + report.chaos.terms >= 3 and report.chaos.restarts >= 2, details
    assert report.chaos.outages >= 1, details
    # each client finished generations through it; how many depends on restart times (a span left with one new
    # server waits for a second: 30-130 s per restart on 2 busy cores), so the count only has to show progress
    assert report.generations >= config.num_clients, details
    assert all(count > 0 for count in report.per_client.values()), details
    # a client whose swarm vanished mid-generation ended by itself, with an error, within its bounded wait
    assert report.probe_exit_s is not None and report.probe_exit_s < config.probe_max_wait_s + 30, details
    assert "NoHonestServer" in report.probe_result or "Error" in report.probe_result, report.probe_result
    # the hoarders held sessions, and the servers ended them for the clients
    assert report.hoarding.get("opened", 0) > 0 and report.hoarding.get("ended", 0) > 0, (report.hoarding, details)
    # every kind of link fault happened; the liar served among the others without a wrong token (differing == 0
    # above). How many of its lies a client rejects is not bounded here: in 50 s it may serve no client step (its
    # span restarted or partitioned, or it lied only as a referee: 0 in one full run); the catch itself is asserted
    # by test_client_hostile_servers and test_client_distrust.
    wan = report.wan
    assert wan.stalls >= 1 and wan.drops >= 1 and wan.partitions >= 1, (wan, details)
    assert report.ok


def test_leftover_scan_finds_an_orphan_and_the_run_processes() -> None:
    """A marked grandchild whose parent exits is an orphan; a marked child of ours is left behind, not orphaned."""
    run_id = uuid.uuid4().hex
    env = {**os.environ, RUN_MARKER_ENV: run_id}
    sleeper = [sys.executable, "-c", "import corolla.utils, time; time.sleep(60)"]
    spawn_and_leave = f"import subprocess; print(subprocess.Popen({sleeper!r}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid, flush=True)"
    orphan_pid = int(subprocess.run([sys.executable, "-c", spawn_and_leave], env=env, capture_output=True,
                                    text=True, timeout=30, check=True).stdout)  # fmt: skip
    child = subprocess.Popen(sleeper, env=env)
    try:
        deadline = time.monotonic() + 10
        leaked, _ = find_leftovers(run_id)
        while {orphan_pid, child.pid} - {info.pid for info in leaked} and time.monotonic() < deadline:
            time.sleep(0.1)
            leaked, _ = find_leftovers(run_id)
        assert {orphan_pid, child.pid} <= {info.pid for info in leaked}
        assert [info.pid for info in orphans_among(leaked)] == [orphan_pid]
    finally:
        kill_all(find_leftovers(run_id)[0])
        child.wait(10)
    deadline = time.monotonic() + 10
    while find_leftovers(run_id)[0] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert find_leftovers(run_id)[0] == []


def _client(name: str, results: list[GenerationResult], *, done: bool = True) -> SimpleNamespace:
    lines = ["some log line", *(r.to_line() for r in results), *([DONE_LINE] if done else [])]
    return SimpleNamespace(
        name=name, output="\n".join(lines), proc=SimpleNamespace(returncode=0 if done else -9), log_path=None
    )


def test_collect_counts_wrong_failed_and_unfinished_generations() -> None:
    reference = [[5, 6, 7], [8, 9, 10]]
    good = GenerationResult("a", 0, 1, True, [8, 9, 10], 0.2)
    wrong = GenerationResult("a", 1, 0, True, [5, 6, 8], 0.3)
    failed = GenerationResult("b", 0, 0, False, [], 4.0, "MissingBlocksError: no servers")
    report = ChurnReport(seed=0, duration_s=1.0)
    collect_results(report, [_client("a", [good, wrong]), _client("b", [failed, good], done=False)], reference)
    assert report.generations == 4
    assert report.differing == 1 and "prompt 0" in report.differences[0]
    assert report.failed == 2  # the error, and client b's generation that never finished
    assert len(report.client_problems) == 1 and report.client_problems[0].startswith("b:")
    assert report.per_client == {"a": 2, "b": 2} and report.max_generation_s == 4.0
    assert not report.ok

    clean = ChurnReport(seed=0, duration_s=1.0)
    collect_results(clean, [_client("a", [good, good])], reference)
    assert clean.ok and clean.generations == 2


def test_result_lines_round_trip_and_reject_garbage() -> None:
    result = GenerationResult("c", 3, 1, True, [1, 2], 0.5)
    assert GenerationResult.from_line(result.to_line()) == result
    with pytest.raises(ValueError):
        GenerationResult.from_line("churn-resul {}")
    with pytest.raises(ValueError):
        GenerationResult.from_line("churn-result [1]")
