"""The usual step's request built as bytes (`client.calls.step_request`), the reply checked on its bytes
(`output_checks.read_output`) and the history written from the values as sent (`SpanSession._record`): the same
bytes, outputs, refusals and history as the messages' path."""

from __future__ import annotations

import math

import pytest
import torch
from hivemind.proto import runtime_pb2

from corolla.client.calls.output_checks import BadServerOutput, check_outputs, read_output
from corolla.client.config import ClientConfig
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session.span_session import SpanSession
from corolla.protocol.codecs import deserialize_tensor, serialize_tensor
from corolla.protocol.records import RemoteSpanInfo, ServerInfo, ServerState

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
NONE, FLOAT16 = runtime_pb2.CompressionType.NONE, runtime_pb2.CompressionType.FLOAT16


def _session(max_length: int = 64) -> SpanSession:
    manager = RemoteSequenceManager(ClientConfig(), ["m.0", "m.1"], start_updates=False)
    span = RemoteSpanInfo(PEER, 0, 2, ServerInfo(ServerState.ONLINE, 1.0, start_block=0, end_block=2))
    return SpanSession(manager, span, max_length=max_length)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_step_payload_is_the_request_messages_bytes(dtype: torch.dtype) -> None:
    session = _session()
    empty, no_ids = torch.empty(0), torch.empty(0, dtype=torch.int64)
    wide = torch.randn(2, 3, 16).to(dtype)
    cases = [
        (torch.randn(1, 1, 8).to(dtype), empty, no_ids, NONE, True),
        (torch.randn(2, 3, 8).to(dtype), empty, no_ids, NONE, True),
        (torch.randn(1, 5, 8).to(dtype), torch.empty(1, 0, 8, dtype=dtype), no_ids, NONE, True),
        (wide[:, :, :8], empty, no_ids, NONE, False),  # not contiguous: the messages' path
        (torch.randn(1, 1, 8).to(dtype).requires_grad_(), empty, no_ids, NONE, False),
        (torch.randn(1, 1, 8).to(dtype), torch.randn(2, 1, 1, 8).to(dtype), no_ids, NONE, False),  # deep prompts
        (torch.randn(1, 1, 8).to(dtype), empty, empty, NONE, False),  # one object twice: two tensors
        (torch.randn(1, 1, 8).to(dtype), empty, no_ids, FLOAT16, False),  # (bf16 then goes raw: still none)
    ]
    for started in (False, True):
        session.started = started
        for hidden, prompts, hypo_ids, compression, direct in cases:
            extra = {"corolla.next_step_id": "n-1", "x": [1, (2, 3)]}
            request, inputs, send_from = session.build_request(
                hidden, 0, 0, prompts, hypo_ids, "step-1", compression, extra
            )
            payload, values, inputs2, send_from2 = session.build_payload(
                hidden, 0, 0, prompts, hypo_ids, "step-1", compression, extra
            )
            assert payload == request.SerializeToString()
            assert inputs2 is inputs and send_from2 == send_from == 0
            if direct:
                assert values == inputs.contiguous().view(torch.uint8).numpy().tobytes()
            else:
                assert values is None


def test_read_output_checks_and_decodes_as_the_tensor_path() -> None:
    def both(record: runtime_pb2.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None) -> str | torch.Tensor:
        results: list[str | torch.Tensor] = []
        for read in (
            lambda: read_output(record, expected_shape=shape, peer_id=PEER, what="out", dtype=dtype),
            lambda: check_outputs(
                deserialize_tensor(record), expected_shape=shape, peer_id=PEER, what="out", dtype=dtype
            ),
        ):
            try:
                results.append(read())
            except BadServerOutput as e:
                results.append(str(e))
        fast, slow = results
        if isinstance(fast, torch.Tensor):
            assert isinstance(slow, torch.Tensor) and fast.dtype == slow.dtype and torch.equal(fast, slow)
        else:
            assert fast == slow
        return fast

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(1, 2, 8).to(dtype)
        out = both(serialize_tensor(x), (1, 2, 8), dtype)
        assert isinstance(out, torch.Tensor) and torch.equal(out, x)
        out[0, 0, 0] = 1.0  # its own memory
        assert "shape [1, 2, 8], expected [1, 3, 8]" in str(both(serialize_tensor(x), (1, 3, 8), dtype))
        for bad in (math.nan, math.inf, -math.inf):
            y = x.clone()
            y[0, 1, 3] = bad
            assert "1 non-finite values" in str(both(serialize_tensor(y), (1, 2, 8), dtype))
        big = torch.full((1, 2, 8), 1e5, dtype=dtype) if dtype != torch.float16 else x
        both(serialize_tensor(big), (1, 2, 8), torch.float16)  # refused where it overflows float16
    assert "dtype torch.int64" in str(both(serialize_tensor(torch.ones(1, 2, 8, dtype=torch.int64)), (1, 2, 8), None))
    both(serialize_tensor(torch.randn(1, 2, 8), FLOAT16), (1, 2, 8), torch.float32)  # another codec
    legacy = runtime_pb2.Tensor(  # bf16 in its legacy float32 form
        buffer=torch.randn(16).numpy().tobytes(), size=[1, 2, 8], dtype="bfloat16", compression=NONE
    )
    both(legacy, (1, 2, 8), torch.bfloat16)
    both(serialize_tensor(torch.empty(1, 0, 8, dtype=torch.bfloat16)), (1, 0, 8), torch.bfloat16)
    truncated = serialize_tensor(torch.randn(1, 2, 8))
    truncated.buffer = truncated.buffer[:-4]
    with pytest.raises(BadServerOutput, match="undecodable out"):
        read_output(truncated, expected_shape=(1, 2, 8), peer_id=PEER, what="out")


@pytest.mark.parametrize("batch", [1, 2])
def test_history_from_values_is_the_inputs(batch: int) -> None:
    fast, slow = _session(max_length=40), _session(max_length=40)
    prompt = torch.randn(batch, 5, 8).to(torch.bfloat16)
    steps = [prompt] + [torch.randn(batch, 1, 8).to(torch.bfloat16) for _ in range(30)]
    position = 0
    for hidden in steps:  # the buffer grows past its first capacity on the way
        values = hidden.contiguous().view(torch.uint8).numpy().tobytes()
        fast._record(hidden, position, values)
        slow._record(hidden, position)
        position += hidden.shape[1]
    rollback = torch.randn(batch, 2, 8).to(torch.bfloat16)  # a rollback overwrites positions
    fast._record(rollback, 10, rollback.view(torch.uint8).numpy().tobytes())
    slow._record(rollback, 10)
    assert fast.history is not None and slow.history is not None
    assert fast.position == slow.position == 12 and torch.equal(fast.history, slow.history)
    assert torch.equal(fast.history[:, :5], prompt) and torch.equal(fast.history[:, 10:12], rollback)
    fast.reorder(torch.arange(batch).flip(0))  # a new buffer: written from values again
    slow.reorder(torch.arange(batch).flip(0))
    nxt = torch.randn(batch, 1, 8).to(torch.bfloat16)
    fast._record(nxt, 12, nxt.view(torch.uint8).numpy().tobytes())
    slow._record(nxt, 12)
    assert torch.equal(fast.history, slow.history)
