"""Hostile peers against one in-process server (loopback swarm): KV hoarding by one peer and by several idle ones,
streams that stall mid-message, trickle a message or declare huge messages, re-sent steps, and long forwards split
into chunks.
Each test fails on a server without the limits in `server/core/limits.py` (hoarders keep the cache, stalled bytes stay
buffered until request_timeout, a re-sent step gets no answer)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
import torch
from hivemind.compression.serialization import deserialize_torch_tensor
from hivemind.p2p import P2P, P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.server.core.limits import MiB, PeerLimits
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
CACHE_TOKENS_PER_BLOCK = 128
MAX_LENGTH = 64  # one session of MAX_LENGTH over all blocks = half of the cache
IDLE_EVICT_S = 1.0
STREAM_IDLE_S = 1.0

pytestmark = [pytest.mark.timeout(120), pytest.mark.serial]  # its latency ratios need the CPU to itself

LIMITS = PeerLimits(
    max_kv_fraction_per_peer=0.5,
    session_idle_evict_s=IDLE_EVICT_S,
    stream_idle_timeout_s=STREAM_IDLE_S,
    min_stream_rate_kib_s=64,  # a message may take 1 s + its bytes at 64 KiB/s
    min_stream_rate_grace_s=1.0,
    max_stream_message_bytes=8 * MiB,
    max_stream_bytes_per_peer=20 * MiB,
    max_stream_bytes_total=40 * MiB,
    forward_chunk_tokens=16,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_path = make_tiny_model("llama", tmp_path_factory.mktemp("models"))
    server = start_inprocess_server(
        model_path,
        tmp_path_factory.mktemp("cache"),
        block_indices=(0, NUM_BLOCKS),
        inference_max_length_tokens=MAX_LENGTH,
        max_batch_size_tokens=256,
        attn_cache_tokens=CACHE_TOKENS_PER_BLOCK,
        step_timeout_s=60.0,  # hoarders would keep their cache for a minute without the limits
        session_timeout_s=120.0,
        request_timeout_s=30.0,
        max_alloc_timeout_s=0.5,
        peer_limits=LIMITS,
    )
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def peers(server):
    """Three clients, each its own libp2p identity (peer id)."""
    with connected_clients(server, 3) as clients:
        yield clients


def open_session(client: ClientThread, server, *, tokens: int = 1, max_length: int = MAX_LENGTH) -> InferenceStream:
    stream = InferenceStream(client).open()
    stream.step(packed_request(chain(server, 0, NUM_BLOCKS), torch.randn(1, tokens, HIDDEN), max_length=max_length))
    return stream


def keepalive(stream: InferenceStream, server) -> runtime_pb2.ExpertResponse:
    return stream.step(packed_request(chain(server, 0, NUM_BLOCKS), torch.randn(1, 0, HIDDEN)))


def cache_free(server) -> int:
    return server.service.executor.bytes_left


def test_one_peer_cannot_hoard_the_cache(server, peers):
    attacker, victim, _ = peers
    full = cache_free(server)
    first = open_session(attacker, server)
    with pytest.raises(P2PHandlerError, match="max_kv_fraction_per_peer"):
        open_session(attacker, server)  # a second half of the cache for the same peer
    assert cache_free(server) == full // 2
    honest = open_session(victim, server)  # the other half stays for others, at once
    assert cache_free(server) == 0
    for stream in (first, honest):
        stream.close()
    assert wait_until(lambda: cache_free(server) == full, 5)


def test_idle_hoarders_are_evicted_for_a_new_user(server, peers):
    """Two peers hold the whole cache and send only zero-token keep-alives; a third peer still gets a session
    (the longest-idle hoarder is ended with a clear error) instead of being refused for minutes."""
    sybil_a, sybil_b, victim = peers
    full = cache_free(server)
    hoarders = [open_session(sybil_a, server), open_session(sybil_b, server)]
    assert cache_free(server) == 0
    deadline = time.monotonic() + IDLE_EVICT_S + 0.5
    while time.monotonic() < deadline:  # keep-alives do not count as use
        for stream in hoarders:
            keepalive(stream, server)
        time.sleep(0.2)
    started = time.monotonic()
    honest = open_session(victim, server)
    assert time.monotonic() - started < 5
    ended = 0
    for stream in hoarders:
        try:
            keepalive(stream, server)
        except P2PHandlerError as e:
            assert "Session ended by the server" in str(e)
            ended += 1
    assert ended == 1  # one idle hoarder was enough to make room
    assert 'reason="evicted"} 1.0' in server.metrics.render().decode()
    honest.close()
    for stream in hoarders:
        stream.close()
    assert wait_until(lambda: cache_free(server) == full, 5)


async def _raw_stream(client: ClientThread, name: str, payload: bytes) -> tuple[bytes, float]:
    """Opens a raw stream to `name`, writes `payload`, then sends nothing more; returns the server's first reply
    marker byte (b"" if it closed without one) and the seconds it took."""
    _, reader, writer = await client.p2p.call_binary_stream_handler(client.peer_id, name)
    started = time.monotonic()
    writer.write(payload)
    await writer.drain()
    try:
        marker = await asyncio.wait_for(reader.read(1), 20)
    finally:
        writer.close()
    return marker, time.monotonic() - started


def _header(length: int) -> bytes:
    return P2P.MESSAGE_MARKER + length.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)


def test_stalled_stream_is_released_after_the_idle_timeout(server, peers):
    attacker = peers[0]
    budget = server.service.handler.stream_budget
    name = "TransformerConnectionHandler.rpc_forward_stream"
    # declares 6 MiB, sends 1 MiB of it, then goes silent (but stays connected)
    result: dict = {}

    def attack() -> None:
        result["reply"] = attacker.call(_raw_stream(attacker, name, _header(6 * MiB) + b"\0" * MiB), 30)

    thread = threading.Thread(target=attack)
    thread.start()
    assert wait_until(lambda: budget.total_bytes == 6 * MiB, 5)  # charged before buffering
    thread.join(30)
    marker, seconds = result["reply"]
    assert marker == P2P.ERROR_MARKER  # told why, not just cut
    assert STREAM_IDLE_S * 0.8 <= seconds < STREAM_IDLE_S + 5  # not request_timeout (30 s)
    assert wait_until(lambda: budget.total_bytes == 0 and not budget.per_peer, 5)
    assert 'reason="stream_stalled"' in server.metrics.render().decode()


def test_a_trickled_message_is_refused_at_the_minimum_rate(server, peers):
    """A byte every 0.2 s (each inside the 1 s idle timeout) of a declared 64 KiB: held for as long as the peer kept
    trickling (its 64 KiB charged all along); now refused once 1 s + 64 KiB at 64 KiB/s are over."""
    attacker = peers[0]
    budget = server.service.handler.stream_budget
    name = "TransformerConnectionHandler.rpc_forward_stream"

    async def trickle() -> tuple[bytes, float]:
        _, reader, writer = await attacker.p2p.call_binary_stream_handler(attacker.peer_id, name)
        started = time.monotonic()
        writer.write(_header(64 * 1024) + b"\0" * 1024)

        async def drip() -> None:
            while True:
                await asyncio.sleep(0.2)
                writer.write(b"\0")
                await writer.drain()

        dripping = asyncio.ensure_future(drip())
        try:
            marker = await asyncio.wait_for(reader.read(1), 20)
        finally:
            dripping.cancel()
            writer.close()
        return marker, time.monotonic() - started

    marker, seconds = attacker.call(trickle(), 30)
    assert marker == P2P.ERROR_MARKER and seconds < 10  # told why, within the pace (2 s) and the machine's slack
    assert wait_until(lambda: budget.total_bytes == 0 and not budget.per_peer, 5)
    assert 'reason="stream_too_slow"' in server.metrics.render().decode()


def test_declared_sizes_are_refused_before_buffering(server, peers):
    attacker = peers[0]
    budget = server.service.handler.stream_budget
    name = "TransformerConnectionHandler.rpc_inference"
    marker, seconds = attacker.call(_raw_stream(attacker, name, _header(2**40) + b"\0" * 1024), 30)
    assert marker == P2P.ERROR_MARKER and seconds < 5  # refused at the header: max_stream_message_bytes
    # many streams of one peer, each within the message limit, hit the per-peer budget
    name = "TransformerConnectionHandler.rpc_forward_stream"

    async def flood() -> list:
        return await asyncio.gather(
            *(_raw_stream(attacker, name, _header(7 * MiB) + b"\0" * 1024) for _ in range(4)), return_exceptions=True
        )

    replies = attacker.call(flood(), 40)
    assert all(isinstance(r, tuple) and r[0] == P2P.ERROR_MARKER for r in replies)
    assert budget.per_peer.get(attacker.p2p.peer_id.to_base58(), 0) == 0 and budget.total_bytes == 0
    text = server.metrics.render().decode()
    assert 'reason="stream_message_too_big"' in text and 'reason="peer_stream_bytes"' in text


def test_resent_step_is_answered(server, peers):
    client = peers[1]
    stream = InferenceStream(client).open()
    uid = chain(server, 0, NUM_BLOCKS)
    step_id = str(uuid.uuid4())
    request = packed_request(uid, torch.randn(1, 3, HIDDEN), max_length=16, step_id=step_id)
    first = stream.step(request)
    started = time.monotonic()
    again = stream.step(request, timeout_s=10)  # was: no answer at all, the client waited for its timeout
    assert time.monotonic() - started < 5
    assert torch.equal(deserialize_torch_tensor(first.tensors[0]), deserialize_torch_tensor(again.tensors[0]))
    follow = stream.step(packed_request(uid, torch.randn(1, 1, HIDDEN), step_id=str(uuid.uuid4())))
    assert deserialize_torch_tensor(follow.tensors[0]).shape == (1, 1, HIDDEN)  # the session went on at position 3
    stream.close()


def test_long_forward_runs_in_chunks_with_the_same_result(server, peers):
    client = peers[2]
    torch.manual_seed(5)
    hidden = torch.randn(1, 40, HIDDEN)
    runtime = server.service.runtime
    before = runtime.num_tasks_done

    async def forward(stub):
        return await stub.rpc_forward(packed_request(chain(server, 0, NUM_BLOCKS), hidden), timeout=30)

    response = client.run(forward)
    tasks = runtime.num_tasks_done - before
    assert tasks == NUM_BLOCKS * 3  # 40 tokens in chunks of 16: 3 tasks per block, each queued on its own
    backend = server.service.executor.backend  # the plain executor's blocks (a CPU server serves the plain path)
    expected = backend.forward(list(range(NUM_BLOCKS)), hidden)
    torch.testing.assert_close(deserialize_torch_tensor(response.tensors[0]), expected, atol=5e-6, rtol=0)
