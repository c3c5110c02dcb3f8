"""KV hoarding with cheap identities against one in-process server (loopback): 2, 8 and 32 identities (peer ids
cost nothing) keep opening sessions of the per-peer maximum and hold them with zero-token steps; a real user (a p2p
client of its own) must be admitted within a second, and an honest session generating throughout is never ended.
32 identities that do a little real work (a token every 2 s each) keep only the promise of their pace. Fails on a
server that reserves a session's whole length at open and lets holds without work keep it (the user is refused until
the hoarders stop), and on one that keeps a trickling session's whole promise (the user gets 1/33 of the cache)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch
from hivemind.p2p import PeerID

from benchmarks.field.hoarding import HoardingAttack
from helpers.swarm import (
    ClientThread,
    InferenceStream,
    chain,
    connected_clients,
    packed_request,
    start_inprocess_server,
    wait_until,
)
from helpers.tiny_models import HIDDEN_SIZE as HIDDEN
from helpers.tiny_models import make_tiny_model

NUM_BLOCKS = 4
MAX_LENGTH = 2048  # one session of MAX_LENGTH over all blocks: half of the cache, what one peer may hold
CACHE_TOKENS = 2 * MAX_LENGTH  # 256 pages of 16 tokens: each of 32 trickling sessions really holds 1 or 2
ADMIT_S = 1.0

pytestmark = [pytest.mark.timeout(180), pytest.mark.serial]  # its one-second target needs the CPU to itself


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_path = make_tiny_model("llama", tmp_path_factory.mktemp("models"))
    config_path = model_path / "config.json"  # room for MAX_LENGTH positions (rotary: any length; random inputs)
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "max_position_embeddings": MAX_LENGTH}))
    server = start_inprocess_server(
        model_path,
        tmp_path_factory.mktemp("cache"),
        block_indices=(0, NUM_BLOCKS),
        inference_max_length_tokens=MAX_LENGTH,
        max_batch_size_tokens=256,
        attn_cache_tokens=CACHE_TOKENS,
        step_timeout_s=60.0,  # the hoarders step every few seconds: far within both timeouts
        session_timeout_s=300.0,
        max_alloc_timeout_s=5.0,
    )  # default PeerLimits: session_idle_evict_s=60 never fires within the test
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def clients(server):
    """The real user and the honest long session's client: a libp2p identity each."""
    with connected_clients(server, 2) as pair:
        yield pair


class Attack:
    """A `HoardingAttack` running in the server's loop until `stop()`."""

    def __init__(self, server, identities: int, **options):
        self.loop = server._loop
        self.attack = HoardingAttack(
            server.service.handler, chain(server, 0, NUM_BLOCKS), PeerID.from_base58(server.peer_id),
            identities=identities, max_length=MAX_LENGTH, hidden_size=HIDDEN, **options,
        )  # fmt: skip
        self.stopping = asyncio.Event()
        self.done = asyncio.run_coroutine_threadsafe(self.attack.run(self.stopping), self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.done.result(30)


class HonestLongSession:
    """Generates one real token every 50 ms in a thread until stopped; any failure is kept."""

    def __init__(self, client: ClientThread, server, max_length: int):
        self.stream = InferenceStream(client).open()
        self.uid = chain(server, 0, NUM_BLOCKS)
        self.stream.step(packed_request(self.uid, torch.randn(1, 8, HIDDEN), max_length=max_length))
        self.position, self.max_length = 8, max_length
        self.failure: Exception | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stopping.is_set() and self.position < self.max_length:
                self.stream.step(packed_request(self.uid, torch.randn(1, 1, HIDDEN)))
                self.position += 1
                time.sleep(0.05)
        except Exception as e:
            self.failure = e

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(30)
        self.stream.close()


def admit_user(client: ClientThread, server, max_length: int) -> float:
    """A real user's session: opened with a 4-token prompt, 2 decode steps, closed; returns the seconds to its
    first reply (admission + prefill)."""
    stream = InferenceStream(client).open()
    uid = chain(server, 0, NUM_BLOCKS)
    started = time.monotonic()
    stream.step(packed_request(uid, torch.randn(1, 4, HIDDEN), max_length=max_length))
    admitted_s = time.monotonic() - started
    for _ in range(2):
        stream.step(packed_request(uid, torch.randn(1, 1, HIDDEN)))
    stream.close()
    return admitted_s


def cache_free(server) -> int:
    return server.service.executor.bytes_left


@pytest.mark.parametrize("identities", [2, 8, 32])
def test_zero_token_hoarders_do_not_keep_a_real_user_out(server, clients, identities: int):
    user, honest_client = clients
    full = cache_free(server)
    honest = HonestLongSession(honest_client, server, MAX_LENGTH // 2)  # a quarter of the cache, generating
    attack = Attack(server, identities, keepalive_s=0.5)
    try:
        assert wait_until(lambda: cache_free(server) < full // 2, 10)  # the hoarders hold what they can get
        time.sleep(1.0)
        for _ in range(3):
            admitted_s = admit_user(user, server, MAX_LENGTH)  # half of the cache: the most one peer may hold
            assert admitted_s < ADMIT_S, f"admitted after {admitted_s:.2f} s with {identities} identities hoarding"
            time.sleep(0.3)
        assert honest.failure is None, f"the honest session was ended: {honest.failure}"
        assert attack.attack.stats.opened >= 1 and attack.attack.stats.ended >= 1  # they held, then yielded
    finally:
        attack.stop()
        honest.stop()
    assert honest.failure is None
    assert wait_until(lambda: cache_free(server) == full, 10)


def test_trickle_hoarders_keep_only_the_promise_of_their_pace(server, clients):
    """32 identities each holding a session of half of the cache and sending one real token every 2 s (working
    sessions, never idle): a real user asking for half of the cache is admitted within a second, 3 times of 3; the
    trickling sessions keep running on the pages they hold (none is ended), and an honest session generating
    throughout (opened first, an eighth of the cache) is never harmed."""
    user, honest_client = clients
    full = cache_free(server)
    honest = HonestLongSession(honest_client, server, MAX_LENGTH // 4)
    attack = Attack(server, 32, keepalive_s=2.0, tokens_per_step=1)
    try:
        wait_until(lambda: attack.attack.stats.opened >= 32, 15)  # (a server that keeps promises admits 2)
        time.sleep(2.5)  # every one of them has stepped a token since
        for _ in range(3):
            admitted_s = admit_user(user, server, MAX_LENGTH)
            assert admitted_s < ADMIT_S, f"admitted after {admitted_s:.2f} s with 32 identities trickling"
            time.sleep(0.3)
        assert attack.attack.stats.ended == 0  # nobody doing real work was ended to make room
        assert honest.failure is None, f"the honest session was ended: {honest.failure}"
    finally:
        attack.stop()
        honest.stop()
    assert honest.failure is None
    assert wait_until(lambda: cache_free(server) == full, 10)
