"""Malformed and hostile requests (bad uids, shapes, dtypes, values, sizes, lengths, metadata, adapters, streams,
sessions): each gets an error naming what was wrong, and afterwards the server still answers a correct request and
its KV cache is back to empty."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PHandlerError
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from corolla.protocol.forwarding import NEXT_STEP_KEY
from corolla.server.core.engine_executor import CPU_PAGE_TOKENS
from helpers.swarm import (
    ClientThread,
    InferenceStream,
    make_request,
    packed_request,
    start_inprocess_server,
    wait_until,
)
from helpers.tiny_models import HIDDEN_SIZE as HIDDEN
from helpers.tiny_models import make_tiny_model

NUM_BLOCKS = 4
CACHE_TOKENS_PER_BLOCK = 128
MAX_BATCH_TOKENS = 256
MAX_LENGTH_LIMIT = 64
SESSION_TIMEOUT_S = 5.0

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_path = make_tiny_model("llama", tmp_path_factory.mktemp("models"))
    server = start_inprocess_server(
        model_path,
        tmp_path_factory.mktemp("cache"),
        block_indices=(0, NUM_BLOCKS),
        adapters=(),
        inference_max_length_tokens=MAX_LENGTH_LIMIT,
        max_batch_size_tokens=MAX_BATCH_TOKENS,
        attn_cache_tokens=CACHE_TOKENS_PER_BLOCK,
        step_timeout_s=2.0,
        session_timeout_s=SESSION_TIMEOUT_S,
        request_timeout_s=10.0,
        max_alloc_timeout_s=0.5,
    )
    yield server
    server.shutdown()


PREFIX: list[str] = []


def uid(start: int = 0, end: int = NUM_BLOCKS) -> str:
    return " ".join(f"{PREFIX[0]}.{i}" for i in range(start, end))


def x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape) if shape else torch.randn(1, 3, HIDDEN)


# ---- how to send --------------------------------------------------------------------------------------------------


def forward(request: runtime_pb2.ExpertRequest) -> Callable[[ClientThread], Any]:
    return lambda client: client.run(lambda stub: stub.rpc_forward(request, timeout=15))


def backward(request: runtime_pb2.ExpertRequest) -> Callable[[ClientThread], Any]:
    return lambda client: client.run(lambda stub: stub.rpc_backward(request, timeout=15))


def forward_stream(requests: list[runtime_pb2.ExpertRequest]) -> Callable[[ClientThread], Any]:
    async def go(stub: Any) -> list:
        async def messages():
            for request in requests:
                yield request

        return [r async for r in await stub.rpc_forward_stream(messages())]

    return lambda client: client.run(go)


def push(request: runtime_pb2.ExpertRequest) -> Callable[[ClientThread], Any]:
    return lambda client: client.run(lambda stub: stub.rpc_push(request, timeout=15))


def inference(*steps: Callable[[], runtime_pb2.ExpertRequest]) -> Callable[[ClientThread], Any]:
    """Runs the steps of one session in order; the error of the failing step propagates. Closes on success."""

    def run(client: ClientThread) -> None:
        stream = InferenceStream(client).open()
        for make in steps:
            stream.step(make())
        stream.close()

    return run


def duplicate_session(client: ClientThread) -> None:
    session_id = str(uuid.uuid4())
    first = InferenceStream(client).open()
    first.step(packed_request(uid(), x(), max_length=8, session_id=session_id))
    try:
        InferenceStream(client).open().step(packed_request(uid(), x(), max_length=8, session_id=session_id))
    finally:
        first.close()


def corrupt(tensor: torch.Tensor, **fields: Any) -> runtime_pb2.Tensor:
    serialized = serialize_torch_tensor(tensor)
    for key, value in fields.items():
        if key == "size":
            del serialized.size[:]
            serialized.size.extend(value)
        else:
            setattr(serialized, key, value)
    return serialized


def raw_request(
    chain: str, tensors: list[runtime_pb2.Tensor], metadata: dict | None = None
) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(uid=chain, tensors=tensors, metadata=MSGPackSerializer.dumps(metadata or {}))


def first_ok(**metadata: Any) -> Callable[[], runtime_pb2.ExpertRequest]:
    return lambda: packed_request(uid(), x(), **{"max_length": 8, **metadata})


# (id, action, expected part of the error message); built lazily because uids need the server's prefix
CASES: list[tuple[str, Callable[[], Callable[[ClientThread], Any]], str]] = [
    ("empty_uid", lambda: forward(packed_request("", x())), "uid"),
    ("unknown_prefix", lambda: forward(packed_request("someone-else.0", x())), "does not serve"),
    ("unserved_block", lambda: forward(packed_request(f"{PREFIX[0]}.7", x())), "does not serve"),
    ("non_contiguous_chain", lambda: forward(packed_request(f"{PREFIX[0]}.0 {PREFIX[0]}.2", x())), "contiguous"),
    ("descending_chain", lambda: forward(packed_request(f"{PREFIX[0]}.2 {PREFIX[0]}.1", x())), "contiguous"),
    ("malformed_uid", lambda: forward(packed_request(f"{PREFIX[0]}..1", x())), "uid"),
    ("double_space_chain", lambda: forward(packed_request(f"{PREFIX[0]}.0  {PREFIX[0]}.1", x())), "uid"),
    ("hidden_2d", lambda: forward(packed_request(uid(), x(3, HIDDEN))), "shape"),
    ("hidden_wrong_size", lambda: forward(packed_request(uid(), x(1, 3, HIDDEN // 2))), f"hidden_size={HIDDEN}"),
    ("hidden_int64", lambda: forward(packed_request(uid(), torch.ones(1, 3, HIDDEN, dtype=torch.int64))), "float"),
    ("hidden_nan", lambda: forward(packed_request(uid(), x().index_fill(1, torch.tensor([1]), float("nan")))), "NaN"),
    ("hidden_inf", lambda: forward(packed_request(uid(), x().index_fill(1, torch.tensor([0]), float("inf")))), "NaN"),
    ("oversized_tokens", lambda: forward(packed_request(uid(), x(2, 200, HIDDEN))), f"{MAX_BATCH_TOKENS}"),
    ("zero_batch", lambda: forward(packed_request(uid(), x(0, 3, HIDDEN))), "batch size"),
    ("zero_length_forward", lambda: forward(packed_request(uid(), x(1, 0, HIDDEN))), "at least one token"),
    ("garbage_metadata", lambda: forward(make_request(uid(), [x()], b"\xc1\xff\x00garbage")), "metadata"),
    ("metadata_not_a_map", lambda: forward(make_request(uid(), [x()], MSGPackSerializer.dumps([1, 2]))), "metadata"),
    ("unknown_adapter", lambda: forward(packed_request(uid(), x(), active_adapter="evil/lora")), "adapter"),
    ("args_structure_bad_marker", lambda: forward(make_request(uid(), [x()], {"args_structure": ((b"__T5",), {})})), "tensor 5"),
    ("args_structure_not_pair", lambda: forward(make_request(uid(), [x()], {"args_structure": [1, 2, 3]})), "args_structure"),
    ("output_compression_count", lambda: forward(packed_request(uid(), x(), output_compression=(0, 0))), "output_compression"),
    ("output_compression_value", lambda: forward(packed_request(uid(), x(), output_compression=(77,))), "output_compression"),
    ("corrupted_buffer", lambda: forward(raw_request(uid(), [corrupt(x(), size=[1, 5, HIDDEN])])), "bytes"),
    ("unknown_tensor_dtype", lambda: forward(raw_request(uid(), [corrupt(x(), dtype="complex128")])), "dtype"),
    ("no_tensors", lambda: forward(raw_request(uid(), [])), "tensor"),
    ("too_many_tensors", lambda: forward(make_request(uid(), [x()] * 17)), "limit"),
    ("prompts_wrong_shape", lambda: forward(packed_request(uid(), x(), torch.randn(2, 1, 1, HIDDEN))), "prompts"),
    ("prompts_too_long", lambda: forward(packed_request(uid(), x(), torch.randn(NUM_BLOCKS, 1, 9, HIDDEN))), "prompts"),
    ("backward_grad_mismatch", lambda: backward(packed_request(uid(), x(), x(1, 4, HIDDEN))), "grad_outputs"),
    ("backward_missing_grad", lambda: backward(packed_request(uid(), x())), "grad_outputs"),
    ("stream_mixed_uids", lambda: forward_stream([packed_request(uid(), x()), packed_request(uid(0, 1), x())]), "same uid"),
    ("stream_empty", lambda: forward_stream([]), "empty"),
    ("inference_no_max_length", lambda: inference(lambda: packed_request(uid(), x())), "max_length"),
    ("inference_negative_max_length", lambda: inference(first_ok(max_length=-1)), "max_length"),
    ("inference_huge_max_length", lambda: inference(first_ok(max_length=10**9)), f"max = {MAX_LENGTH_LIMIT}"),
    ("inference_bad_start_position", lambda: inference(first_ok(), lambda: packed_request(uid(), x(), start_from_position=7)), "start_from_position"),
    ("inference_length_exceeded", lambda: inference(first_ok(), lambda: packed_request(uid(), x(1, 6, HIDDEN))), "Maximum length exceeded"),
    ("inference_hypo_ids_float", lambda: inference(lambda: packed_request(uid(), x(), torch.empty(0), torch.zeros(1), max_length=8)), "int64"),
    ("inference_hypo_ids_range", lambda: inference(first_ok(), lambda: packed_request(uid(), x(), torch.empty(0), torch.tensor([3]))), "hypo_ids"),
    ("inference_batch_change", lambda: inference(first_ok(), lambda: packed_request(uid(), x(2, 1, HIDDEN))), "batch size"),
    ("inference_step_id_not_str", lambda: inference(first_ok(step_id=12345)), "step_id"),
    ("inference_cache_too_big", lambda: inference(lambda: packed_request(uid(), x(4, 1, HIDDEN), max_length=MAX_LENGTH_LIMIT)), "allocate"),
    ("inference_unserved_block", lambda: inference(lambda: packed_request(f"{PREFIX[0]}.9", x(), max_length=8)), "does not serve"),
    ("inference_nan_step", lambda: inference(first_ok(), lambda: packed_request(uid(), torch.full((1, 1, HIDDEN), float("nan")))), "NaN"),
    ("inference_next_servers_garbage", lambda: inference(first_ok(next_servers=[["peer", 1]])), "next_servers"),
    ("inference_duplicate_session_id", lambda: duplicate_session, "already open"),
    ("push_without_session_id", lambda: push(packed_request(uid(), x())), "session_id"),
]  # fmt: skip


def check_healthy(server, client: ClientThread) -> None:
    """The server answers a correct forward and holds no KV cache."""
    hidden = torch.randn(1, 2, HIDDEN)
    response = client.run(lambda stub: stub.rpc_forward(packed_request(uid(), hidden), timeout=15))
    assert deserialize_torch_tensor(response.tensors[0]).shape == hidden.shape
    full = NUM_BLOCKS * CACHE_TOKENS_PER_BLOCK
    assert wait_until(lambda: client.info()["cache_tokens_available"] == full, 5), client.info()


def test_enough_kinds_of_bad_requests():
    assert len(CASES) >= 30
    assert len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize("make_action,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_is_rejected_and_server_stays_healthy(server, client, make_action, expected):
    if not PREFIX:
        PREFIX.append(server.settings.dht_prefix)
    with pytest.raises((P2PHandlerError, asyncio.TimeoutError, TimeoutError)) as info:
        make_action()(client)
    assert expected in str(info.value), f"error message lacks {expected!r}: {info.value}"
    check_healthy(server, client)


def test_abandoned_sessions_are_freed(server, client):
    """Sessions opened and left (no close, no further step) end after step_timeout and free their caches."""
    if not PREFIX:
        PREFIX.append(server.settings.dht_prefix)
    full = NUM_BLOCKS * CACHE_TOKENS_PER_BLOCK
    streams = [InferenceStream(client).open() for _ in range(3)]
    for stream in streams:
        stream.step(packed_request(uid(), x(), max_length=10))
    charged_tokens = -(-10 // CPU_PAGE_TOKENS) * CPU_PAGE_TOKENS  # the KV pool charges whole pages
    assert client.info()["cache_tokens_available"] == full - 3 * charged_tokens * NUM_BLOCKS
    assert wait_until(lambda: client.info()["cache_tokens_available"] == full, 8)
    # a stream opened without any request ends after step_timeout too
    idle = InferenceStream(client).open()
    assert idle.responses is not None
    check_healthy(server, client)


def test_session_timeout_ends_a_busy_session(server, client):
    """A session that keeps stepping is still ended (and its cache freed) after session_timeout."""
    if not PREFIX:
        PREFIX.append(server.settings.dht_prefix)
    full = NUM_BLOCKS * CACHE_TOKENS_PER_BLOCK
    stream = InferenceStream(client).open()
    stream.step(packed_request(uid(), x(1, 1, HIDDEN), max_length=MAX_LENGTH_LIMIT))
    started = time.monotonic()
    with pytest.raises((P2PHandlerError, StopAsyncIteration, asyncio.TimeoutError, TimeoutError, ConnectionError)):
        for _ in range(MAX_LENGTH_LIMIT - 1):
            stream.step(packed_request(uid(), x(1, 1, HIDDEN)), timeout_s=SESSION_TIMEOUT_S + 5)
            time.sleep(1.0)
    assert SESSION_TIMEOUT_S - 1 <= time.monotonic() - started <= SESSION_TIMEOUT_S + 5
    assert wait_until(lambda: client.info()["cache_tokens_available"] == full, 5)


def test_bad_push_does_not_end_the_session(server, client):
    """A malformed `rpc_push` into someone's session, sent as a real upstream server sends it (from the upstream the
    client named, with the step id the client announced), is dropped; the client's own copy of that step is still
    answered, and the session goes on, pushed steps included."""
    if not PREFIX:
        PREFIX.append(server.settings.dht_prefix)
    session_id = str(uuid.uuid4())
    step_ids = [str(uuid.uuid4()) for _ in range(4)]  # what the client announces, one step ahead
    inboxes = server.service.core.pushes.sinks  # the core's push table: session id -> the stream's PushInbox
    stream = InferenceStream(client).open()
    upstream = {"corolla.upstream_peer": client.p2p.peer_id.to_base58()}  # pushes only from the named upstream
    first = packed_request(uid(), x(), max_length=16, session_id=session_id, **upstream, **{NEXT_STEP_KEY: step_ids[0]})
    stream.step(first)
    position = 3
    bad_pushes = (x(1, 1, HIDDEN // 2), torch.full((1, 1, HIDDEN), float("nan")), x(1, 9, HIDDEN))
    for i, pushed in enumerate(bad_pushes):
        request = packed_request(
            uid(), pushed, session_id=session_id, pushed=True, step_id=step_ids[i], start_from_position=position
        )
        client.run(lambda stub, request=request: stub.rpc_push(request))
        if i < 2:  # within the push rules: admitted (its step id used up), then refused by the step's validation
            assert wait_until(lambda: inboxes[session_id].guard.expected_step_id is None, 10)
        else:  # 9 tokens, more than the client's biggest step: refused by the push rules
            assert wait_until(lambda: inboxes[session_id].queue.empty(), 10)
        honest = packed_request(
            uid(),
            x(1, 1, HIDDEN),
            step_id=step_ids[i],
            start_from_position=position,
            **{NEXT_STEP_KEY: step_ids[i + 1]},
        )
        assert deserialize_torch_tensor(stream.step(honest).tensors[0]).shape == (1, 1, HIDDEN)
        position += 1
    good = packed_request(
        uid(), x(1, 1, HIDDEN), session_id=session_id, pushed=True, step_id=step_ids[3], start_from_position=position
    )
    client.run(lambda stub: stub.rpc_push(good))

    async def pushed_output(_stub):  # the session answers the good push
        return await asyncio.wait_for(stream.responses.__anext__(), 10)

    assert deserialize_torch_tensor(client.run(pushed_output).tensors[0]).shape == (1, 1, HIDDEN)
    # the session is at position 6 + 1: a step continuing from there is accepted
    response = stream.step(
        packed_request(uid(), x(1, 2, HIDDEN), step_id=str(uuid.uuid4()), start_from_position=position + 1)
    )
    assert deserialize_torch_tensor(response.tensors[0]).shape == (1, 2, HIDDEN)
    stream.close()
    check_healthy(server, client)
