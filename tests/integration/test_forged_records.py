"""Forged DHT records against a loopback swarm of real corolla servers, written by an attacker node that validates
nothing (as a stock or hostile peer): an OFFLINE record under an honest server's peer id, a record under its signed
key signed with another key, plain values over the model index and block keys, a garbage index entry and garbage
records. A corolla client still routes through the honest servers and generates the same tokens; health still
shows the model."""

from __future__ import annotations

import time

import hivemind
import pytest
import torch
from hivemind.dht.storage import DHTLocalStorage
from tests.helpers.swarm import Swarm, bootstrapped, inprocess_servers
from tests.helpers.tiny_models import hf_greedy, make_tiny_model

from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.health.collector import HealthConfig, StateCollector
from corolla.protocol.records import MODELS_INDEX_KEY, ModelInfo, ServerInfo, ServerState
from corolla.protocol.uids import make_uid
from corolla.swarm.bounded_storage import install_bounded_storage
from corolla.swarm.dht import SwarmConfig, call_with_timeout, create_dht, shutdown_dht
from corolla.swarm.identity import RecordSigner
from corolla.swarm.records_io import get_remote_module_infos, get_verified_model_infos
from corolla.swarm.signed_records import sign_server_record, signed_record_key

pytestmark = pytest.mark.timeout(240)

NUM_LAYERS = 4
PROMPT = torch.tensor([[1, 8, 27, 64, 125]])
NEW_TOKENS = 8
TIMEOUT_S = 15.0


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"), num_layers=NUM_LAYERS, seed=5)


@pytest.fixture(scope="module")
def swarm(model_path, tmp_path_factory: pytest.TempPathFactory):
    """A bootstrap node and two honest servers in this process (their records are under test, not their
    process: two interpreter start-ups less); `swarm.honest` holds the servers."""
    with bootstrapped(tmp_path_factory.mktemp("swarm")) as swarm:
        spans = [(model_path, blocks) for blocks in ("0:2", "2:4")]
        cache_dir = tmp_path_factory.mktemp("cache")
        with inprocess_servers(spans, cache_dir, swarm.initial_peers) as servers:
            swarm.honest = servers
            yield swarm


@pytest.fixture(scope="module")
def attacker(swarm):
    """A DHT node with no record validators: it stores whatever it is sent, and writes whatever it likes."""
    kwargs = SwarmConfig(initial_peers=swarm.initial_peers, startup_timeout_s=30).dht_kwargs()
    install_bounded_storage()  # (the servers' create_dht did): the stock node below gets hivemind's own storage back
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DHTLocalStorage, "store_subkey", DHTLocalStorage.store_subkey.__wrapped__)
        dht = hivemind.DHT(start=True, **kwargs)
    try:
        yield dht
    finally:
        dht.shutdown()
        dht.join(5)


@pytest.fixture(scope="module")
def reader(swarm):
    dht = create_dht(SwarmConfig(initial_peers=swarm.initial_peers, client_mode=True, startup_timeout_s=30))
    try:
        yield dht
    finally:
        shutdown_dht(dht)


@pytest.fixture(scope="module")
def expected(model_path):
    return hf_greedy(model_path, PROMPT, NEW_TOKENS)


def _store(dht: hivemind.DHT, key: str, value, expiration_time: float, subkey=None) -> bool:
    future = dht.store(key, value, expiration_time=expiration_time, subkey=subkey, return_future=True)
    return bool(call_with_timeout(future, TIMEOUT_S, f"attacker.store({key})"))


def _generate(swarm: Swarm, model_path) -> torch.Tensor:
    config = ClientConfig(max_retries=1, min_backoff_s=0.2, update_period_s=5.0)
    with AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm.initial_peers, client_config=config
    ) as model:
        return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)


def _states(reader, prefix: str) -> list[dict[str, ServerState]]:
    uids = [make_uid(prefix, i) for i in range(NUM_LAYERS)]
    infos = get_remote_module_infos(reader, uids, latest=True, timeout_s=TIMEOUT_S)
    return [{peer: server.state for peer, server in info.servers.items()} for info in infos]


def test_forged_records_change_nothing_a_corolla_client_does(swarm, model_path, attacker, reader, expected):
    prefix = model_path.name
    honest = {s.peer_id: s.block_indices for s in swarm.honest}  # peer id -> range of its blocks
    assert all(state == ServerState.ONLINE for block in _states(reader, prefix) for state in block.values())
    far = time.time() + 3600  # later than any honest re-announcement

    # 1. OFFLINE under every honest server's peer id, on every block it serves (Petals' unsigned layout)
    for peer, span in honest.items():
        offline = ServerInfo(state=ServerState.OFFLINE, throughput=1.0, start_block=span.start, end_block=span.stop)
        for i in span:
            assert _store(attacker, make_uid(prefix, i), offline.to_tuple(), far, subkey=peer)
    # 2. under each honest server's signed key: an OFFLINE record signed with the attacker's own key, and junk
    forger = RecordSigner.generate()
    for peer, span in honest.items():
        fake = ServerInfo(state=ServerState.OFFLINE, throughput=1.0, start_block=span.start, end_block=span.stop)
        _, _, value = sign_server_record(forger, prefix, fake, ModelInfo(num_blocks=NUM_LAYERS), far)
        key = signed_record_key(prefix, peer)
        _store(attacker, key, value, far, subkey=key)  # stored at the attacker's node only: others refuse it
    # 3. garbage: made-up peer ids and junk values under the block keys, a junk model index entry
    for i in range(NUM_LAYERS):
        assert _store(attacker, make_uid(prefix, i), b"\xc1junk", far, subkey="not-a-peer-id")
        assert _store(
            attacker, make_uid(prefix, i), (9, "x"), far, subkey="QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
        )
    assert _store(attacker, MODELS_INDEX_KEY, {"num_blocks": 10**7}, far, subkey=prefix)

    # the unsigned view (what stock Petals readers see) is forged: the attack reached the DHT
    raw = get_remote_module_infos(reader, [make_uid(prefix, 0)], latest=True, timeout_s=TIMEOUT_S, max_signed_lookups=0)
    assert raw[0].servers[next(iter(honest))].state == ServerState.OFFLINE
    # corolla readers believe each honest server's own signed record
    for i, block in enumerate(_states(reader, prefix)):
        expected_peers = {peer for peer, span in honest.items() if i in span}
        assert {p for p, s in block.items() if s == ServerState.ONLINE} == expected_peers
    assert get_verified_model_infos(reader, timeout_s=TIMEOUT_S)[prefix].num_blocks == NUM_LAYERS
    # ... and so does the client: it routes through the honest servers and generates the same tokens
    assert torch.equal(_generate(swarm, model_path), expected)

    # 4. plain values with a later expiration would replace the whole index / a whole block key where accepted
    _store(attacker, MODELS_INDEX_KEY, "evicted", far + 10)
    _store(attacker, make_uid(prefix, 1), "evicted", far + 10)
    assert get_verified_model_infos(reader, timeout_s=TIMEOUT_S)[prefix].num_blocks == NUM_LAYERS
    with StateCollector(reader, config=HealthConfig(check_reachability=False, dht_timeout_s=TIMEOUT_S)) as health:
        assert health.wait_first_refresh(60)
        reports = {r["dht_prefix"]: r for r in health.state["model_reports"]}
    assert reports[prefix]["num_blocks"] == NUM_LAYERS and reports[prefix]["state"] == "healthy"
    assert torch.equal(_generate(swarm, model_path), expected)


def test_a_record_expiring_far_in_the_future_is_read_by_nobody(swarm, model_path, attacker, reader):
    """A ghost: an identity signs its own record (all blocks, 1e9 tokens/s) valid for ten years, stores it once and
    could leave: every reader would count it ONLINE for a decade (clients dial it, placement weighs its claim). Past
    `MAX_EXPIRATION_AHEAD_S` a record is ignored by readers, signed or not; one within it is read (the control)."""
    prefix = model_path.name
    uids = [make_uid(prefix, i) for i in range(NUM_LAYERS)]
    claim = ServerInfo(state=ServerState.ONLINE, throughput=1e9, start_block=0, end_block=NUM_LAYERS)
    ghost, control = RecordSigner.generate(), RecordSigner.generate()
    for signer, expiration in ((ghost, time.time() + 10 * 365 * 86400), (control, time.time() + 60)):
        key, subkey, value = sign_server_record(signer, prefix, claim, ModelInfo(num_blocks=NUM_LAYERS), expiration)
        # corolla nodes refuse the ghost's records, signed (validator) and unsigned (swarm.bounded_storage); the
        # attacker's own stock node keeps them, as any node of a Petals swarm would, and readers skip them
        assert _store(attacker, key, value, expiration, subkey=subkey) == (signer is control)
        for uid in uids:
            _store(attacker, uid, claim.to_tuple(), expiration, subkey=signer.peer_id)
        held = call_with_timeout(attacker.get(uids[0], latest=True, return_future=True), TIMEOUT_S, "attacker.get")
        assert signer.peer_id in held.value  # in the DHT (at the attacker's node at least): readers must skip it
    for max_signed_lookups in (1024, 0):  # the corolla view and the unsigned (Petals) one
        infos = get_remote_module_infos(
            reader, uids, latest=True, timeout_s=TIMEOUT_S, max_signed_lookups=max_signed_lookups
        )
        assert all(control.peer_id in info.servers for info in infos)
        assert not any(ghost.peer_id in info.servers for info in infos)
