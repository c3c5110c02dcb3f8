"""One peer floods a block key with made-up subkeys (4.8 MiB of them, more than a p2p message carries) on a loopback
DHT of two corolla nodes, its own stock hivemind node and a corolla reader: the corolla nodes keep at most
`MAX_DICTIONARY_BYTES` under the key (the honest server announced before the flood keeps its place), so they still
answer, and the reader still sees the honest server. Before: every node held the whole flood, none could answer a
lookup of the key (the p2p layer refuses the answer) and the reader saw no server of the block."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import hivemind
import pytest
from hivemind.dht.storage import DHTLocalStorage

from corolla.protocol.records import ServerInfo, ServerState
from corolla.protocol.uids import make_uid
from corolla.swarm.bounded_storage import MAX_DICTIONARY_BYTES, install_bounded_storage
from corolla.swarm.dht import (
    SwarmConfig,
    call_with_timeout,
    create_dht,
    get_peer_id,
    get_visible_maddrs,
    run_in_dht,
    shutdown_dht,
)
from corolla.swarm.records_io import declare_active_modules, get_remote_module_infos

pytestmark = pytest.mark.timeout(180)

UID = make_uid("flooded-model", 0)
JUNK_BYTES = 8000  # a value under hivemind's ~16 KiB trouble and corolla's per-entry bound
JUNK_ENTRIES = 600  # 4.8 MiB in all
BATCH = 100  # subkeys a store (one p2p request to each replica: under its 4 MiB)


async def _store_junk(_dht: hivemind.DHT, node: Any, *, subkeys: list[str], expiration_time: float) -> dict:
    return await node.store_many(
        keys=[UID] * len(subkeys), subkeys=subkeys, values=[bytes(JUNK_BYTES)] * len(subkeys),
        expiration_time=expiration_time,
    )  # fmt: skip


@pytest.fixture(scope="module")
def nodes():
    started: list = []
    try:
        boot = create_dht(SwarmConfig(startup_timeout_s=30))
        started.append(boot)
        peers = get_visible_maddrs(boot, timeout_s=10)
        server = create_dht(SwarmConfig(initial_peers=peers, startup_timeout_s=30))
        started.append(server)
        install_bounded_storage()  # (create_dht did): the stock node below gets hivemind's own storage back
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(DHTLocalStorage, "store_subkey", DHTLocalStorage.store_subkey.__wrapped__)
            attacker = hivemind.DHT(start=True, **SwarmConfig(initial_peers=peers, startup_timeout_s=30).dht_kwargs())
        started.append(attacker)
        reader = create_dht(SwarmConfig(initial_peers=peers, client_mode=True, startup_timeout_s=30))
        started.append(reader)
        yield server, attacker, reader
    finally:
        for dht in reversed(started):
            shutdown_dht(dht)


def test_a_block_key_flooded_past_a_p2p_message_still_shows_its_honest_server(nodes):
    server, attacker, reader = nodes
    honest = get_peer_id(server).to_base58()
    info = ServerInfo(state=ServerState.ONLINE, throughput=1.0, start_block=0, end_block=1)
    assert declare_active_modules(server, [UID], info, time.time() + 600)[UID]
    far = time.time() + 3600
    for start in range(0, JUNK_ENTRIES, BATCH):
        subkeys = [f"QmJunk{i:06d}" for i in range(start, start + BATCH)]
        store = partial(_store_junk, subkeys=subkeys, expiration_time=far)
        run_in_dht(attacker, store, timeout_s=30, what="attacker.store_many")
    found = call_with_timeout(attacker.get(UID, latest=True, return_future=True), 30, "attacker.get")
    assert len(found.value) == JUNK_ENTRIES + 1  # the stock node took it all (read locally: no p2p message)

    infos = get_remote_module_infos(reader, [UID], latest=True, timeout_s=30, max_signed_lookups=0)
    assert honest in infos[0].servers  # from the corolla nodes: each holds at most MAX_DICTIONARY_BYTES
    assert len(infos[0].servers) == 1  # the junk that fit there does not parse as a server
    assert MAX_DICTIONARY_BYTES < JUNK_ENTRIES * JUNK_BYTES
