"""The one step decoder (`block_functions.decode_step`): a usual decode step is carried as its bytes only where the
general path (`step_args` + `parse_step_inputs`) accepts the step, with the same prefix, dtype, shape and values, at
and past every limit, and every other step gets the general path's answer or error; a step's STEP frame is byte for
byte the same from bytes or from a tensor; a handler session answers its steps and refuses a poisoned one with the
general path's error."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable

import pytest
import torch
from hivemind.proto import runtime_pb2

from corolla.protocol import channel_frames as wire
from corolla.protocol.channel_frames import DeviceInfo
from corolla.protocol.codecs import serialize_tensor
from corolla.protocol.metadata import encode_metadata
from corolla.protocol.packing import pack_args_kwargs
from corolla.server.core.executor import PATH_EAGER, PrefixCacheStats, SessionCache, SessionSpec, StepInputs
from corolla.server.core.limits import SessionTimeouts
from corolla.server.core.span_core import SpanCore
from corolla.server.front import block_functions as bf
from corolla.server.front.block_functions import ServingLimits
from corolla.server.front.handler import TransformerConnectionHandler
from corolla.server.handlers.remote_core import DeviceLink, RemoteCore, RemoteSessionCache
from corolla.server.metrics import ServerMetrics
from corolla.utils.tensor_bytes import as_tensor
from helpers.socket_session import socket_session

H = 8
NONE = runtime_pb2.CompressionType.NONE


def _limits(dtype: torch.dtype) -> ServingLimits:
    return ServingLimits(
        dht_prefix="p", start_block=0, end_block=2, hidden_size=H, dtype=dtype,
        inference_max_length_tokens=64, max_batch_size_tokens=12,
    )  # fmt: skip


def _petals_step(hidden: torch.Tensor) -> tuple[list[runtime_pb2.Tensor], object]:
    """The records and structure a Petals client sends for a step (dummy prompts and hypo_ids)."""
    tensors, _ = pack_args_kwargs(hidden, torch.empty(0), torch.empty(0, dtype=torch.int64))
    return [serialize_tensor(t) for t in tensors], bf.PETALS_STEP_STRUCTURE  # the structure as msgpack decodes it


Mutation = Callable[[list[runtime_pb2.Tensor]], None]


def _set(index: int, **fields: object) -> Mutation:
    def mutate(tensors: list[runtime_pb2.Tensor]) -> None:
        for name, value in fields.items():
            if name == "size":
                del tensors[index].size[:]
                tensors[index].size.extend(value)
            else:
                setattr(tensors[index], name, value)

    return mutate


def _poke(value: float) -> Mutation:
    """Writes `value` (in the record's dtype) over the hidden states' last element."""

    def mutate(tensors: list[runtime_pb2.Tensor]) -> None:
        record = tensors[0]
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[record.dtype]
        data = bytearray(record.buffer)
        last = torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes()
        data[-len(last) :] = last
        record.buffer = bytes(data)

    return mutate


# (name, batch, length, mutation of the records, start_from_position, current length, max length)
CASES: list[tuple[str, int, int, Mutation | None, int | None, int, int]] = [
    ("usual", 1, 1, None, None, 5, 64),
    ("batch of two", 2, 1, None, 5, 5, 64),
    ("several tokens", 1, 4, None, 5, 5, 64),
    ("rollback", 1, 1, None, 2, 5, 64),
    ("at max length", 1, 1, None, 5, 5, 6),
    ("past max length", 1, 2, None, 5, 5, 6),
    ("start past length", 1, 1, None, 6, 5, 64),
    ("negative start", 1, 1, None, -1, 5, 64),
    ("at max tokens", 2, 6, None, None, 0, 64),
    ("past max tokens", 1, 13, None, None, 0, 64),
    ("keep-alive", 1, 0, None, None, 5, 64),
    ("nan", 1, 2, _poke(math.nan), None, 5, 64),
    ("inf", 1, 1, _poke(math.inf), None, 5, 64),
    ("-inf", 1, 1, _poke(-math.inf), None, 5, 64),
    ("batch mismatch", 3, 1, None, None, 5, 64),
    ("wrong hidden", 1, 1, _set(0, size=[1, 1, H // 2], buffer=b"\0" * (2 * H)), None, 5, 64),
    ("2 dims", 1, 1, _set(0, size=[1, H]), None, 5, 64),
    ("4 dims", 1, 1, _set(0, size=[1, 1, 1, H]), None, 5, 64),
    ("short buffer", 1, 1, _set(0, buffer=b"\0" * 3), None, 5, 64),
    ("requires grad", 1, 1, _set(0, requires_grad=True), None, 5, 64),
    ("int dtype", 1, 1, _set(0, dtype="int8", buffer=b"\0" * H), None, 5, 64),
    ("unknown dtype", 1, 1, _set(0, dtype="S16"), None, 5, 64),
    ("huge dim", 1, 1, _set(0, size=[1, 1 << 30, H]), None, 5, 64),
    ("prompts", 1, 1, _set(1, size=[2, 1, 1, H], buffer=b"\0" * (8 * H), dtype="float32"), None, 5, 64),
    ("hypo ids", 1, 1, _set(2, size=[1], buffer=b"\0" * 8), None, 5, 64),
    ("prompts with grad", 1, 1, _set(1, requires_grad=True), None, 5, 64),
]

# accepted steps that the bytes case leaves to the general one (besides casts and keep-alives)
GENERAL_ONLY = ("prompts", "hypo ids", "prompts with grad", "requires grad")


def _general(tensors, structure, limits, batch, current, start, max_length) -> StepInputs | BaseException:
    try:
        return bf.parse_step_inputs(
            bf.step_args(tensors, structure), limits, SessionSpec((0, 1), batch, max_length), current_length=current,
            start_from_position=start, adapter="", lone_session=False,
        )  # fmt: skip
    except Exception as e:
        return e


def _decoded(tensors, structure, limits, batch, current, start, max_length) -> StepInputs | BaseException:
    try:
        return bf.decode_step(
            tensors, structure, limits, SessionSpec((0, 1), batch, max_length), current_length=current,
            start_from_position=start, adapter="", lone_session=False,
        )  # fmt: skip
    except Exception as e:
        return e


@pytest.mark.parametrize("block_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sent_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("name", "batch", "length", "mutate", "start", "current", "max_length"), CASES)
def test_bytes_taken_only_where_the_general_path_accepts_with_the_same_result(
    block_dtype, sent_dtype, name, batch, length, mutate, start, current, max_length
) -> None:
    limits = _limits(block_dtype)
    hidden = torch.randn(batch, length, H, generator=torch.Generator().manual_seed(len(name))).to(sent_dtype)
    tensors, structure = _petals_step(hidden)
    if mutate is not None:
        mutate(tensors)
    session_batch = 2 if name == "at max tokens" else 1 if name != "batch of two" else 2
    general = _general(tensors, structure, limits, session_batch, current, start, max_length)
    decoded = _decoded(tensors, structure, limits, session_batch, current, start, max_length)
    if isinstance(general, BaseException):
        assert isinstance(decoded, BaseException), f"{name}: the general path refuses ({general!r}), decode_step not"
        assert type(decoded) is type(general) and str(decoded) == str(general), name
        return
    assert not isinstance(decoded, BaseException), f"{name}: decode_step refused ({decoded!r})"
    if decoded.hidden_states is not None:  # the general path only: a cast, a keep-alive, prompts or beam ids
        assert sent_dtype != block_dtype or length == 0 or name in GENERAL_ONLY, name
    else:
        assert sent_dtype == block_dtype and mutate is None, name
        assert decoded.hidden_bytes is not None and not decoded.hidden_bytes.readonly  # a writable copy
    hidden = general.tensor()  # [B, T, H]
    assert decoded.prefix_length == general.prefix_length and decoded.tensor().shape == hidden.shape
    assert decoded.tensor().dtype == hidden.dtype and torch.equal(decoded.tensor(), hidden)
    for got, want in ((decoded.prompts, general.prompts), (decoded.hypo_ids, general.hypo_ids)):
        assert (got is None and want is None) or torch.equal(got, want)


def test_other_structures_take_the_general_path() -> None:
    limits = _limits(torch.float32)
    tensors, _ = _petals_step(torch.randn(1, 1, H))
    spec = SessionSpec((0, 1), 1, 8)
    kwargs = dict(current_length=0, start_from_position=None, adapter="", lone_session=False)
    assert bf.decode_step(tensors, bf.PETALS_STEP_STRUCTURE, limits, spec, **kwargs).hidden_states is None  # type: ignore[arg-type]
    assert bf.decode_step(tensors, None, limits, spec, **kwargs).hidden_states is not None  # type: ignore[arg-type]
    two = ((b"__T0", b"__T1"), {})
    assert bf.decode_step(tensors[:2], two, limits, spec, **kwargs).hidden_states is not None  # type: ignore[arg-type]
    other: object = ((b"__T0", b"__T2", b"__T1"), {})
    assert bf.decode_step(tensors, other, limits, spec, **kwargs).hidden_states is not None  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bytes_finite_equals_all_finite_on_every_16_bit_pattern(dtype) -> None:
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(patterns)
    for start in range(0, 1 << 16, 251):  # each pattern beside finite ones, in a few hundred arrays
        chunk = patterns[start : start + 251]
        data = chunk.view(torch.uint8).numpy().tobytes()
        assert bf.bytes_finite(data, dtype) == bool(finite[start : start + 251].all())
        assert bf.bytes_finite(data, dtype) == bf.all_finite(chunk)
    assert bf.bytes_finite(b"", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bytes_finite_equals_all_finite_on_wide_floats(dtype) -> None:
    for values in ([1.0, -2.5], [1e38, -1e38], [math.nan], [1.0, math.inf], [-math.inf], []):
        tensor = torch.tensor(values, dtype=dtype)
        assert bf.bytes_finite(tensor.numpy().tobytes(), dtype) == bf.all_finite(tensor), values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_wire_records_are_the_tensor_records(dtype) -> None:
    tensor = (torch.randn(2, 3, 4) * 10).to(dtype)
    data = tensor.view(torch.uint8).numpy().tobytes()
    by_record = wire.Writer().record(dtype, (2, 3, 4), data).frame(wire.STEP, 1)
    assert by_record == wire.Writer().tensor(tensor).frame(wire.STEP, 1)
    reader = wire.Reader(by_record[wire.HEADER_BYTES :])
    got = reader.record()
    assert got is not None and got[0] == dtype and got[1] == (2, 3, 4) and bytes(got[2]) == data
    reader.done()
    with pytest.raises(wire.FrameError, match="can't hold"):
        wire.Writer().record(dtype, (2, 3, 5), data)
    with pytest.raises(wire.FrameError, match="runs past the payload"):
        wire.Reader(by_record[wire.HEADER_BYTES : -1]).record()
    assert wire.Reader(bytes([wire.NO_TENSOR])).record() is None
    with pytest.raises(wire.FrameError, match="dtype code"):
        wire.Reader(bytes([200, 1, 0, 0, 0, 1])).record()
    with pytest.raises(wire.FrameError, match="dims"):
        wire.Reader(bytes([0, 9])).record()


class _CapturingWriter:
    """A channel writer that keeps what is written."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.transport = self

    def write(self, data: bytes) -> None:
        self.frames.append(bytes(data))

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False


async def _sent_and_answered(link: DeviceLink, writer: _CapturingWriter, call, reply: torch.Tensor):
    """Runs `call` until its STEP frame is written, answers it with `reply`; (the frame, the call's result)."""
    task = asyncio.ensure_future(call)
    while not writer.frames:
        await asyncio.sleep(0)
    frame = writer.frames.pop()
    _, kind, request_id = wire.HEADER.unpack(frame[: wire.HEADER_BYTES])
    assert kind == wire.STEP
    link._resolve(request_id, wire.REPLY_TENSORS, wire.Reader(wire.Writer().u8(1).tensor(reply).frame(0, 0)[9:]))
    return frame[wire.HEADER_BYTES :], await task


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_a_step_as_bytes_sends_the_frame_of_the_tensor_and_reads_the_same_reply(dtype) -> None:
    writer = _CapturingWriter()
    link = DeviceLink(asyncio.StreamReader(), writer, DeviceInfo(PATH_EAGER, 1 << 20, {0: 1, 1: 1}))  # type: ignore[arg-type]
    executor = RemoteCore(link)
    cache = RemoteSessionCache(SessionSpec((0, 1), 2, 16), link, handle=7)
    hidden, reply = torch.randn(2, 1, H).to(dtype), torch.randn(2, 1, H).to(dtype)
    data = memoryview(bytearray(hidden.view(torch.uint8).numpy().tobytes()))
    inputs = StepInputs(hidden, 3, None, None, "lora", True)
    sent, output = await _sent_and_answered(link, writer, executor.step(cache, inputs), reply)
    as_bytes = StepInputs(None, 3, None, None, "lora", True, hidden_bytes=data, hidden_meta=(dtype, (2, 1, H)))
    sent_bytes, output_bytes = await _sent_and_answered(link, writer, executor.step(cache, as_bytes), reply)
    assert sent_bytes == sent
    assert torch.equal(as_tensor(output), reply) and torch.equal(as_tensor(output_bytes), reply)


class _DoublingExecutor:
    """An executor (`EngineExecutor`'s methods) that doubles the hidden states; counts the steps that came as bytes."""

    path = PATH_EAGER
    max_size_bytes = bytes_left = 1 << 30
    bytes_waiting = 0
    attach_prefix = add_prefix_keys = handoff_layout = read_kv = write_kv = None  # (no step here uses them)

    def __init__(self) -> None:
        self.byte_steps = 0

    def session_bytes(self, spec: SessionSpec) -> int:
        return 0

    def cache_bytes_per_token(self, block_indices: tuple[int, ...]) -> int:
        return 1

    @contextlib.asynccontextmanager
    async def open_session(self, spec: SessionSpec, alloc_timeout_s: float | None) -> AsyncIterator[SessionCache]:
        yield SessionCache(spec)

    def step(
        self, cache: SessionCache, inputs: StepInputs, then: Callable[[asyncio.Future], None] | None = None
    ) -> asyncio.Future:
        self.byte_steps += inputs.hidden_states is None
        future = asyncio.get_running_loop().create_future()
        future.set_result(inputs.tensor() * 2)  # (done at once, as a lone step run inline: `then` not run)
        return future

    def prefix_cache_stats(self) -> PrefixCacheStats:  # (no prefix cache: the handler reports an empty one)
        return PrefixCacheStats()


def _requests(dtype: torch.dtype) -> list[runtime_pb2.ExpertRequest]:
    generator = torch.Generator().manual_seed(3)
    requests = []
    for step, (length, start, poison) in enumerate([(4, 0, False), (1, 4, False), (1, 5, False), (1, 6, True)]):
        hidden = torch.randn(1, length, H, generator=generator).to(dtype)
        if poison:
            hidden[0, 0, 3] = math.nan
        tensors, structure = pack_args_kwargs(hidden, torch.empty(0), torch.empty(0, dtype=torch.int64))
        metadata = {"session_id": "s", "step_id": f"s{step}", "start_from_position": start, "args_structure": structure}
        if step == 0:
            metadata["max_length"] = 16
        requests.append(
            runtime_pb2.ExpertRequest(
                uid="p.0 p.1", tensors=[serialize_tensor(t) for t in tensors], metadata=encode_metadata(metadata)
            )
        )
    return requests


async def _serve(dtype: torch.dtype) -> tuple[list[bytes], str | None, int, str]:
    """A session of `_requests` through the same-host socket's port: its replies' payloads, its error text, the steps
    that reached the executor as bytes and the handler's metrics."""
    executor = _DoublingExecutor()
    handler = TransformerConnectionHandler(
        limits=_limits(dtype),
        core=SpanCore(executor),  # type: ignore[arg-type]  # only what a session's steps use
        timeouts=SessionTimeouts(5, 30, 5),
        metrics=ServerMetrics(),
    )
    replies, error = await socket_session(handler, _requests(dtype))
    return replies, error, executor.byte_steps, handler.metrics.render().decode()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
async def test_a_session_answers_its_steps_and_refuses_a_poisoned_one_with_the_general_error(dtype) -> None:
    replies, error, byte_steps, metrics = await _serve(dtype)
    assert byte_steps == 3  # the prefill and two decode steps; the poisoned step went the general way and was refused
    expected = []
    for request in _requests(dtype)[:3]:
        hidden = bf.deserialize_request(request.tensors)[0]
        expected.append(runtime_pb2.ExpertResponse(tensors=[serialize_tensor(hidden * 2)]).SerializeToString())
    assert replies == expected
    assert error == "hidden_states contains NaN or infinite values"
    assert 'corolla_requests_rejected_total{reason="bad_request"} 1.0' in metrics  # refused as a BadRequest, once


def test_known_empty_records_answer_by_comparison_and_forgeries_still_take_the_full_check(monkeypatch) -> None:
    monkeypatch.setattr(bf, "_known_empty", [])
    empty = serialize_tensor(torch.empty(0))
    assert bf._plain_empty(empty) and len(bf._known_empty) == 1
    assert bf._plain_empty(runtime_pb2.Tensor.FromString(empty.SerializeToString()))
    assert len(bf._known_empty) == 1  # an equal record: answered by the comparison, nothing added
    unknown_field = runtime_pb2.Tensor.FromString(empty.SerializeToString() + bytes([0x78, 0x01]))
    forged = [serialize_tensor(torch.zeros(1)), runtime_pb2.Tensor(dtype="float32", size=[0], buffer=b"\x00" * 4)]
    forged.append(runtime_pb2.Tensor(dtype="float32", size=[0], compression=runtime_pb2.CompressionType.FLOAT16))
    for record in forged:
        assert not bf._plain_empty(record)  # unequal to the known one: the full check refuses it
    assert bf._plain_empty(unknown_field)  # unequal, so fully checked (still empty: an unknown field)
    for _ in range(2 * bf.MAX_KNOWN_EMPTY):
        bf._plain_empty(runtime_pb2.Tensor(dtype="float32", size=[0, len(bf._known_empty)]))
    assert len(bf._known_empty) == bf.MAX_KNOWN_EMPTY  # bounded
