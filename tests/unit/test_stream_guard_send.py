"""`stream_guard.send_message`: the bytes hivemind's `P2P.send_protobuf` writes (stock Petals clients read them), as
one write for a decode step's reply (one wake-up of p2pd per reply instead of three)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from corolla.protocol.codecs import serialize_tensor
from corolla.server import stream_guard


class _Writer:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes | memoryview) -> None:
        self.writes.append(bytes(data))

    async def drain(self) -> None:
        return None


def _sent(send, message) -> _Writer:
    writer = _Writer()
    asyncio.run(send(message, writer))
    return writer


def _reply(hidden: int) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(tensors=[serialize_tensor(torch.randn(1, 1, hidden))])


@pytest.mark.parametrize("message", [_reply(64), RPCError(message="refused: too long")], ids=["reply", "error"])
def test_a_step_reply_is_hivemind_framing_in_one_write(message):
    ours, theirs = _sent(stream_guard.send_message, message), _sent(P2P.send_protobuf, message)
    assert b"".join(ours.writes) == b"".join(theirs.writes)
    assert len(ours.writes) == 1 and len(theirs.writes) == 3


def test_a_large_reply_keeps_the_same_bytes_without_copying_its_body(monkeypatch):
    monkeypatch.setattr(stream_guard, "ONE_WRITE_MAX_BYTES", 1024)
    message = _reply(4096)  # 16 KiB body
    ours, theirs = _sent(stream_guard.send_message, message), _sent(P2P.send_protobuf, message)
    assert b"".join(ours.writes) == b"".join(theirs.writes)
    assert len(ours.writes) == 2 and len(ours.writes[0]) == 1 + P2P.HEADER_LEN
