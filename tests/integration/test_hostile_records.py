"""Hostile DHT records on a loopback swarm: a peer serving a ~250-deep nested tuple under a block key, and a
`_petals.models` entry declaring 10**7 blocks. Readers (record parsers, the health monitor) skip them with a log
line, within their timeouts, and their DHT process stays alive for the next refresh."""

from __future__ import annotations

import time
from functools import partial

import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from corolla.health.collector import HealthConfig, StateCollector
from corolla.protocol.records import MODELS_INDEX_KEY, ModelInfo, ServerInfo, ServerState
from corolla.protocol.uids import make_uid
from corolla.swarm.dht import SwarmConfig, create_dht, get_peer_id, get_visible_maddrs, run_in_dht, shutdown_dht
from corolla.swarm.records_io import declare_active_modules, declare_model_info, get_remote_module_infos
from helpers.hostile_bytes import nested_tuples

pytestmark = pytest.mark.timeout(180)

PREFIX = "honest-model"
NUM_BLOCKS = 3
TIMEOUT_S = 10.0


async def _plant(_dht, node, *, key: str, subkey: object, value_bytes: bytes, expiration: float) -> bool:
    """What a modified peer does: put raw bytes in its own storage, served to whoever asks for `key`."""
    return node.protocol.storage.store_subkey(
        DHTID.generate(source=key), MSGPackSerializer.dumps(subkey), value_bytes, expiration
    )


@pytest.fixture(scope="module")
def swarm():
    nodes = []
    try:
        nodes.append(create_dht(SwarmConfig(startup_timeout_s=20)))  # bootstrap
        maddrs = get_visible_maddrs(nodes[0], timeout_s=TIMEOUT_S)
        for _ in range(3):  # honest server, attacker, reader (the health monitor)
            nodes.append(create_dht(SwarmConfig(initial_peers=maddrs, startup_timeout_s=20)))
        yield nodes
    finally:
        for node in nodes:
            shutdown_dht(node)


def test_garbage_records_are_skipped_and_the_monitor_survives(swarm):
    _boot, server, attacker, reader = swarm
    expiration = get_dht_time() + 120
    uids = [make_uid(PREFIX, i) for i in range(NUM_BLOCKS)]
    info = ServerInfo(state=ServerState.ONLINE, throughput=10.0, start_block=0, end_block=NUM_BLOCKS)
    assert all(declare_active_modules(server, uids, info, expiration, timeout_s=TIMEOUT_S).values())
    assert declare_model_info(server, PREFIX, ModelInfo(num_blocks=NUM_BLOCKS), expiration, timeout_s=TIMEOUT_S)

    bomb = nested_tuples(250)[3:]  # the value alone: ~1.2 KB that crashed hivemind's decoder
    plants = [
        dict(key=uids[1], subkey=get_peer_id(attacker).to_base58(), value_bytes=bomb),
        dict(key=MODELS_INDEX_KEY, subkey="m", value_bytes=MSGPackSerializer.dumps({"num_blocks": 10**7})),
        dict(key=MODELS_INDEX_KEY, subkey="n", value_bytes=bomb),
    ]
    for plant in plants:
        assert run_in_dht(
            attacker, partial(_plant, **plant, expiration=expiration + 60), timeout_s=TIMEOUT_S, what="plant"
        )

    started = time.monotonic()
    infos = get_remote_module_infos(reader, uids, latest=True, timeout_s=TIMEOUT_S)
    assert time.monotonic() - started < TIMEOUT_S
    server_id = get_peer_id(server).to_base58()
    assert [sorted(i.servers) for i in infos] == [[server_id]] * NUM_BLOCKS  # the bad subkey is skipped

    config = HealthConfig(check_reachability=False, dht_timeout_s=TIMEOUT_S, max_blocks_per_refresh=1000)
    collector = StateCollector(reader, config=config)
    for _ in range(2):  # the reader's DHT process must still serve the second refresh
        state = collector.refresh()
        reports = {r["dht_prefix"]: r for r in state["model_reports"]}
        assert PREFIX in reports, state
        assert reports[PREFIX]["state"] == "healthy"
        assert [row["peer_id"] for row in reports[PREFIX]["server_rows"]] == [server_id]
        assert "m" not in reports and "n" not in reports
        assert reader.is_alive()


def test_collector_budget_keeps_small_models_and_pinned_ones():
    from corolla.health.state import ModelEntry

    pinned = ModelEntry(dht_prefix="pinned", num_blocks=80)
    collector = StateCollector.__new__(StateCollector)
    collector.config = HealthConfig(max_blocks_per_refresh=200)
    collector.pinned_models = [pinned]
    models = [pinned, ModelEntry("fake-a", 150), ModelEntry("real", 60), ModelEntry("fake-b", 100)]
    assert [m.dht_prefix for m in collector._within_budget(models)] == ["pinned", "real"]
