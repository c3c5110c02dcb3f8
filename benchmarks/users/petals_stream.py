"""One `rpc_inference` stream as a stock Petals client drives it (hivemind stub: an async generator fed by a queue;
over the same-host socket a `LocalInferenceStream` driven the same way by `responses_of`), shared by the RPC and
many-users benches."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import torch

from corolla.client.transport.framed_socket import MAX_RESPONSE_FRAME_BYTES
from corolla.client.transport.local_transport import LocalInferenceStream, responses_of

BUSY_POLL_S = 0.02  # as ClientConfig(busy_poll_ms=20)


class PetalsStream:
    """One `rpc_inference` stream as a stock Petals client drives it (session metadata, start_from_position)."""

    def __init__(self, stub: Any, chain: str, max_length: int, local_peer_id: str | None = None, poller: Any = None):
        self.stub, self.chain, self.max_length = stub, chain, max_length
        self.poller = poller  # a BusyPollSelector kept hot while a step is in flight (ClientConfig.busy_poll_ms)
        self.local_peer_id = local_peer_id  # set: open over the server's unix socket instead of p2p
        self.session_id = str(uuid.uuid4())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.responses: Any = None
        self.first = True

    async def open(self) -> PetalsStream:
        async def requests():
            while True:
                item = await self.queue.get()
                if item is None:
                    return
                yield item

        if self.local_peer_id is not None:
            socket_stream = await LocalInferenceStream.open(self.local_peer_id, timeout_s=30)
            if socket_stream is None:
                raise RuntimeError("the server's local socket is not usable")
            # a stock Petals client bounds a reply by the transport's frame limit only
            stream = responses_of(socket_stream, requests(), MAX_RESPONSE_FRAME_BYTES)
        else:
            stream = await asyncio.wait_for(self.stub.rpc_inference(requests()), 30)
        self.responses = stream.__aiter__()
        return self

    async def step(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        from hivemind.proto import runtime_pb2

        from corolla.protocol.codecs import deserialize_tensor, serialize_tensor
        from corolla.protocol.metadata import encode_metadata
        from corolla.protocol.packing import pack_args_kwargs

        tensors, structure = pack_args_kwargs(hidden, torch.empty(0), torch.empty(0, dtype=torch.int64))
        meta = {"session_id": self.session_id, "step_id": str(uuid.uuid4()), "start_from_position": position}
        meta["args_structure"] = structure
        if self.first:
            meta["max_length"] = self.max_length
            self.first = False
        request = runtime_pb2.ExpertRequest(
            uid=self.chain, tensors=[serialize_tensor(t) for t in tensors], metadata=encode_metadata(meta)
        )
        if self.poller is not None:
            self.poller.keep_hot(BUSY_POLL_S)
        await self.queue.put(request)
        try:
            response = await asyncio.wait_for(self.responses.__anext__(), 120)
        finally:
            if self.poller is not None:
                self.poller.cool()
        return deserialize_tensor(response.tensors[0])

    async def close(self) -> None:
        await self.queue.put(None)
