"""KV hand-off without a network: the wire records (hostile headers rejected, message packing bounds), a draining
server's export and a replacement's import on the demo model's real blocks (the next step after the import equals
the undisturbed one bit for bit), and every malformed import refused with nothing written."""

from __future__ import annotations

import asyncio
import contextlib
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hivemind.proto import runtime_pb2

from corolla.client.session.span_session import reply_flags
from corolla.engine import EngineConfig, SpanEngine
from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from corolla.protocol import handoff as wire
from corolla.protocol.codecs import serialize_tensor
from corolla.protocol.metadata import decode_metadata, encode_metadata
from corolla.server.backend import SpanBackend
from corolla.server.core.engine_executor import EngineExecutor, EngineSessionCache
from corolla.server.core.executor import SessionCache, SessionSpec, StepInputs
from corolla.server.core.limits import PeerLimitExceeded, PeerLimits, ServerLimitExceeded
from corolla.server.core.refusals import Draining
from corolla.server.core.runtime import Runtime
from corolla.server.core.span_core import SpanCore
from corolla.server.front.inference_stream import SessionHandoff
from corolla.server.metrics import ServerMetrics

DEMO = Path(__file__).parents[2] / "src/corolla/demo/assets/corolla-demo-llama"
MAX_LENGTH = 64
PREFIX = 40
UID = "demo.0 demo.1 demo.2 demo.3"


# ---- wire records ---------------------------------------------------------------------------------------------


def _header(**changes) -> dict:
    good = dict(position=10, batch_size=1, start_block=0, end_block=4, num_messages=1, total_bytes=1000)
    good.update(changes)
    return good


def test_kv_header_round_trip():
    header = wire.KvHeader.from_dict(_header())
    assert wire.KvHeader.from_dict(header.to_dict()) == header


@pytest.mark.parametrize(
    "bad",
    [
        _header(position=0),
        _header(position=-1),
        _header(position=1.5),
        _header(position=True),
        _header(batch_size="1"),
        _header(start_block=4),
        _header(num_messages=0),
        _header(total_bytes=0),
        _header(num_messages=10**6),  # far more messages than the bytes need
        {"position": 10},
        [1, 2, 3],
        "header",
    ],
)
def test_kv_header_rejects_hostile_values(bad):
    with pytest.raises(ValueError):
        wire.KvHeader.from_dict(bad)


@pytest.mark.parametrize("sizes", [[3], [2**20 + 7, 5, 3 * 2**20], [wire.MAX_MESSAGE_BYTES // 4 + 1] * 9])
def test_pack_messages_stays_within_bounds(sizes):
    tensors = [serialize_tensor(torch.ones(n, dtype=torch.uint8)) for n in sizes]
    messages = wire.pack_messages(tensors)
    total = sum(sizes)
    assert all(wire.message_bytes(m) <= wire.MAX_MESSAGE_BYTES for m in messages)
    assert sum(wire.message_bytes(m) for m in messages) == total
    assert len(messages) <= math.ceil(total / wire.MAX_MESSAGE_BYTES) + len(sizes)


@pytest.mark.parametrize(
    "metadata, expected",
    [
        (b"", None),
        (encode_metadata({wire.DRAINING_KEY: {"deadline_s": 2.5}}), 2.5),
        (encode_metadata({wire.DRAINING_KEY: {"deadline_s": -1.0}}), 0.0),
        (encode_metadata({wire.DRAINING_KEY: {"deadline_s": float("nan")}}), None),
        (encode_metadata({wire.DRAINING_KEY: "soon"}), None),
        (b"\xc1\xc1garbage", None),
    ],
)
def test_read_drain_notice_never_raises(metadata, expected):
    notice = reply_flags(runtime_pb2.ExpertResponse(metadata=metadata))[0]
    assert (notice.deadline_s if notice is not None else None) == expected


# ---- export / import on real blocks ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend():
    config = load_config(str(DEMO))
    blocks = {i: load_pretrained_block(str(DEMO), i, config=config, torch_dtype=torch.float32) for i in range(4)}
    return SpanBackend(blocks, config=config, dtype=torch.float32, device="cpu")


def _server(backend: SpanBackend, runtime: Runtime, *, fused: bool = True) -> SimpleNamespace:
    """A server's executor over the engine's pool: the demo llama on fused kernels, or its blocks run eagerly."""
    config = EngineConfig(kv_pool_bytes=8 * 2**20, page_size_tokens=16, max_seq_len_tokens=MAX_LENGTH)
    engine = SpanEngine.from_blocks([backend.blocks[i] for i in sorted(backend.blocks)], config, fused=fused)
    executor = EngineExecutor(backend, engine, runtime, ServerMetrics())
    return SimpleNamespace(executor=executor, handoff=SessionHandoff(SpanCore(executor), request_timeout_s=2))


class _Session:
    """What the handler keeps per session (the fields hand-off uses), with its cache open."""

    def __init__(self, server: SimpleNamespace, cache: SessionCache):
        self.session_id = "s"
        self.spec = SessionSpec((0, 1, 2, 3), 1, MAX_LENGTH)
        self.cache = cache
        self.prefix_length = 0
        self.ticket = None  # not admitted through admission
        self.server = server

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        inputs = StepInputs(hidden, self.prefix_length, None, None, "", lone_session=False)
        out = await self.server.executor.step(self.cache, inputs)
        self.prefix_length += hidden.shape[1]
        return out

    def cache_tensors(self) -> list[torch.Tensor]:
        """Copies of the session's pages (all layers, K and V) and of its processed length."""
        executor: EngineExecutor = self.server.executor
        assert isinstance(self.cache, EngineSessionCache)
        pool, slots = executor.engine.pool, self.cache.session.slots
        pages = [page for slot in slots for page in slot.pages]
        return [pool.k[:, pages].clone(), pool.v[:, pages].clone(), torch.tensor([s.length_tokens for s in slots])]


async def _requests(messages):
    for parts in messages:
        yield runtime_pb2.ExpertRequest(uid=UID, tensors=parts)


def _allocate(server, backend):
    return server.executor.open_session(SessionSpec((0, 1, 2, 3), 1, MAX_LENGTH), alloc_timeout_s=0)


async def _export(server, session) -> tuple[wire.KvHeader, list[list[runtime_pb2.Tensor]]]:
    responses = [r async for r in server.handoff.export(session)]
    raw = decode_metadata(responses[0].metadata)[wire.KV_HEADER_KEY]
    if wire.export_error(raw):
        raise RuntimeError(wire.export_error(raw))
    return wire.KvHeader.from_dict(raw), [list(r.tensors) for r in responses[1:]]


@contextlib.asynccontextmanager
async def _handoff_pair(backend: SpanBackend, *, old_fused: bool = True, new_fused: bool = True, targets: int = 1):
    """An old and a new server (each on its own runtime), a session open on the old one and `targets` on the new
    one: yields (old, new, the old one's session, *the new one's)."""
    with Runtime(max_batch_size_tokens=4096) as old_runtime, Runtime(max_batch_size_tokens=4096) as new_runtime:
        old, new = _server(backend, old_runtime, fused=old_fused), _server(backend, new_runtime, fused=new_fused)
        async with contextlib.AsyncExitStack() as stack:
            source = _Session(old, await stack.enter_async_context(_allocate(old, backend)))
            opened = [_Session(new, await stack.enter_async_context(_allocate(new, backend))) for _ in range(targets)]
            yield old, new, source, *opened


async def _drained_export(old, source, hidden: torch.Tensor) -> tuple[wire.KvHeader, list[list[runtime_pb2.Tensor]]]:
    """`hidden` stepped through `source`, then its server drains and exports it: (header, part messages)."""
    await source.step(hidden)
    old.handoff.drain.start(5.0)
    return await _export(old, source)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.mark.parametrize("fused", [True, False])
def test_export_then_import_continues_bit_for_bit(backend, fused):
    torch.manual_seed(0)
    hidden = torch.randn(1, PREFIX + 2, 256)

    async def main():
        async with _handoff_pair(backend, old_fused=fused, new_fused=fused) as (old, new, source, target):
            await source.step(hidden[:, :PREFIX])
            await source.step(hidden[:, PREFIX : PREFIX + 1])
            with pytest.raises(RuntimeError, match="only while the server drains"):
                await _export(old, source)  # no export unless draining
            old.handoff.drain.start(5.0)
            with pytest.raises(Draining):
                old.handoff.drain.check_accepting()
            header, messages = await _export(old, source)
            assert header.position == PREFIX + 1
            with pytest.raises(RuntimeError, match="already exported"):
                await _export(old, source)
            await new.handoff.import_kv(target, header, UID, _requests(messages), peer="client")
            assert target.prefix_length == PREFIX + 1
            expected = await source.step(hidden[:, PREFIX + 1 :])
            got = await target.step(hidden[:, PREFIX + 1 :])
            assert torch.equal(got, expected)
            assert new.handoff.num_imported == 1 and old.handoff.num_exported == 1

    _run(main())


def test_a_fused_servers_export_continues_on_an_eager_server(backend):
    """Both kinds of span hand off the same canonical layout: a session moved from a fused server to one running the
    blocks eagerly continues where it was (equal within the kernels' rounding)."""
    torch.manual_seed(3)
    hidden = torch.randn(1, PREFIX + 1, 256)

    async def main():
        async with _handoff_pair(backend, new_fused=False) as (old, new, source, target):
            header, messages = await _drained_export(old, source, hidden[:, :PREFIX])
            await new.handoff.import_kv(target, header, UID, _requests(messages), peer="client")
            torch.testing.assert_close(
                await target.step(hidden[:, PREFIX:]), await source.step(hidden[:, PREFIX:]), atol=1e-4, rtol=0
            )

    _run(main())


def _corrupt(messages, fn):
    """Decodes the canonical tensors, lets `fn` change them, re-encodes."""
    from corolla.protocol.codecs import combine_parts, deserialize_tensor

    tensors = [deserialize_tensor(t) for t in combine_parts([p for m in messages for p in m])]
    tensors = fn(tensors)
    return wire.pack_messages(serialize_tensor(t) for t in tensors)


def _nan(tensors):
    tensors[3][0, 0, 5, 0] = float("nan")
    return tensors


def _half(tensors):
    return [t.half() if i == 0 else t for i, t in enumerate(tensors)]


def _shorter(tensors):
    return [t[:, :, :-1] for t in tensors]


def _more_heads(tensors):
    return [torch.cat([t, t], dim=1) if i == 7 else t for i, t in enumerate(tensors)]


def _one_less(tensors):
    return tensors[:-1]


def _reshaped(tensors):  # same bytes, heads and length swapped around
    return [t.reshape(1, 8, PREFIX // 2, 32) if i == 2 else t for i, t in enumerate(tensors)]


def _int_view(tensors):  # same bytes, another dtype
    return [t.view(torch.int32) if i == 1 else t for i, t in enumerate(tensors)]


@pytest.mark.parametrize(
    "attack",
    [
        "nan",
        "half",
        "shorter",
        "more_heads",
        "one_less",
        "reshaped",
        "int_view",
        "extra_bytes",
        "truncated",
        "wrong_uid",
        "too_long",
        "wrong_batch",
        "wrong_blocks",
        "bytes_mismatch",
    ],
)
def test_hostile_import_is_refused_and_writes_nothing(backend, attack):
    torch.manual_seed(1)
    hidden = torch.randn(1, PREFIX, 256)

    async def main():
        async with _handoff_pair(backend) as (old, new, source, target):
            header, messages = await _drained_export(old, source, hidden)
            fields = header.to_dict()
            uid = UID
            corruptions = {"nan": _nan, "half": _half, "shorter": _shorter, "more_heads": _more_heads}
            corruptions.update(one_less=_one_less, reshaped=_reshaped, int_view=_int_view)
            if attack in corruptions:
                messages = _corrupt(messages, corruptions[attack])
                fields.update(num_messages=len(messages), total_bytes=sum(wire.message_bytes(m) for m in messages))
                if attack in ("shorter", "half", "one_less", "more_heads"):
                    fields["total_bytes"] = header.total_bytes  # the bytes as announced; the data disagrees
            elif attack == "extra_bytes":
                messages = messages + [[serialize_tensor(torch.zeros(8))]]
                fields["num_messages"] = len(messages)
            elif attack == "truncated":
                messages = messages[:-1] if len(messages) > 1 else [messages[0][:-1]]
            elif attack == "wrong_uid":
                uid = "demo.0 demo.1"
            elif attack == "too_long":
                fields["position"] = MAX_LENGTH + 1
            elif attack == "wrong_batch":
                fields["batch_size"] = 2
            elif attack == "wrong_blocks":
                fields["start_block"], fields["end_block"] = 1, 5
            elif attack == "bytes_mismatch":
                fields["total_bytes"] = header.total_bytes + 4
            before = target.cache_tensors()
            with pytest.raises(ValueError):
                hostile = wire.KvHeader.from_dict(fields)
                await new.handoff.import_kv(target, hostile, uid, _requests(messages), peer="client")
            assert target.prefix_length == 0 and new.handoff.num_imported == 0
            assert all(torch.equal(x, y) for x, y in zip(before, target.cache_tensors(), strict=True))

    _run(main())


def _junk_metadata(messages):
    """Every part message with 1 MiB of request metadata (a part's tensors keep their whole message alive)."""
    return [runtime_pb2.ExpertRequest(uid=UID, tensors=parts, metadata=b"\x00" * (1 << 20)) for parts in messages]


def _junk_shape(messages):
    """Every part message with one more part: no buffer byte, but a `size` of 100,000 dimensions (~0.3 MB)."""
    junk = runtime_pb2.Tensor(size=[1 << 20] * 100_000)
    return [runtime_pb2.ExpertRequest(uid=UID, tensors=[*parts, junk]) for parts in messages]


def _empty_parts(messages):
    """The last message with 100,000 more parts of no bytes (~2 bytes each on the wire, a Python object each here)."""
    requests = [runtime_pb2.ExpertRequest(uid=UID, tensors=parts) for parts in messages]
    requests[-1].tensors.extend([runtime_pb2.Tensor()] * 100_000)
    return requests


@pytest.mark.parametrize("attack", [_junk_metadata, _junk_shape, _empty_parts])
def test_an_import_holds_nothing_but_its_parts(backend, attack):
    """The part messages an import reads are held until the last one is in (the stream budget is given back message
    by message), so a message may hold nothing but parts (each a few header bytes beside its buffer) and the parts
    are as many as the header's bytes need: refused at the first message that holds more. Before, only the buffers'
    bytes were counted: a hostile client made a replacement hold every message whole (up to the stream's message
    bound, 257 MiB on a 70B span) for as many messages as its header announced, and the imports went through."""
    torch.manual_seed(1)
    hidden = torch.randn(1, PREFIX, 256)

    async def main():
        async with _handoff_pair(backend) as (old, new, source, target):
            header, messages = await _drained_export(old, source, hidden)
            hostile = attack(messages)
            taken = []

            async def requests():
                for request in hostile:
                    taken.append(request)
                    yield request

            with pytest.raises(ValueError, match="KV import"):
                await new.handoff.import_kv(target, header, UID, requests(), peer="client")
            assert len(taken) == (len(hostile) if attack is _empty_parts else 1)  # refused at the first such
            assert target.prefix_length == 0 and new.handoff.num_imported == 0

    _run(main())


def test_imports_in_flight_are_bounded_per_peer_and_in_all(backend):
    """An import's parts are held in host memory until written: a peer (or a crowd of cheap identities) opening many
    imports at once is refused past `max_import_bytes_per_peer` / `max_import_bytes_total` at its header, before any
    part is read; what an import held is given back when it ends (written or refused). Before, nothing counted them:
    each import was bounded only by its session's cache (a peer's KV share, which identities multiply)."""
    torch.manual_seed(2)
    hidden = torch.randn(1, PREFIX, 256)

    async def main():
        async with _handoff_pair(backend, targets=2) as (old, new, source, first, second):
            header, messages = await _drained_export(old, source, hidden)
            nbytes = header.total_bytes
            new.handoff.request_timeout_s = 60.0  # the stalled import below waits for its parts all along
            held = asyncio.Event()

            async def stalled():  # a client that sent its header and holds its parts back
                held.set()
                await asyncio.sleep(3600)
                yield

            for per_peer, total, second_peer, refusal in [
                (nbytes, 0, "client", PeerLimitExceeded),
                (0, 3 * nbytes // 2, "another identity", ServerLimitExceeded),
            ]:
                new.handoff.core.configure(PeerLimits(max_import_bytes_per_peer=per_peer, max_import_bytes_total=total))
                held.clear()
                waiting = asyncio.ensure_future(new.handoff.import_kv(first, header, UID, stalled(), peer="client"))
                await held.wait()
                taken: list = []

                async def parts(taken=taken):
                    for parts_of_message in messages:
                        taken.append(parts_of_message)
                        yield runtime_pb2.ExpertRequest(uid=UID, tensors=parts_of_message)

                with pytest.raises(refusal):
                    await new.handoff.import_kv(second, header, UID, parts(), peer=second_peer)
                assert taken == [] and second.prefix_length == 0
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
                assert new.handoff.core.imports.total_bytes == 0 and new.handoff.core.imports.per_peer == {}
            await new.handoff.import_kv(second, header, UID, _requests(messages), peer="client")  # room again
            assert second.prefix_length == PREFIX

    _run(main())
