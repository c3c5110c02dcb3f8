"""The health document built from synthetic DHT records (no swarm): coverage, gaps, rows, and the page/JSON app."""

from __future__ import annotations

import json
import math
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from corolla.api.serving import serve_in_thread
from corolla.health.app import create_app
from corolla.health.collector import HealthConfig, StateCollector
from corolla.health.state import ModelEntry, build_state
from corolla.protocol.records import RemoteModuleInfo, ServerInfo, ServerState

PREFIX = "tiny-llama"
A, B, C, D, E = (f"Qm{c * 10}" for c in "ABCDE")


def record(state: ServerState, start: int, end: int, **extra) -> ServerInfo:
    return ServerInfo(state=state, throughput=100.0, start_block=start, end_block=end, **extra)


def module_infos(servers: dict[str, ServerInfo], num_blocks: int = 6) -> list[RemoteModuleInfo]:
    infos = [RemoteModuleInfo(uid=f"{PREFIX}.{i}", servers={}) for i in range(num_blocks)]
    for peer_id, info in servers.items():
        for i in range(info.start_block, info.end_block):
            infos[i].servers[peer_id] = info
    return infos


def build(servers: dict[str, ServerInfo], rtts: dict[str, float] | None = None) -> dict:
    model = ModelEntry(dht_prefix=PREFIX, num_blocks=6, repository="https://huggingface.co/org/tiny-llama")
    state = build_state(
        [model],
        {PREFIX: module_infos(servers)},
        rtts_s=rtts or {},
        bootstrap_states=["online"],
        last_updated=1000.0,
        update_period_s=2.0,
        update_duration_s=0.1,
    )
    json.dumps(state, allow_nan=False)  # strict JSON: no inf/NaN anywhere
    return state


SWARM = {
    A: record(
        ServerState.ONLINE,
        0,
        3,
        public_name="alice",
        torch_dtype="float32",
        quant_type="none",
        cache_tokens_left=600,
        next_pings={B: 0.002, C: math.inf},
        inference_rps=50.0,
        adapters=("org/lora-x",),
        version="0.1.0",
        using_relay=False,
    ),
    B: record(ServerState.ONLINE, 2, 5),
    C: record(ServerState.ONLINE, 4, 6),
    D: record(ServerState.OFFLINE, 0, 6),
}


def test_complete_coverage_is_healthy():
    state = build(SWARM)
    (report,) = state["model_reports"]
    assert report["state"] == "healthy"
    assert report["name"] == "org/tiny-llama" and report["short_name"] == "tiny-llama"
    assert [b["num_servers"] for b in report["blocks"]] == [1, 1, 2, 1, 2, 1]
    assert [b["throughput"] for b in report["blocks"]] == [100.0, 100.0, 200.0, 100.0, 200.0, 100.0]
    assert all(b["state"] == "online" for b in report["blocks"])
    rows = {r["peer_id"]: r for r in report["server_rows"]}
    assert set(rows) == {A, B, C, D}
    assert rows[D]["state"] == "offline" and report["num_servers"] == 3
    a = rows[A]
    assert (a["span"]["start"], a["span"]["end"], a["span"]["length"]) == (0, 3, 3)
    assert a["span"]["server_info"]["state"] == int(ServerState.ONLINE)
    assert a["span"]["server_info"]["next_pings"] == {B: 0.002, C: None}  # inf -> null
    assert a["cache_tokens_left_per_block"] == 600 // (3 * 2)
    assert a["adapters"] == [{"name": "org/lora-x", "short_name": "lora-x"}]
    assert a["short_peer_id"] == "..." + A[-6:]
    assert rows[B]["pings_to_me"] == {A: 0.002}
    assert state["bootstrap_states"] == ["online"]


def test_stopped_server_leaves_red_gap():
    swarm = {**SWARM, C: record(ServerState.OFFLINE, 4, 6)}
    report = build(swarm)["model_reports"][0]
    assert report["state"] == "broken"
    assert [b["state"] for b in report["blocks"]] == ["online"] * 5 + ["gap"]


def test_unreachable_and_joining():
    swarm = dict(SWARM)
    swarm[E] = record(ServerState.JOINING, 5, 6)
    state = build(swarm, rtts={A: 0.001, B: 0.001, C: math.inf})
    report = state["model_reports"][0]
    rows = {r["peer_id"]: r for r in report["server_rows"]}
    assert rows[C]["state"] == "unreachable" and rows[C]["ping_s"] is None
    assert rows[E]["state"] == "joining"
    assert [b["state"] for b in report["blocks"]] == ["online"] * 5 + ["joining"]
    assert report["state"] == "broken"
    assert state["reachability_issues"] == [{"peer_id": C, "err": "did not answer a ping"}]


class _FixedCollector(StateCollector):
    """A collector whose refresh serves a prepared document (no DHT)."""

    def __init__(self, state: dict):
        super().__init__(dht=None, config=HealthConfig(refresh_period_s=2.0))
        self._state = state


def test_app_serves_page_json_and_metrics():
    state = build(SWARM)
    with serve_in_thread(create_app(_FixedCollector(state))) as running:
        with urllib.request.urlopen(running.url + "/api/v1/state", timeout=10) as r:
            assert json.loads(r.read()) == state
        with urllib.request.urlopen(running.url + "/", timeout=10) as r:
            html = r.read().decode()
        assert "api/v1/state" in html and "http://" not in html and "https://" not in html  # nothing external
        with urllib.request.urlopen(running.url + "/metrics", timeout=10) as r:
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    servers = {s.labels["state"]: s.value for s in families["corolla_swarm_servers"].samples}
    assert servers == {"online": 3, "joining": 0, "offline": 1, "unreachable": 0}
    assert families["corolla_swarm_model_healthy"].samples[0].value == 1


def test_flow_load_and_moves():
    """Each row shows the load its server announces (none for a Petals server); the model shows its layout's
    max-flow against the bound of its total capacity, the served rate, and moves in progress."""
    swarm = {
        A: record(ServerState.ONLINE, 0, 3, sessions_active=2, busy_fraction=0.5, tokens_served=1000, num_moves=0),
        B: record(ServerState.ONLINE, 3, 6, sessions_active=0, busy_fraction=0.0, tokens_served=10, num_moves=1),
        C: record(ServerState.ONLINE, 0, 6),  # a stock Petals server: no load fields
        E: record(ServerState.JOINING, 2, 4, num_moves=2),  # reloading after a move
    }
    model = ModelEntry(dht_prefix=PREFIX, num_blocks=6)
    state = build_state([model], {PREFIX: module_infos(swarm)}, last_updated=1.0, update_period_s=1.0,
                        update_duration_s=0.1, served_tps={A: 6.0, B: 0.0})  # fmt: skip
    (report,) = state["model_reports"]
    rows = {r["peer_id"]: r for r in report["server_rows"]}
    assert rows[A]["load"] == {"sessions_active": 2, "busy_fraction": 0.5, "tokens_served": 1000, "num_moves": 0,
                               "moving_to": None, "served_tps": 6.0}  # fmt: skip
    assert rows[C]["load"] is None
    flow = report["flow"]
    # A and B in series (100 tok/s each) beside C over all blocks (100): 200 tok/s through every block
    assert flow["bottleneck_tps"] == 200.0 and flow["max_flow_tps"] == pytest.approx(200.0, rel=1e-6)
    # (100 * 3 + 100 * 3 + 100 * 6) token-blocks/s over 6 blocks: this layout reaches the bound
    assert flow["bound_tps"] == 200.0 and flow["efficiency"] == pytest.approx(1.0, rel=1e-6)
    assert flow["served_tps"] == pytest.approx(6.0 * 3 / 6)
    assert report["num_moves"] == 3 and report["moves_in_progress"] == 1
    assert rows[E]["move"] == "reloading" and rows[A]["move"] is None and rows[C]["move"] is None
    json.dumps(state, allow_nan=False)


def test_a_fetch_while_serving_is_a_move_in_progress():
    """A server that fetches the span it will move to keeps serving its own (ONLINE): its record's `moving_to`
    makes it a move in progress, shown with the span it fetches."""
    swarm = {
        A: record(ServerState.ONLINE, 0, 3, num_moves=0, moving_to=(3, 6)),
        B: record(ServerState.ONLINE, 3, 6, num_moves=0),
        C: record(ServerState.JOINING, 2, 4, num_moves=1),
    }
    state = build_state([ModelEntry(dht_prefix=PREFIX, num_blocks=6)], {PREFIX: module_infos(swarm)},
                        last_updated=1.0, update_period_s=1.0, update_duration_s=0.1)  # fmt: skip
    (report,) = state["model_reports"]
    rows = {r["peer_id"]: r for r in report["server_rows"]}
    assert rows[A]["state"] == "online" and rows[A]["move"] == "fetching" and rows[A]["load"]["moving_to"] == [3, 6]
    assert rows[B]["move"] is None and rows[C]["move"] == "reloading"
    assert report["moves_in_progress"] == 2
    assert all(block["state"] == "online" for block in report["blocks"])  # it still serves 0:3
    json.dumps(state, allow_nan=False)
