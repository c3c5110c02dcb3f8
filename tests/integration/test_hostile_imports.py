"""A KV hand-off import from a hostile client, through a real server's same-host socket (`serve_steps`, as p2p and the
direct port serve it): a part message carrying more than its parts is refused with the session's error and nothing
held (the cache freed, the import budget given back), and the same import with honest part messages is taken."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch
from hivemind.p2p import P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.protocol import handoff as wire
from corolla.protocol.codecs import serialize_tensor
from corolla.server.core import kv_handoff as kv
from corolla.server.core.executor import SessionSpec
from helpers.swarm import (
    cache_used_bytes,
    chain,
    open_local_inference,
    packed_request,
    start_inprocess_server,
    wait_until,
)

HIDDEN = 64
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
    handoff = server.service.handler.handoff
    assert wait_until(lambda: cache_used_bytes(server) == 0 and handoff.imports.total_bytes == 0, 5)
    assert handoff.num_imported == 0
    reply = _run_import(server, _import(server, junk=b""))  # the same import, honest: taken
    assert list(reply.tensors[0].size) == [1, 0, HIDDEN] and handoff.num_imported == 1
    assert wait_until(lambda: cache_used_bytes(server) == 0 and handoff.imports.per_peer == {}, 5)
