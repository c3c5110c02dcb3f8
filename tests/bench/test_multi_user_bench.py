"""The multi-user benchmark's CPU mode as a smoke test: one real server (fast path on the CPU), sessions driven
from two separate client processes over p2p; every session finishes, steps of different sessions merge into one
forward, and the figures are in a sane (loose) range. corolla's own client streams (`--clients corolla`) decode what
the stock-Petals-style ones decode, over p2p and the socket; `--client_cpus` puts the client processes and the
server side on separate CPUs."""

from __future__ import annotations

import math
import os

import pytest
import torch

from benchmarks.common.model import ModelShape
from benchmarks.users import server as mu
from benchmarks.users.clients import CpuSplit

SHAPE = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


def test_sessions_are_spread_over_processes_without_empty_ones():
    assert mu.UsersConfig(sessions=16, client_processes=4, transport="p2p").split() == [4, 4, 4, 4]
    assert mu.UsersConfig(sessions=5, client_processes=4, transport="p2p").split() == [2, 1, 1, 1]
    assert mu.UsersConfig(sessions=1, client_processes=4, transport="socket").split() == [1]
    with pytest.raises(ValueError, match="transport"):
        mu.UsersConfig(sessions=1, client_processes=1, transport="tcp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decode_steps"):
        mu.UsersConfig(sessions=1, client_processes=1, transport="p2p", decode_steps=3, warmup_steps=3)


def test_lost_sessions_and_client_errors_are_reported():
    config = mu.UsersConfig(sessions=3, client_processes=2, transport="p2p", decode_steps=8)
    collected = [
        {"errors": [], "latencies": [[1.0, 2.0], [3.0, 4.0]], "finished": 2, "windows": [(10.0, 11.0), (10.0, 12.0)]},
        {"errors": ["client process failed: TimeoutError()"], "latencies": [], "finished": 0},
    ]
    result = mu._summarize(config, "fused", collected, {}, {}, 10.0, 12.0)
    assert result.sessions_finished == 2 and result.errors == ["client process failed: TimeoutError()"]
    assert result.aggregate_tokens_per_s == pytest.approx(2 * 8 / 2.0)
    assert result.step_worst_ms == 4.0 and result.worst_session_median_ms == 3.5
    assert result.steps_per_merged_forward == 0.0  # no runtime batches seen


def test_many_sessions_through_one_server_from_two_processes(small_executor):
    config = mu.UsersConfig(
        sessions=6, client_processes=2, transport="p2p", prefix_tokens=4, decode_steps=8, start_timeout_s=120
    )
    with _server(small_executor).running(keep_runtime=True) as server:
        result = mu.run_users(server, config, "fused")
    assert result.errors == [] and result.sessions_finished == 6
    assert result.client_processes == 2
    assert result.steps_per_merged_forward > 1.0  # steps of several sessions ran as one forward
    assert 0.0 < result.device_busy_share <= 1.0
    assert math.isfinite(result.step_median_ms) and result.step_median_ms < 20_000
    assert result.aggregate_tokens_per_s > 0.5


def test_client_kind_is_checked_and_defaults_to_petals():
    assert mu.UsersConfig(sessions=1, client_processes=1, transport="p2p").client == "petals"
    with pytest.raises(ValueError, match="client must be one of petals, corolla"):
        mu.UsersConfig(sessions=1, client_processes=1, transport="p2p", client="hivemind")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def small_executor():
    return mu.build_executor(
        SHAPE,
        torch.float32,
        torch.device("cpu"),
        num_layers=SHAPE.num_layers,
        serving_path="fused",
        cache_bytes=32 << 20,
    )


def _server(executor, cpus=None) -> mu.BenchServer:
    return mu.BenchServer(
        executor,
        hidden_size=SHAPE.hidden_size,
        num_layers=SHAPE.num_layers,
        dtype=torch.float32,
        device=torch.device("cpu"),
        cpus=cpus,
    )


def _outputs_by_seed(clients: list[dict]) -> dict[int, torch.Tensor]:
    """Each client process's sessions' outputs ([sessions, 1 + decode steps, hidden]) by its seed (its inputs)."""
    return {r["seed"]: torch.tensor(r["outputs"]) for r in clients}


def test_corolla_clients_decode_what_petals_clients_decode_over_p2p_the_socket_and_the_direct_port(small_executor):
    """The same inputs (each client process's seed) through the same server: corolla's own client streams, over p2p,
    the same-host socket and the server's direct port, and the stock-Petals-style streams over the socket, get the
    outputs the stock-Petals-style streams get over p2p, every session finishing; a Petals client has no direct
    transport."""
    with pytest.raises(ValueError, match="needs client 'corolla'"):
        mu.UsersConfig(sessions=1, client_processes=1, transport="direct", client="petals")
    runs = [("p2p", "petals"), ("socket", "petals"), ("p2p", "corolla"), ("socket", "corolla"), ("direct", "corolla")]
    outputs, rows = {}, {}
    with _server(small_executor).running(keep_runtime=True) as server:
        for transport, client in runs:
            config = mu.UsersConfig(sessions=4, client_processes=2, transport=transport, client=client,
                                    prefix_tokens=4, decode_steps=5, start_timeout_s=120)  # fmt: skip
            clients: list[dict] = []
            rows[transport, client] = mu.run_users(server, config, "fused", clients_out=clients)
            outputs[transport, client] = _outputs_by_seed(clients)
    for key, row in rows.items():
        assert row.errors == [] and row.sessions_finished == 4, key
        assert row.client == key[1] and row.transport == key[0] and row.client_cpus == []
        assert row.cpu_us_per_step["client processes"] > 0
    reference = outputs["p2p", "petals"]
    assert sorted(reference) == [100, 101] and reference[100].shape == (2, 1 + 5, SHAPE.hidden_size)
    assert not torch.equal(reference[100][0], reference[101][0])  # the processes' inputs differ
    for key in runs[1:]:
        assert sorted(outputs[key]) == [100, 101]
        for seed, expected in reference.items():
            torch.testing.assert_close(outputs[key][seed], expected, rtol=1e-4, atol=1e-4, msg=f"{key}, seed {seed}")


def _p2pd_children() -> list[int]:
    from benchmarks.users.cpu_share import process_stat

    pids = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    return [p for p in pids if (s := process_stat(p)) is not None and s[0] == "p2pd" and s[1] == os.getpid()]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_client_cpus_pin_the_clients_and_the_server_apart(small_executor):
    have = frozenset(os.sched_getaffinity(0))
    split = CpuSplit.parse(str(max(have)), have)
    config = mu.UsersConfig(sessions=2, client_processes=1, transport="p2p", client="corolla",
                            prefix_tokens=4, decode_steps=5, start_timeout_s=120)  # fmt: skip
    clients: list[dict] = []
    with _server(small_executor, split).running(keep_runtime=True) as server:
        assert frozenset(os.sched_getaffinity(0)) == split.server
        daemons = _p2pd_children()
        assert daemons and all(frozenset(os.sched_getaffinity(p)) == split.server for p in daemons)
        row = mu.run_users(server, config, "fused", clients_out=clients)
    assert frozenset(os.sched_getaffinity(0)) == have  # restored
    assert row.errors == [] and row.sessions_finished == 2
    assert [c["cpus"] for c in clients] == [sorted(split.clients)]
    assert row.client_cpus == sorted(split.clients) and row.server_cpus == sorted(split.server)
