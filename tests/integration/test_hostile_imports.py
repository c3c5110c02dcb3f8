"""A KV hand-off import from a hostile client, through a real server's same-host socket (`serve_steps`, as p2p and the
direct port serve it): a part message carrying more than its parts is refused with the session's error and nothing
held (the cache freed, the import budget given back), and the same import with honest part messages is taken; with
handler processes, the caps on imports in flight are the server's, not each process's."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch
from hivemind.p2p import P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.client.transport.framed_socket import MAX_RESPONSE_FRAME_BYTES
from corolla.client.transport.local_transport import LocalInferenceStream, responses_of
from corolla.protocol import handoff as wire
from corolla.protocol.codecs import serialize_tensor
from corolla.server.core import kv_handoff as kv
from corolla.server.core.executor import SessionSpec
from corolla.server.core.limits import PeerLimits
from helpers.swarm import (
    cache_used_bytes,
    chain,
    open_local_inference,
    packed_request,
    start_inprocess_server,
    wait_until,
)
from helpers.tiny_models import HIDDEN_SIZE as HIDDEN

NUM_BLOCKS = 4
MAX_LENGTH = 32
POSITION = 5

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory: pytest.TempPathFactory):
    server = start_inprocess_server(
        model_path, tmp_path_factory.mktemp("cache"), block_indices=(0, NUM_BLOCKS), step_timeout_s=5.0
    )
    yield server
    server.shutdown()


def _import(server, junk: bytes) -> list[runtime_pb2.ExpertRequest]:
    """A session opened with an import of `POSITION` tokens of zeros in the server's own layout; `junk` rides as
    metadata on every part message."""
    blocks = tuple(range(NUM_BLOCKS))
    layout = server.service.executor.handoff_layout(SessionSpec(blocks, 1, MAX_LENGTH))
    cache = [torch.zeros(shape, dtype=dtype) for shape, dtype in kv.expected_shapes(layout, POSITION)]
    messages = wire.pack_messages(serialize_tensor(t) for t in cache)
    header = wire.KvHeader(
        position=POSITION, batch_size=1, start_block=0, end_block=NUM_BLOCKS, num_messages=len(messages),
        total_bytes=sum(wire.message_bytes(m) for m in messages),
    )  # fmt: skip
    uid = chain(server, 0, NUM_BLOCKS)
    first = packed_request(
        uid, torch.zeros(1, 0, HIDDEN), torch.empty(0), torch.empty(0, dtype=torch.int64), session_id=str(uuid.uuid4()),
        step_id=str(uuid.uuid4()), max_length=MAX_LENGTH, start_from_position=POSITION,
        **{wire.IMPORT_KEY: header.to_dict()},
    )  # fmt: skip
    return [first] + [runtime_pb2.ExpertRequest(uid=uid, tensors=parts, metadata=junk) for parts in messages]


def _run_import(server, requests: list[runtime_pb2.ExpertRequest]):
    async def go():
        async def sent():
            for request in requests:
                yield request
            await asyncio.sleep(3600)  # the session stays open until the server answers or ends it

        responses = await open_local_inference(server.peer_id, sent(), timeout_s=5)
        assert responses is not None
        try:
            return await asyncio.wait_for(anext(responses), 30)
        finally:
            await responses.aclose()

    return asyncio.run(go())


def test_an_import_with_junk_in_its_part_messages_is_refused_and_holds_nothing(server):
    with pytest.raises(P2PHandlerError, match="KV import part messages hold nothing but"):
        _run_import(server, _import(server, junk=b"\x00" * (1 << 20)))
    handoff, imports = server.service.handler.handoff, server.service.core.imports
    assert wait_until(lambda: cache_used_bytes(server) == 0 and imports.total_bytes == 0, 5)
    assert handoff.num_imported == 0
    reply = _run_import(server, _import(server, junk=b""))  # the same import, honest: taken
    assert list(reply.tensors[0].size) == [1, 0, HIDDEN] and handoff.num_imported == 1
    assert wait_until(lambda: cache_used_bytes(server) == 0 and imports.per_peer == {}, 5)


async def _sent(requests: list[runtime_pb2.ExpertRequest]):
    for request in requests:
        yield request
    await asyncio.sleep(3600)  # the session stays open until the server answers or ends it


def test_import_caps_hold_per_server_across_handler_processes(server, model_path, tmp_path):
    """With `--num_handlers 2`, an import held back in one handler process (its header in, its parts not: its bytes
    held until they come) leaves an import in the other process only what `max_import_bytes_total` has left: refused
    at its header, then taken once the first is gone. (0148 counted the caps per front: each process took up to the
    whole cap, N times it per server.)"""
    requests = _import(server, junk=b"")  # (the one-process server's layout is the same model's)
    nbytes = sum(wire.message_bytes(r.tensors) for r in requests[1:])
    two = start_inprocess_server(
        model_path, tmp_path / "cache", block_indices=(0, NUM_BLOCKS), num_handlers=2, step_timeout_s=5.0,
        request_timeout_s=60.0, peer_limits=PeerLimits(max_kv_fraction_per_peer=1.0, max_import_bytes_total=nbytes * 3 // 2),
    )  # fmt: skip
    imports = two.service.core.imports  # the device process's count, every handler process's imports

    async def go():
        streams: list[LocalInferenceStream] = []
        while len({stream.path for stream in streams}) < 2 and len(streams) < 8:  # one on each process's socket
            stream = await LocalInferenceStream.open(two.peer_id, timeout_s=10)
            assert stream is not None and stream.path is not None
            streams.append(stream)
        first = streams[0]
        second = next(stream for stream in streams if stream.path != first.path)
        held_back = responses_of(first, _sent(_import(two, junk=b"")[:1]), MAX_RESPONSE_FRAME_BYTES)
        waiting = asyncio.ensure_future(anext(held_back))
        for _ in range(600):
            if imports.total_bytes == nbytes:
                break
            await asyncio.sleep(0.05)
        assert imports.total_bytes == nbytes, "the held-back import did not reach its header"
        refused = responses_of(second, _sent(_import(two, junk=b"")), MAX_RESPONSE_FRAME_BYTES)
        with pytest.raises(P2PHandlerError, match="max_import_bytes_total"):
            await asyncio.wait_for(anext(refused), 30)
        await refused.aclose()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await held_back.aclose()
        for stream in streams:
            stream.close()
        for _ in range(600):
            if imports.total_bytes == 0:
                break
            await asyncio.sleep(0.05)
        assert imports.total_bytes == 0 and imports.per_peer == {}
        again = await LocalInferenceStream.open(two.peer_id, timeout_s=10)
        assert again is not None
        taken = responses_of(again, _sent(_import(two, junk=b"")), MAX_RESPONSE_FRAME_BYTES)
        reply = await asyncio.wait_for(anext(taken), 30)
        await taken.aclose()
        return reply

    try:
        reply = asyncio.run(go())
        assert list(reply.tensors[0].size) == [1, 0, HIDDEN]
        assert wait_until(lambda: cache_used_bytes(two) == 0 and imports.total_bytes == 0, 10)
    finally:
        two.shutdown()
