"""Fake servers of a graceful drain (in-process, no network): one that drains and exports a session's cache, one
that imports it, and a watch that tells when the client asked for the export (`client/session/handoff.py`)."""

from __future__ import annotations

import asyncio

import torch
from hivemind.proto import runtime_pb2

from corolla.protocol import handoff as wire
from corolla.protocol.codecs import deserialize_tensor, serialize_tensor
from corolla.protocol.metadata import decode_metadata, encode_metadata
from helpers.fake_chain import HIDDEN, FakeServer, block_fn


class ExportWatch:
    """Passes a stream's steps on until the client asks for the session's cache (then `exporting`)."""

    def __init__(self) -> None:
        self.exporting = False

    async def steps(self, requests):
        async for request in requests:
            if request.metadata and wire.EXPORT_KEY in decode_metadata(request.metadata):
                self.exporting = True
                return
            yield request


class Importer(FakeServer):
    """Takes a hand-off: a stream whose first request carries `wire.IMPORT_KEY` is followed by the header's part
    messages, in this fake's cache layout (each block's past inputs [B, position, H], one tensor a block); it answers
    the zero-token request, then serves the session's steps from those caches."""

    def __init__(self, start: int, end: int, inference_rps: float = 100.0):
        super().__init__(start, end, inference_rps)
        self.imports = 0
        self.import_delay_s = 0.0  # its answer to the import comes this late (it still answers pings)

    async def _serve(self, requests):
        iterator = requests.__aiter__()
        first = await anext(iterator)
        metadata = decode_metadata(first.metadata)
        if wire.IMPORT_KEY not in metadata:
            async for response in super()._serve(prepend(first, iterator)):
                yield response
            return
        header = wire.KvHeader.from_dict(metadata[wire.IMPORT_KEY])
        parts = [t for _ in range(header.num_messages) for t in (await anext(iterator)).tensors]
        caches = [deserialize_tensor(t) for t in parts]
        self.imports += 1
        await asyncio.sleep(self.import_delay_s)
        yield runtime_pb2.ExpertResponse(tensors=[serialize_tensor(caches[0][:, :0])])
        async for request in iterator:
            if not request.tensors:
                break
            step = decode_metadata(request.metadata)
            hidden = deserialize_tensor(request.tensors[0])
            position = step["start_from_position"]
            for i, block in enumerate(range(self.start, self.end)):
                out = block_fn(block, hidden, caches[i][:, :position])
                caches[i] = torch.cat([caches[i][:, :position], hidden], dim=1)
                hidden = out
            yield runtime_pb2.ExpertResponse(tensors=[serialize_tensor(hidden)])


async def prepend(first, rest):
    yield first
    async for item in rest:
        yield item


class Drainer(FakeServer):
    """Serves honestly, marks its answers draining (for `drain_s` more) from the 3rd step on, and exports
    `exported_cache(position)` in `Importer`'s layout when the client asks for the session's cache."""

    drain_s = 5.0
    header_delay_s = 0.0  # its export's header comes this late (it still answers pings: a stalling exporter)
    parts_delay_s = 0.0  # and its parts this long after the header
    extra_bytes = 0  # its header announces this many bytes more than its parts hold (a drainer buying time)

    async def _serve(self, requests):
        watch = ExportWatch()

        answers = 0
        draining = encode_metadata({wire.DRAINING_KEY: wire.DrainNotice(self.drain_s).to_dict()})
        async for response in super()._serve(watch.steps(requests)):
            answers += 1
            yield runtime_pb2.ExpertResponse(tensors=response.tensors, metadata=draining if answers >= 3 else b"")
        if not watch.exporting:
            return
        metadata, tokens = self.requests[-1]
        position = metadata["start_from_position"] + tokens
        cache = [serialize_tensor(t) for t in self.exported_cache(position)]
        header = wire.KvHeader(
            position=position, batch_size=1, start_block=self.start, end_block=self.end, num_messages=1,
            total_bytes=wire.message_bytes(cache) + self.extra_bytes,
        )  # fmt: skip
        await asyncio.sleep(self.header_delay_s)
        yield runtime_pb2.ExpertResponse(metadata=encode_metadata({wire.KV_HEADER_KEY: header.to_dict()}))
        await asyncio.sleep(self.parts_delay_s)
        yield runtime_pb2.ExpertResponse(tensors=cache)

    def exported_cache(self, position: int) -> list[torch.Tensor]:
        raise NotImplementedError


class PoisoningDrainer(Drainer):
    """Exports a cache of noise (what no client can tell from the real one without recomputing it)."""

    def exported_cache(self, position: int) -> list[torch.Tensor]:
        return [torch.randn(1, position, HIDDEN) for _ in range(self.start, self.end)]


class HonestDrainer(Drainer):
    """Exports the true cache of a session whose inputs to block 0 are `inputs` [1, T, H] (it must hold block 0)."""

    def __init__(self, start: int, end: int, inputs: torch.Tensor, inference_rps: float = 100.0):
        assert start == 0
        super().__init__(start, end, inference_rps)
        self.inputs = inputs

    def exported_cache(self, position: int) -> list[torch.Tensor]:
        hidden, cache = self.inputs[:, :position], []  # [1, position, H]
        for block in range(self.start, self.end):
            cache.append(hidden)
            hidden = block_fn(block, hidden, hidden[:, :0])
        return cache


class AlwaysDraining(FakeServer):
    """Serves honestly but marks every answer draining, and never exports (a server that lies about draining to keep
    its clients busy: as the only server of its blocks, it takes every replay back)."""

    async def _serve(self, requests):
        draining = encode_metadata({wire.DRAINING_KEY: wire.DrainNotice(1e9).to_dict()})
        async for response in super()._serve(ExportWatch().steps(requests)):
            yield runtime_pb2.ExpertResponse(tensors=response.tensors, metadata=draining)
