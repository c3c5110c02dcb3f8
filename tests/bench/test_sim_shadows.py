"""Shadow sessions in the simulator (issue 37, decision 0268): the shadow rows' cost fitted to decision 0260's
measurement (the roofline alone says far less), the step's expectation over the Poisson requests, and in a tiny swarm
the mechanism: without shadows nothing changes; with them replicas hold the shadows' KV and run their rows, both rising
with the fraction, and `--shadow_kv none` keeps the rows without the KV."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from benchmarks.sim.catalogue import GPUS, LLAMA2_70B, ServerPerf
from benchmarks.sim.client_model import SimSession
from benchmarks.sim.metrics import Metrics
from benchmarks.sim.scenarios import scenario
from benchmarks.sim.server_model import SimServer
from benchmarks.sim.shadow_rows import (
    MEASURED_COST,
    ROW_FLOPS_EFFICIENCY,
    ShadowLoad,
    bench_cost,
    expected_block_s,
    row_s,
)
from benchmarks.sim.shadows import ShadowBook, held_kv
from benchmarks.sim.simulation import Simulation
from benchmarks.sim.workload import Conversation
from corolla.protocol.records import ServerState

DURATION_S = 1100.0  # the tiny swarm: 10 minutes of warm-up, then 500 s measured


def test_the_row_cost_is_fitted_to_the_measured_replica() -> None:
    """0260 (one H100, 32 Llama-3-8B layers): +9.9% at 64 sessions (fitted), +2.6% at 16 (quartiles +1.9 / +2.7:
    the model is checked there), +0.5% at one; the roofline alone says under 1% at 64 (rows free while the weights'
    reads bound the step), so the fit is what charges them."""
    assert bench_cost(64, ROW_FLOPS_EFFICIENCY) == pytest.approx(MEASURED_COST[64], rel=1e-3)
    assert 0.019 <= bench_cost(16, ROW_FLOPS_EFFICIENCY) <= 0.027
    assert 0 < bench_cost(1, ROW_FLOPS_EFFICIENCY) <= MEASURED_COST[1]
    assert bench_cost(64, 0.0) < 0.01
    assert 0.5 < ROW_FLOPS_EFFICIENCY < 1.0  # a row's FLOPs near the card's peak, above the roofline's 0.5


@pytest.mark.parametrize("gpu", ["RTX-3060", "A100-80GB", "H100-80GB"])
@pytest.mark.parametrize(("rows", "requests"), [(1, 0.3), (8, 1.5), (24, 4.0), (60, 12.0)])
def test_the_step_is_its_expectation_over_the_requests(gpu: str, rows: int, requests: float) -> None:
    """`expected_block_s`'s closed form against the sum over K ~ Poisson(requests) of the step with K requests, on
    cards memory-bound and compute-bound at these rows (the max's kink inside the distribution), and 0 requests
    giving the catalogue's step."""
    perf = ServerPerf(GPUS[gpu], LLAMA2_70B, "nf4")
    extra_s = row_s(perf, ROW_FLOPS_EFFICIENCY)
    context, request_rows, request_context = rows * 500.0, 16.0, 400.0
    kv_s = perf.model.kv_bytes_per_token_block / (perf.gpu.bandwidth_bytes_per_s * 0.4)
    total, p = 0.0, math.exp(-requests)
    for k in range(200):
        step = max(
            perf.decode_block_s(rows, context) + k * (request_context * kv_s + request_rows * extra_s),
            perf.decode_block_s(rows + k * request_rows, context),
        )
        total += p * step
        p *= requests / (k + 1)
    got = expected_block_s(perf, rows, context, requests, request_rows, request_context, extra_s)
    assert got == pytest.approx(total, rel=1e-9)
    assert expected_block_s(perf, rows, context, 0.0, 16.0, 400.0, extra_s) == perf.decode_block_s(rows, context)


def test_a_replicas_step_and_busy_share_rise_with_its_shadow_requests() -> None:
    """A server's `batch` with shadow requests riding its steps: slower steps, busier; without them, the plain
    roofline step (the code path before shadows)."""
    perf = ServerPerf(GPUS["RTX-3090"], LLAMA2_70B, "nf4")
    server = SimServer("s", "us-east", perf, 20, 0.0, start=0, end=20, rows=6, visit_rate=30.0, context_tokens=3000)
    server.shadow_row_s = row_s(perf, ROW_FLOPS_EFFICIENCY)
    rows, step_s, busy = server.batch(5.0)
    assert step_s == perf.decode_step_s(20, rows, rows * 500)
    server.shadow_load = ShadowLoad(requests_per_s=40.0, rows=640.0, context=16000.0)  # ~one request a step
    shadowed = server.batch(5.0)
    assert shadowed[1] > step_s * 1.2 and shadowed[2] > busy
    server.shadow_load = ShadowLoad(requests_per_s=80.0, rows=1280.0, context=32000.0)
    assert server.batch(5.0)[1] > shadowed[1]


def _run(fraction: float, *, kv: bool = True, probe: list[tuple[int, int, float, float]] | None = None) -> dict:
    """The tiny swarm at seed 1 with `fraction` of span sessions shadowed; `probe` collects every 100 s after the
    warm-up, per server holding shadows: (the KV its shadows hold, the KV reserved on it, its step with the
    shadows' requests, without them)."""
    sim = Simulation(scenario("tiny", seed=1, duration_s=DURATION_S, shadow_fraction=fraction, shadow_kv=kv))

    def look() -> None:
        assert probe is not None
        for server in sim.view.servers.values():
            if server.state is None or not server.shadows:
                continue
            with_shadows = server.batch()[1]
            load, server.shadow_load = server.shadow_load, ShadowLoad()
            without = server.batch()[1]
            server.shadow_load = load
            probe.append((held_kv(server), server.kv_reserved_token_blocks, with_shadows, without))
        sim.loop.after(100.0, look)

    if probe is not None:
        sim.loop.at(sim.config.warmup_s, look)
    report = dataclasses.asdict(sim.run())
    for key in ("wall_s", "cpu_s", "calls_wall_s"):
        report.pop(key)
    return report


@pytest.mark.timeout(240)
def test_shadows_hold_kv_and_rows_on_replicas_and_nothing_without_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """F = 0: no shadow anywhere, the shadowed step never taken (every figure as before shadows); F = 0.5 and 1:
    shadows opened on replicas, their KV reserved there and their requests slowing its steps, all rising with F;
    without KV held, the rows stay and the KV is gone."""
    real = SimServer._shadowed_batch

    def refuse(self: SimServer, own_rate: float) -> tuple[float, float, float]:
        raise AssertionError("a step with shadow requests in a run without shadows")

    monkeypatch.setattr(SimServer, "_shadowed_batch", refuse)
    plain_probe: list[tuple[int, int, float, float]] = []
    plain = _run(0.0, probe=plain_probe)
    assert plain["shadows"] == {} and plain_probe == []
    assert plain["decode_tps"] > 0
    monkeypatch.setattr(SimServer, "_shadowed_batch", real)

    half_probe: list[tuple[int, int, float, float]] = []
    full_probe: list[tuple[int, int, float, float]] = []
    half, full = _run(0.5, probe=half_probe), _run(1.0, probe=full_probe)
    for report, probe in ((half, half_probe), (full, full_probe)):
        shadows = report["shadows"]
        assert shadows["opened"] > 5 and shadows["drawn"] >= shadows["opened"] + shadows["no_replica"]
        assert 0 < shadows["kv_share_mean"] < shadows["kv_reserved_mean"]
        assert shadows["step_cost_mean"] > 0 and shadows["hop_cost_mean"] > 0
        assert probe and all(0 < held <= reserved for held, reserved, _, _ in probe)
        assert any(with_s > without_s for _, _, with_s, without_s in probe)
        assert all(with_s >= without_s for _, _, with_s, without_s in probe)
    assert full["shadows"]["drawn"] > half["shadows"]["drawn"]
    assert full["shadows"]["replayed_over_served"] > half["shadows"]["replayed_over_served"] > 0
    assert full["shadows"]["kv_share_mean"] > half["shadows"]["kv_share_mean"]
    assert full["shadows"]["step_cost_mean"] > half["shadows"]["step_cost_mean"]

    rows_only_probe: list[tuple[int, int, float, float]] = []
    rows_only = _run(1.0, kv=False, probe=rows_only_probe)
    assert rows_only["shadows"]["kv_share_mean"] == 0 and rows_only["shadows"]["refused_for_kv"] == 0
    assert rows_only["shadows"]["replayed_over_served"] > 0
    assert rows_only_probe and all(held == 0 for held, _, _, _ in rows_only_probe)
    assert any(with_s > without_s for _, _, with_s, without_s in rows_only_probe)


def test_a_real_session_ends_the_youngest_shadows_for_its_room_on_a_corolla_replica() -> None:
    """A corolla replica full of shadows admits a real session by ending shadows, youngest first, no more than it
    needs (`server.core.admission`); a stock Petals replica (pooled KV) ends none; a shadow never ends another."""
    perf = ServerPerf(GPUS["RTX-3090"], LLAMA2_70B, "nf4")
    replica = SimServer("r", "us-east", perf, 10, 0.0, start=0, end=10, state=ServerState.ONLINE)
    hop = SimServer("h", "us-east", perf, 10, 0.0, start=0, end=10, state=ServerState.ONLINE)
    clock = [0.0]
    metrics = Metrics()
    book: ShadowBook[SimSession] = ShadowBook(
        1.0, random.Random(0), lambda *_: ["r"], {"r": replica, "h": hop}, metrics, lambda: clock[0]
    )
    need = replica.kv_capacity_tokens // 4
    sessions = []
    for sid in range(5):  # four fill the replica, the fifth is refused
        clock[0] = float(sid)
        session = SimSession(sid, Conversation(0.0, "us-east", ((need // 2, need - need // 2),)), None)
        session.route, session.shadows = [(hop, 0, 10)], [None]
        book.draw(session, 0, 1)
        sessions.append(session)
    assert [s.shadows[0] is not None for s in sessions] == [True] * 4 + [False]
    assert metrics.shadows_refused == 1 and replica.kv_free_tokens(0, 10) < need
    assert not book.room(replica, 0, 10, replica.kv_capacity_tokens + 1)
    assert book.room(replica, 0, 10, 2 * need)
    book.make_room(replica, 0, 10, 2 * need)
    assert [s.shadows[0] is not None for s in sessions[:4]] == [True, True, False, False]  # the two youngest
    assert metrics.shadows_evicted == 2 and 2 * need <= replica.kv_free_tokens(0, 10) < 3 * need
    assert len(replica.shadows) == 2 and held_kv(replica) == 2 * need * 10

    replica.pooled_kv = True
    assert replica.kv_free_tokens(0, 10) >= 2 * need and not book.room(replica, 0, 10, 3 * need)
