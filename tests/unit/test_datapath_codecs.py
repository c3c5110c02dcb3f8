"""The per-step data path's shortcuts keep the wire and the checks exactly as before: raw tensor (de)serialization
equals hivemind's codec byte for byte, the finite check equals torch.isfinite, and merged runtime results reach
callers of several event loops."""

from __future__ import annotations

import asyncio
import threading

import hivemind.compression.base
import pytest
import torch
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from corolla.protocol.codecs import deserialize_tensor, serialize_tensor, serialize_tensor_bytes
from corolla.server.core.runtime import Runtime
from corolla.server.front.block_functions import all_finite
from corolla.utils.tensor_bytes import TensorBytes

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape) * 100).to(dtype)
    return torch.randint(0, 100, shape).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 5), (0,), (1, 0, 16), ()])
def test_raw_serialization_equals_hivemind_byte_for_byte(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = _sample(dtype, shape)
    ours = serialize_tensor(tensor)
    assert ours.SerializeToString() == serialize_torch_tensor(tensor).SerializeToString()
    decoded = deserialize_tensor(ours)
    reference = deserialize_torch_tensor(ours)
    assert decoded.dtype == reference.dtype == dtype and decoded.shape == reference.shape
    assert torch.equal(decoded, reference)


def test_non_contiguous_and_grad_tensors_serialize_like_hivemind() -> None:
    base = torch.randn(4, 6, 8).to(torch.bfloat16)
    view = base.transpose(0, 2)[1:, :, ::2]
    assert serialize_tensor(view).SerializeToString() == serialize_torch_tensor(view).SerializeToString()
    leaf = torch.randn(2, 3, requires_grad=True)
    ours = serialize_tensor(leaf)
    assert ours.SerializeToString() == serialize_torch_tensor(leaf).SerializeToString()
    decoded = deserialize_tensor(ours)
    assert decoded.requires_grad and torch.equal(decoded.detach(), leaf.detach())


def test_legacy_bfloat16_forms_decode_and_encode_like_hivemind(monkeypatch: pytest.MonkeyPatch) -> None:
    tensor = torch.randn(1, 2, 8).to(torch.bfloat16)
    monkeypatch.setattr(hivemind.compression.base, "USE_LEGACY_BFLOAT16", True)
    legacy = serialize_tensor(tensor)
    assert legacy.SerializeToString() == serialize_torch_tensor(tensor).SerializeToString()
    assert len(legacy.buffer) == tensor.numel() * 4
    monkeypatch.setattr(hivemind.compression.base, "USE_LEGACY_BFLOAT16", False)
    decoded = deserialize_tensor(legacy)
    assert decoded.dtype == torch.bfloat16 and torch.equal(decoded, tensor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 1, 16), (1, 4, 8)])
@pytest.mark.parametrize("legacy", [False, True])
def test_a_launched_steps_bytes_serialize_as_its_tensor_would(
    dtype: torch.dtype, shape: tuple[int, ...], legacy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a launched decode step's output comes as its rows' bytes (`TensorBytes`): its reply is what hivemind writes for
    # the tensor they hold, in every compression (NONE built from the bytes; the others, and legacy bf16, through the
    # tensor)
    monkeypatch.setattr(hivemind.compression.base, "USE_LEGACY_BFLOAT16", legacy)
    tensor = _sample(dtype, shape)
    output = TensorBytes(memoryview(bytearray(tensor.view(torch.uint8).numpy().tobytes())), dtype, shape)
    none = serialize_tensor_bytes(output).SerializeToString()
    assert none == serialize_tensor(tensor).SerializeToString() == serialize_torch_tensor(tensor).SerializeToString()
    # built in place in a reply (`into`: a step's response): the message hivemind writes around the same record
    reply = runtime_pb2.ExpertResponse(tensors=[serialize_torch_tensor(tensor)]).SerializeToString()
    for serialize, value in ((serialize_tensor_bytes, output), (serialize_tensor, tensor)):
        response = runtime_pb2.ExpertResponse()
        added = serialize(value, runtime_pb2.CompressionType.NONE, response.tensors)  # type: ignore[operator]
        assert response.SerializeToString() == reply and added.SerializeToString() == none
    meanstd = runtime_pb2.CompressionType.MEANSTD_16BIT
    try:
        reference = serialize_tensor(tensor, meanstd).SerializeToString()
    except ValueError:  # (hivemind's legacy bf16 form refuses it)
        with pytest.raises(ValueError):
            serialize_tensor_bytes(output, meanstd)
    else:
        assert serialize_tensor_bytes(output, meanstd).SerializeToString() == reference
        response = runtime_pb2.ExpertResponse()
        assert serialize_tensor_bytes(output, meanstd, response.tensors).SerializeToString() == reference
        assert (
            response.SerializeToString()
            == runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor.FromString(reference)]).SerializeToString()
        )


def test_decoded_tensor_is_writable_and_owns_its_memory() -> None:
    tensor = torch.arange(16, dtype=torch.float32).view(2, 8)
    serialized = serialize_tensor(tensor)
    decoded = deserialize_tensor(serialized)
    decoded.add_(1)  # in place: must neither fail nor touch the message
    assert torch.equal(deserialize_tensor(serialized), tensor)


def test_malformed_raw_tensors_are_value_errors() -> None:
    good = serialize_tensor(torch.ones(2, 4, dtype=torch.bfloat16))
    short = runtime_pb2.Tensor()
    short.CopyFrom(good)
    short.buffer = good.buffer[:-2]
    with pytest.raises(ValueError, match="bytes"):
        deserialize_tensor(short)
    int_grad = serialize_tensor(torch.ones(3, dtype=torch.int64))
    int_grad.requires_grad = True
    with pytest.raises(ValueError, match="require grad"):
        deserialize_tensor(int_grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_all_finite_matches_torch_isfinite(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    specials = [float("nan"), float("inf"), float("-inf"), info.max, -info.max, info.tiny, info.tiny / 4, 0.0, -0.0]
    for value in specials:
        tensor = torch.randn(2, 3, 16).to(dtype)
        tensor[1, 2, 7] = value
        assert all_finite(tensor) == bool(torch.isfinite(tensor).all()), (dtype, value)
        view = tensor.transpose(0, 2)
        assert all_finite(view) == bool(torch.isfinite(view).all())
    assert all_finite(torch.empty(1, 0, 16, dtype=dtype))


async def test_merged_results_reach_callers_in_several_event_loops() -> None:
    """One merged batch with tasks from two loops: each caller gets its own result (or error) in its own loop."""

    def executor(tasks):
        return [ValueError("bad") if t.payload < 0 else t.payload * 2 for t in tasks]

    started, gate = threading.Event(), threading.Event()
    with Runtime(max_batch_size_tokens=64) as runtime:
        runtime.register_batch_executor("decode", executor)
        blocker = runtime.submit(lambda: (started.set(), gate.wait(10)), priority=0, size_tokens=1)
        assert await asyncio.to_thread(started.wait, 5)

        def submit(payload: int):
            return runtime.submit(
                lambda: None, priority=1, size_tokens=1, kind="decode", merge_key="s", payload=payload
            )

        other_results: list = []
        other_ready = threading.Event()

        def other_loop() -> None:
            async def main() -> None:
                futures = [submit(10), submit(-1)]
                other_ready.set()
                other_results.extend(await asyncio.gather(*futures, return_exceptions=True))

            asyncio.run(main())

        thread = threading.Thread(target=other_loop)
        thread.start()
        assert await asyncio.to_thread(other_ready.wait, 5)
        ours = [submit(1), submit(-2), submit(3)]
        gate.set()
        await blocker
        results = await asyncio.wait_for(asyncio.gather(*ours, return_exceptions=True), 5)
        await asyncio.to_thread(thread.join, 5)
    assert results[0] == 2 and results[2] == 6 and isinstance(results[1], ValueError)
    assert other_results[0] == 20 and isinstance(other_results[1], ValueError)
    assert runtime.num_batches_done == 2  # the blocker, then all five merged steps at once
