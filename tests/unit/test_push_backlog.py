"""A server's pushes of a session's outputs to the next server (`InferenceStreams.schedule_push`): a downstream peer
that holds its answers to `rpc_push` (an honest one answers at once: it only queues the step) no longer makes the
upstream hold a task, the step's bytes and a stream per step for `request_timeout_s`: at most `PUSH_IN_FLIGHT_MAX`
pushes of a session wait, the rest are left out (the client sends every server its own copy of each step)."""

from __future__ import annotations

import asyncio
import types

import pytest
import torch
from hivemind.proto import runtime_pb2

from corolla.protocol import rpc
from corolla.protocol.metadata import InferenceRequestMetadata
from corolla.server.front.block_functions import ServingLimits
from corolla.server.front.inference_stream import PUSH_IN_FLIGHT_MAX, InferenceStreams

UPSTREAM = "QmPeer1111111111111111111111111111111111111111"
DOWNSTREAM = "QmPeer2222222222222222222222222222222222222222"


class HoldingStub:
    """A downstream peer's stub that holds every `rpc_push` answer until `release` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = asyncio.Event()

    async def rpc_push(self, request: runtime_pb2.ExpertRequest, timeout: float | None = None) -> None:
        self.calls += 1
        await self.release.wait()


def _streams() -> InferenceStreams:
    streams = InferenceStreams.__new__(InferenceStreams)
    streams.p2p = types.SimpleNamespace(peer_id=types.SimpleNamespace(to_base58=lambda: UPSTREAM))  # type: ignore[assignment]
    streams.limits = ServingLimits("m", 0, 2, 8, torch.float32, 64, 64)
    streams.peer_auth = None
    streams.timeouts = types.SimpleNamespace(request_timeout_s=180.0)  # type: ignore[assignment]
    streams._push_tasks, streams._pushes_in_flight = set(), {}
    return streams


def _metadata(session_id: str, step: int) -> InferenceRequestMetadata:
    return InferenceRequestMetadata.from_dict(
        {"session_id": session_id, "step_id": f"step-{step}", "next_servers": [[DOWNSTREAM, "down", 2, 4]]}
    )


async def test_a_downstream_holding_its_push_answers_holds_a_bounded_number_of_them(monkeypatch: pytest.MonkeyPatch):
    """100 steps of one session pushed to a peer that never answers: on main 100 tasks and streams wait (for 180 s
    each); now `PUSH_IN_FLIGHT_MAX`. Another session's pushes are not held back by it, and once the peer answers the
    session pushes again."""
    stub = HoldingStub()
    monkeypatch.setattr(rpc.TransformerConnectionHandler, "get_stub", lambda p2p, peer_id: stub)
    streams = _streams()
    request, output = runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor()]), runtime_pb2.Tensor()
    for step in range(100):
        streams.schedule_push(request, output, _metadata("held", step))
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    assert stub.calls == PUSH_IN_FLIGHT_MAX and len(streams._push_tasks) == PUSH_IN_FLIGHT_MAX
    streams.schedule_push(request, output, _metadata("other", 0))
    await asyncio.sleep(0.01)
    assert stub.calls == PUSH_IN_FLIGHT_MAX + 1
    stub.release.set()
    await asyncio.sleep(0.01)
    assert not streams._push_tasks and not streams._pushes_in_flight
    streams.schedule_push(request, output, _metadata("held", 100))
    await asyncio.sleep(0.01)
    assert stub.calls == PUSH_IN_FLIGHT_MAX + 2
