"""A real server's prefix cache (in-process, tiny Llama, blocks 0:4) driven as a corolla client drives it: a session's
zero-token first step names its prefix (`corolla.prefix`) and is answered with the positions reused
(`corolla.prefix_hit`); the states from there on equal the local blocks' over the whole sequence; a rollback into
the reused pages recomputes them; another client identity reuses nothing, so a poisoned entry (states computed
wrongly under a key) never reaches another client's outputs unless the operator opted into sharing; metrics count
hits, cached bytes and evictions; a stock Petals session (no keys) gets no hit key."""

from __future__ import annotations

import pytest
import torch
from hivemind.compression.serialization import deserialize_torch_tensor
from hivemind.proto import runtime_pb2

from corolla.protocol.metadata import decode_metadata
from corolla.protocol.prefix import PREFIX_HIT_KEY, PREFIX_KEY, PrefixKeys, chain_hashes, prefix_root
from helpers.engine_reference import blocks_forward
from helpers.swarm import (
    ClientThread,
    InferenceStream,
    chain,
    connected_clients,
    packed_request,
    start_inprocess_server,
)
from helpers.tiny_models import HIDDEN_SIZE as HIDDEN

NUM_BLOCKS = 4
MAX_LENGTH = 128

pytestmark = pytest.mark.timeout(240)


def start(model_path, cache_dir, **overrides):
    settings = dict(
        block_indices=(0, NUM_BLOCKS), inference_max_length_tokens=MAX_LENGTH, attn_cache_tokens=8 * MAX_LENGTH,
        session_timeout_s=60.0, request_timeout_s=30.0, metrics_port=0,
    )  # fmt: skip
    return start_inprocess_server(model_path, cache_dir, **{**settings, **overrides})


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory: pytest.TempPathFactory):
    server = start(model_path, tmp_path_factory.mktemp("cache"))
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def shared_server(model_path, tmp_path_factory: pytest.TempPathFactory):
    server = start(model_path, tmp_path_factory.mktemp("cache_shared"), prefix_cache_shared=True)
    yield server
    server.shutdown()


TOKENS = list(range(5, 5 + 80))
ROOT = prefix_root(model="tiny-llama")


def keys(tokens: list[int], first_block: int = 0) -> dict:
    return PrefixKeys(first_block, tuple(chain_hashes(ROOT, tokens)[first_block:])).to_wire()


class Session:
    """One inference session of `client` on `server` over all its blocks."""

    def __init__(self, client: ClientThread, server, **open_metadata):
        self.uid = chain(server, 0, NUM_BLOCKS)
        self.stream = InferenceStream(client, server.peer_id).open()
        self.open_metadata = {"max_length": MAX_LENGTH, **open_metadata}

    def request(self, hidden: torch.Tensor, **metadata) -> runtime_pb2.ExpertResponse:
        metadata = {**self.open_metadata, **metadata}
        self.open_metadata = {}
        request = packed_request(self.uid, hidden, torch.empty(0), torch.empty(0, dtype=torch.int64), **metadata)
        return self.stream.step(request)

    def probe(self, tokens: list[int]) -> int:
        response = self.request(torch.zeros(1, 0, HIDDEN), **{PREFIX_KEY: keys(tokens)})
        assert deserialize_torch_tensor(response.tensors[0]).shape == (1, 0, HIDDEN)
        return decode_metadata(response.metadata)[PREFIX_HIT_KEY]

    def step(self, hidden: torch.Tensor, start: int, **metadata) -> torch.Tensor:
        response = self.request(hidden, start_from_position=start, **metadata)
        return deserialize_torch_tensor(response.tensors[0])

    def close(self) -> None:
        self.stream.close()


def metric(server, name: str) -> float:
    for line in server.metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


@pytest.fixture(scope="module")
def alice(server):
    with connected_clients(server, 1) as (client,):
        yield client


@pytest.fixture(scope="module")
def mallory(server):
    with connected_clients(server, 1) as (client,):
        yield client


def test_a_later_session_of_the_same_client_reuses_its_prefix(server, alice, blocks) -> None:
    torch.manual_seed(1)
    hidden = torch.randn(1, 80, HIDDEN)
    expected = blocks_forward(blocks, hidden)
    hits_before = metric(server, "corolla_prefix_hit_tokens_total")

    turn1 = Session(alice, server)
    assert turn1.probe(TOKENS[:40]) == 0  # nothing cached yet
    out = turn1.step(hidden[:, :40], 0)
    torch.testing.assert_close(out, expected[:, :40], atol=1e-4, rtol=0)
    for p in range(40, 50):  # generated tokens: their blocks are keyed as they become known
        extra = {PREFIX_KEY: keys(TOKENS[:48], first_block=2)} if p == 47 else {}
        out = turn1.step(hidden[:, p : p + 1], p, **extra)
        torch.testing.assert_close(out, expected[:, p : p + 1], atol=1e-4, rtol=0)
    turn1.close()
    assert metric(server, "corolla_prefix_cache_bytes") > 0

    turn2 = Session(alice, server)
    assert turn2.probe(TOKENS) == 48  # three whole 16-token pages
    out = turn2.step(hidden[:, 48:], 48)
    torch.testing.assert_close(out, expected[:, 48:], atol=1e-4, rtol=0)
    # a rollback into the reused pages (another server of the chain held less) recomputes them the same
    out = turn2.step(hidden[:, 20:], 20)
    torch.testing.assert_close(out, expected[:, 20:], atol=1e-4, rtol=0)
    turn2.close()
    assert metric(server, "corolla_prefix_hit_tokens_total") == hits_before + 48

    turn3 = Session(alice, server)  # the cached copies survived the rollback; turn 2's later pages are cached too
    assert turn3.probe(TOKENS) == 80
    torch.testing.assert_close(turn3.step(hidden[:, 72:], 72), expected[:, 72:], atol=1e-4, rtol=0)
    turn3.close()


def poison(server, client: ClientThread, tokens: list[int]) -> None:
    """Publishes states computed from garbage under the keys of `tokens`."""
    session = Session(client, server)
    assert session.probe(tokens) in (0, len(tokens) // 16 * 16)
    session.step(torch.randn(1, len(tokens), HIDDEN) * 5, 0)
    session.close()


def test_a_poisoned_entry_never_reaches_another_client(server, alice, mallory, blocks) -> None:
    torch.manual_seed(2)
    tokens = [t + 1000 for t in TOKENS]
    hidden = torch.randn(1, 80, HIDDEN)
    expected = blocks_forward(blocks, hidden)
    poison(server, mallory, tokens)
    victim = Session(alice, server)
    assert victim.probe(tokens) == 0  # mallory's pages are not alice's to reuse
    torch.testing.assert_close(victim.step(hidden, 0), expected, atol=1e-4, rtol=0)
    victim.close()
    again = Session(mallory, server)  # mallory's own sessions do reuse them: a liar harms only itself
    assert again.probe(tokens) == 80
    again.close()


def test_sharing_is_the_operators_opt_in(shared_server, blocks) -> None:
    torch.manual_seed(3)
    first, second = (ClientThread(shared_server.join_maddrs, shared_server.peer_id) for _ in range(2))
    try:
        poison(shared_server, first, TOKENS)
        other = Session(second, shared_server)
        assert other.probe(TOKENS) == 80  # another client reuses it here: what the trust rule prevents by default
        hidden = torch.randn(1, 80, HIDDEN)
        assert not torch.allclose(other.step(hidden[:, 79:], 79), blocks_forward(blocks, hidden)[:, 79:], atol=1e-2)
        other.close()
    finally:
        first.close()
        second.close()


def test_a_stock_petals_session_gets_no_hit_key(server, alice, blocks) -> None:
    session = Session(alice, server)
    response = session.request(torch.randn(1, 3, HIDDEN))  # Petals: tokens in the first step, no keys
    assert PREFIX_HIT_KEY not in (decode_metadata(response.metadata) if response.metadata else {})
    zero = Session(alice, server)
    response = zero.request(torch.zeros(1, 0, HIDDEN))  # a keep-alive without keys
    assert not response.metadata or PREFIX_HIT_KEY not in decode_metadata(response.metadata)
    session.close()
    zero.close()


def test_malformed_keys_are_refused(server, alice) -> None:
    session = Session(alice, server)
    with pytest.raises(Exception, match="corolla.prefix"):
        session.request(torch.zeros(1, 0, HIDDEN), **{PREFIX_KEY: {"first": 0, "hashes": [b"short"]}})
    session.stream.abort()


def test_handler_processes_reuse_the_prefix_too(model_path, tmp_path_factory, blocks) -> None:
    """`--num_handlers 2`: the keys cross to the device process (attach a request, recorded keys one-way frames)."""
    server = start(model_path, tmp_path_factory.mktemp("cache_handlers"), num_handlers=2)
    client = ClientThread(server.join_maddrs, server.peer_id)
    try:
        torch.manual_seed(4)
        hidden = torch.randn(1, 40, HIDDEN)
        expected = blocks_forward(blocks, hidden)
        first = Session(client, server)
        assert first.probe(TOKENS[:16]) == 0
        first.step(hidden, 0, **{PREFIX_KEY: keys(TOKENS[:40], first_block=1)})
        first.close()
        second = Session(client, server)
        assert second.probe(TOKENS[:40]) == 32
        torch.testing.assert_close(second.step(hidden[:, 32:], 32), expected[:, 32:], atol=1e-4, rtol=0)
        second.close()
        assert metric(server, "corolla_prefix_hit_tokens_total") == 32  # counted in the device process
        assert metric(server, "corolla_prefix_cache_bytes") > 0
    finally:
        client.close()
        server.shutdown()


def test_handler_processes_share_prefixes_where_the_operator_says(model_path, tmp_path_factory, blocks) -> None:
    """`--num_handlers 2 --prefix_cache_shared`: every front is built from the same settings, so the handler
    processes' fronts share prefixes across clients as the one-process front does (they once ignored the flag)."""
    server = start(
        model_path, tmp_path_factory.mktemp("cache_handlers_shared"), num_handlers=2, prefix_cache_shared=True
    )
    first, second = (ClientThread(server.join_maddrs, server.peer_id) for _ in range(2))
    try:
        torch.manual_seed(6)
        hidden = torch.randn(1, 40, HIDDEN)
        opening = Session(first, server)
        assert opening.probe(TOKENS[:16]) == 0
        opening.step(hidden, 0, **{PREFIX_KEY: keys(TOKENS[:40])})
        opening.close()
        other = Session(second, server)  # another client: it reuses the pages only because the operator shares them
        assert other.probe(TOKENS[:40]) == 32
        torch.testing.assert_close(other.step(hidden[:, 32:], 32), blocks_forward(blocks, hidden)[:, 32:], atol=1e-4,
                                   rtol=0)  # fmt: skip
        other.close()
    finally:
        first.close()
        second.close()
        server.shutdown()


def test_under_memory_pressure_cached_pages_go_first_and_live_sessions_keep_theirs(
    model_path, tmp_path_factory, blocks
):
    """A cache for a few conversations and many more replayed: no refusal, evictions counted, the hit rate reported,
    every output right, and a session open all along keeps its pages."""
    server = start(model_path, tmp_path_factory.mktemp("cache_small"), attn_cache_tokens=4 * MAX_LENGTH)  # 32 pages
    client = ClientThread(server.join_maddrs, server.peer_id)
    try:
        torch.manual_seed(5)
        live_hidden = torch.randn(1, 41, HIDDEN)
        live = Session(client, server)
        assert live.probe(TOKENS[:40]) == 0
        live.step(live_hidden[:, :40], 0)  # holds its 8 promised pages while the conversations below come and go
        conversations = [([1000 * (i + 1) + t for t in range(64)], torch.randn(1, 64, HIDDEN)) for i in range(10)]
        for tokens, hidden in conversations:  # turn 1 of each: 4 pages published, the oldest evicted for the next
            session = Session(client, server)
            assert session.probe(tokens[:48]) == 0
            session.step(hidden[:, :48], 0, **{PREFIX_KEY: keys(tokens)})
            session.close()
        hits = []
        for tokens, hidden in reversed(conversations):  # turn 2, most recent first: the recent ones are still cached
            session = Session(client, server)
            hit = session.probe(tokens)
            hits.append(hit)
            out = session.step(hidden[:, hit:], hit) if hit < 64 else session.step(hidden[:, 48:], 48)
            start_at = min(hit, 48)
            torch.testing.assert_close(out, blocks_forward(blocks, hidden)[:, start_at:], atol=1e-4, rtol=0)
            session.close()
        assert hits[0] == 48 and 0 in hits  # the latest conversation hit, the oldest ones were evicted
        assert metric(server, "corolla_prefix_cache_evictions") > 0
        assert metric(server, "corolla_prefix_cache_limit_bytes") == -1  # no --prefix_cache_tokens: no cap
        assert metric(server, "corolla_prefix_hit_tokens_total") == sum(hits)
        assert metric(server, "corolla_prefix_keyed_tokens_total") == 10 * 48 + 10 * 64 + 32  # whole blocks
        expected = blocks_forward(blocks, live_hidden)
        torch.testing.assert_close(live.step(live_hidden[:, 40:], 40), expected[:, 40:], atol=1e-4, rtol=0)
        live.close()
    finally:
        client.close()
        server.shutdown()
