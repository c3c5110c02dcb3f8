"""Loopback swarms of 2-3 DHT nodes: ServerInfo records under `prefix.i`/peer-id subkeys with expiration, spans
rebuilt from one surviving key, filters, the model index, bounded calls, pings and the RPC service names."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import pytest
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from corolla.protocol import rpc
from corolla.protocol.records import MODELS_INDEX_KEY, ModelInfo, ServerInfo, ServerState
from corolla.protocol.uids import make_uid
from corolla.swarm.dht import (
    PUBLIC_INITIAL_PEERS,
    SwarmConfig,
    create_dht,
    get_peer_id,
    get_visible_maddrs,
    replicate_p2p,
    run_in_dht,
    shutdown_dht,
)
from corolla.swarm.ping import PingAggregator, ping
from corolla.swarm.reachability import attach_reachability_protocol, check_direct_reachability
from corolla.swarm.records_io import (
    declare_active_modules,
    declare_model_info,
    get_remote_module_infos,
    get_verified_model_infos,
)
from corolla.swarm.spans import compute_spans
from corolla.utils.errors import BootstrapError

PREFIX = "tiny-test"
UIDS = [make_uid(PREFIX, i) for i in range(6)]
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def swarm():
    """Three nodes: a bootstrap node and two nodes that join through its printed address."""
    nodes = []
    try:
        nodes.append(create_dht(SwarmConfig(startup_timeout_s=20)))
        maddrs = get_visible_maddrs(nodes[0], timeout_s=TIMEOUT_S)
        assert maddrs and all(m.startswith("/ip4/127.0.0.1/tcp/") for m in maddrs)
        for _ in range(2):
            nodes.append(create_dht(SwarmConfig(initial_peers=maddrs, startup_timeout_s=20)))
        yield nodes
    finally:
        for node in nodes:
            shutdown_dht(node)


def _info(state: ServerState, throughput: float, start: int, end: int, **kwargs) -> ServerInfo:
    return ServerInfo(state=state, throughput=throughput, start_block=start, end_block=end, **kwargs)


def test_store_get_with_subkeys_and_expiration(swarm):
    boot, b, c = swarm
    b_id, c_id = get_peer_id(b).to_base58(), get_peer_id(c).to_base58()
    info_b = _info(ServerState.ONLINE, 10.0, 0, 4, adapters=("lora-x",))
    info_c = _info(ServerState.JOINING, 5.0, 2, 6)
    # b: block 3 stays, blocks 0..2 expire soon; c: blocks 2..5
    assert all(declare_active_modules(b, UIDS[3:4], info_b, get_dht_time() + 60, timeout_s=TIMEOUT_S).values())
    assert all(declare_active_modules(c, UIDS[2:], info_c, get_dht_time() + 60, timeout_s=TIMEOUT_S).values())
    short_expiration = get_dht_time() + 3.0
    assert all(declare_active_modules(b, UIDS[:3], info_b, short_expiration, timeout_s=TIMEOUT_S).values())

    infos = get_remote_module_infos(boot, UIDS, latest=True, timeout_s=TIMEOUT_S)
    assert get_dht_time() < short_expiration, "machine too slow: records expired before the first read"
    assert [i.uid for i in infos] == UIDS
    assert [sorted(i.servers) for i in infos] == [
        [b_id],
        [b_id],
        sorted([b_id, c_id]),
        sorted([b_id, c_id]),
        [c_id],
        [c_id],
    ]
    assert infos[0].servers[b_id] == info_b and infos[5].servers[c_id] == info_c

    only_lora = get_remote_module_infos(boot, UIDS, active_adapter="lora-x", latest=True, timeout_s=TIMEOUT_S)
    assert [sorted(i.servers) for i in only_lora] == [[b_id]] * 4 + [[], []]

    time.sleep(max(0.0, short_expiration + 0.3 - get_dht_time()))  # b's records for blocks 0..2 expire
    infos = get_remote_module_infos(c, UIDS, latest=True, timeout_s=TIMEOUT_S)
    assert [b_id in i.servers for i in infos] == [False, False, False, True, False, False]

    # one surviving key is enough to rebuild b's whole span [0, 4)
    spans = compute_spans(infos, min_state=ServerState.JOINING)
    assert (spans[b_id].start, spans[b_id].end, spans[b_id].state) == (0, 4, ServerState.ONLINE)
    assert (spans[c_id].start, spans[c_id].end) == (2, 6)
    assert set(compute_spans(infos, min_state=ServerState.ONLINE)) == {b_id}

    # a window of uids that starts later: indices are relative to its first uid
    tail = get_remote_module_infos(boot, UIDS[3:], latest=True, timeout_s=TIMEOUT_S)
    tail_spans = compute_spans(tail, min_state=ServerState.JOINING)
    assert (tail_spans[b_id].start, tail_spans[b_id].end) == (0, 1)
    assert (tail_spans[c_id].start, tail_spans[c_id].end) == (0, 3)


def test_oversized_records_refused_and_dead_bootstrap_fails_fast(swarm):
    pings = {f"Qm{i:044d}": 0.001 for i in range(400)}  # a next_pings map far too big for one DHT value
    with pytest.raises(ValueError, match="limit"):
        declare_active_modules(swarm[1], UIDS[:1], _info(ServerState.ONLINE, 1.0, 0, 1, next_pings=pings), 1e10)
    started = time.monotonic()
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWGssBkjH2kANT2jVFQ3nv8xpqZRxAvr4iAAXVHKQMZQJm"
    with pytest.raises(BootstrapError, match="could not reach any of --initial_peers"):
        create_dht(SwarmConfig(initial_peers=[dead], startup_timeout_s=10))
    assert time.monotonic() - started < 30


def test_malformed_records_are_skipped_with_a_log_line(swarm):
    boot, b, _ = swarm
    uid = make_uid("malformed-test", 0)
    good_peer = get_peer_id(b).to_base58()
    fake_peer = PeerID.from_base58("QmedTaZXmULqwspJXz44SsPZyTNKxhnnFvYRajfH7MGhCY").to_base58()
    exp = get_dht_time() + 30
    assert declare_active_modules(b, [uid], _info(ServerState.ONLINE, 1.0, 0, 1), exp, timeout_s=TIMEOUT_S)[uid]
    for subkey, value in ((fake_peer, (2, "fast", {})), ("not-a-peer-id", (2, 1.0, {})), (fake_peer + "x", [1])):
        assert boot.store(uid, value, exp, subkey=subkey, return_future=True).result(TIMEOUT_S)

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("corolla.swarm.records_io")
    logger.addHandler(handler)
    try:
        (info,) = get_remote_module_infos(boot, [uid], latest=True, timeout_s=TIMEOUT_S)
    finally:
        logger.removeHandler(handler)
    assert list(info.servers) == [good_peer]
    assert sum("records.malformed" in r.getMessage() for r in records) == 3


def test_model_index_record(swarm):
    boot, b, _ = swarm
    exp = get_dht_time() + 30
    assert declare_model_info(b, PREFIX, ModelInfo(num_blocks=6, repository="local"), exp, timeout_s=TIMEOUT_S)
    assert not declare_model_info(b, "_private", ModelInfo(num_blocks=2), exp, timeout_s=TIMEOUT_S)
    assert boot.store(MODELS_INDEX_KEY, {"num_blocks": "six"}, exp, subkey="broken", return_future=True).result(
        TIMEOUT_S
    )
    models = get_verified_model_infos(boot, timeout_s=TIMEOUT_S)
    assert models[PREFIX] == ModelInfo(num_blocks=6, repository="local")
    assert "_private" not in models and "broken" not in models


async def _sleepy(_dht, _node) -> str:
    await asyncio.sleep(5)
    return "late"


def test_every_dht_call_is_bounded(swarm):
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="sleepy"):
        run_in_dht(swarm[0], _sleepy, timeout_s=0.3, what="sleepy")
    assert time.monotonic() - started < 3


async def test_ping_and_aggregator(swarm):
    boot, b, _ = swarm
    p2p = await replicate_p2p(b)
    try:
        rtt = await ping(get_peer_id(boot), p2p, timeout_s=5)
        assert 0 < rtt < 5
        unknown = PeerID.from_base58("QmQGTqmM7NKjV6ggU1ZCap8zWiyKR89RViDXiqehSiCpY5")
        assert math.isinf(await ping(unknown, p2p, timeout_s=1))
    finally:
        await p2p.shutdown()

    # a client-mode DHT node serves no DHT protocol: its "protocol not supported" answer still proves it is alive
    client = create_dht(SwarmConfig(initial_peers=get_visible_maddrs(boot), client_mode=True, startup_timeout_s=20))
    try:
        boot_p2p = await replicate_p2p(boot)
        try:
            assert 0 < await ping(get_peer_id(client), boot_p2p, timeout_s=5) < 5
        finally:
            await boot_p2p.shutdown()
    finally:
        shutdown_dht(client)

    aggregator = PingAggregator(b)
    await asyncio.to_thread(aggregator.ping, [get_peer_id(boot)], timeout_s=5)
    smoothed = aggregator.to_dict()
    assert list(smoothed) == [get_peer_id(boot).to_base58()] and 0 < smoothed[get_peer_id(boot).to_base58()] < 5


async def test_rpc_service_reachable_under_petals_handle_names(swarm):
    boot, b, _ = swarm

    class TransformerConnectionHandler(rpc.TransformerConnectionHandler):
        async def rpc_info(self, request: runtime_pb2.ExpertUID, context: rpc.P2PContext) -> runtime_pb2.ExpertInfo:
            return runtime_pb2.ExpertInfo(serialized_info=request.uid.encode())

    server_p2p = await replicate_p2p(boot)
    client_p2p = await replicate_p2p(b)
    handler = TransformerConnectionHandler()
    await handler.add_p2p_handlers(server_p2p)
    try:
        stub = rpc.get_stub(client_p2p, server_p2p.peer_id)
        reply = await stub.rpc_info(runtime_pb2.ExpertUID(uid="tiny-test.0"), timeout=5)
        assert reply.serialized_info == b"tiny-test.0"
        # the raw handle name a Petals client dials
        raw = await client_p2p.call_protobuf_handler(
            server_p2p.peer_id,
            "TransformerConnectionHandler.rpc_info",
            runtime_pb2.ExpertUID(uid="x"),
            runtime_pb2.ExpertInfo,
        )
        assert raw.serialized_info == b"x"
    finally:
        await handler.remove_p2p_handlers(server_p2p)
        await server_p2p.shutdown()
        await client_p2p.shutdown()


def test_reachability_check_against_a_serving_peer(swarm):
    boot, b, _ = swarm
    assert check_direct_reachability(["/ip4/127.0.0.1/tcp/1/p2p/QmX"]) is None  # private swarm: skipped
    service = attach_reachability_protocol(b)
    try:
        maddrs = get_visible_maddrs(boot, timeout_s=TIMEOUT_S)
        # a temporary node joins, asks the peers it knows to dial it back; only b serves the protocol
        assert check_direct_reachability(maddrs, force=True, timeout_s=30) is True
    finally:
        service.shutdown()


def test_ping_aggregator_ema_and_expiry():
    agg = PingAggregator(ema_alpha=0.2, expiration_s=300)
    agg.update("A", 0.010, now=0)
    agg.update("A", 0.020, now=1)
    assert agg.to_dict(now=2)["A"] == pytest.approx(0.2 * 0.020 + 0.8 * 0.010)
    agg.update("B", math.inf, now=0)
    agg.update("B", 0.030, now=1)  # a fresh value replaces inf
    assert agg.to_dict(now=2)["B"] == 0.030
    agg.update("B", math.inf, now=3)  # a failed ping makes the peer unreachable until it answers again
    assert math.isinf(agg.to_dict(now=4)["B"])
    assert set(agg.to_dict(now=302)) == {"B"}  # A was last refreshed at t=1: forgotten after 300 s
    with pytest.raises(RuntimeError):
        agg.ping(["QmQGTqmM7NKjV6ggU1ZCap8zWiyKR89RViDXiqehSiCpY5"])  # no DHT to ping through


def test_swarm_config_network_defaults():
    private = SwarmConfig(initial_peers=["/ip4/127.0.0.1/tcp/5/p2p/QmX"]).dht_kwargs()
    assert private["host_maddrs"] == ["/ip4/127.0.0.1/tcp/0"]
    assert not any(private[k] for k in ("nat_port_map", "auto_nat", "use_relay", "use_auto_relay", "use_ipfs"))
    public_config = SwarmConfig(initial_peers=list(PUBLIC_INITIAL_PEERS))
    public = public_config.dht_kwargs()
    assert public_config.is_public and public["host_maddrs"] == ["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0"]
    assert all(public[k] for k in ("nat_port_map", "auto_nat", "use_relay", "use_auto_relay"))
    assert (
        SwarmConfig(initial_peers=list(PUBLIC_INITIAL_PEERS), nat_port_map=False).dht_kwargs()["nat_port_map"] is False
    )
    with pytest.raises(ValueError):
        SwarmConfig(startup_timeout_s=0).dht_kwargs()
