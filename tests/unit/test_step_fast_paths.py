"""The handler's per-step fast paths decode and refuse exactly what the general paths do: `deserialize_tensor`'s
plain case (NONE compression, exact buffer) against the checked general decoder, and Petals' step
`args_structure` against `unpack_args_kwargs`."""

from __future__ import annotations

import pytest
import torch
from hivemind.proto import runtime_pb2

from corolla.protocol import codecs
from corolla.protocol.codecs import TensorLimits, deserialize_tensor, serialize_tensor
from corolla.protocol.packing import pack_args_kwargs, unpack_args_kwargs
from corolla.server.front import block_functions as bf


def _general(serialized: runtime_pb2.Tensor, limits: TensorLimits = codecs.DEFAULT_TENSOR_LIMITS) -> torch.Tensor:
    """The general decoder alone (what deserialize_tensor did before its plain-case shortcut)."""
    shape = codecs._check_header(serialized, limits)
    return codecs._deserialize_raw(serialized, shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8])
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 8), (0,), (1, 0, 64), ()])
def test_plain_case_equals_the_general_decoder(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = (torch.randn(shape) * 3).to(dtype)
    serialized = serialize_tensor(tensor)
    fast = codecs._deserialize_plain(serialized, codecs.DEFAULT_TENSOR_LIMITS)
    assert fast is not None
    general = _general(serialized)
    assert fast.dtype == general.dtype == dtype and fast.shape == general.shape == tensor.shape
    assert torch.equal(fast, general) and torch.equal(fast, tensor)
    if dtype.is_floating_point and fast.numel():
        fast.add_(1)  # writable, its own memory: the message's bytes are untouched
        assert serialized.buffer == serialize_tensor(tensor).buffer and not torch.equal(fast, general)


def _forged(**fields: object) -> runtime_pb2.Tensor:
    base = dict(compression=runtime_pb2.CompressionType.NONE, buffer=b"\0" * 256, size=[1, 1, 64], dtype="float32")
    base.update(fields)
    return runtime_pb2.Tensor(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "serialized, match",
    [
        (_forged(buffer=b"\0" * 255), "expected 256"),  # truncated
        (_forged(buffer=b"\0" * 257), "expected 256"),  # trailing bytes
        (_forged(size=[1 << 20, 1 << 20, 64]), "more than the limit"),  # oversized: refused before allocation
        (_forged(size=[1] * 9, buffer=b"\0" * 4), "dims, more than the limit"),
        (_forged(dtype="S16000000"), "unsupported tensor dtype"),  # numpy would allocate whatever it declares
        (_forged(dtype="int64", requires_grad=True, buffer=b"\0" * 512), "only float tensors require grad"),
    ],
)
def test_forged_records_fail_with_the_general_errors(serialized: runtime_pb2.Tensor, match: str) -> None:
    assert codecs._deserialize_plain(serialized, codecs.DEFAULT_TENSOR_LIMITS) is None  # never the shortcut
    with pytest.raises(ValueError, match=match):
        deserialize_tensor(serialized)


def test_limits_apply_to_the_plain_case() -> None:
    serialized = serialize_tensor(torch.zeros(1, 4, 64))
    small = TensorLimits(max_elements=100)
    assert codecs._deserialize_plain(serialized, small) is None
    with pytest.raises(ValueError, match="more than the limit of 100"):
        deserialize_tensor(serialized, small)
    assert deserialize_tensor(serialized).shape == (1, 4, 64)


def test_legacy_bf16_and_grad_records_take_the_general_path() -> None:
    values = torch.randn(1, 2, 8)
    legacy = _forged(dtype="bfloat16", size=[1, 2, 8], buffer=values.numpy().tobytes())  # fp32-coded bf16
    assert codecs._deserialize_plain(legacy, codecs.DEFAULT_TENSOR_LIMITS) is None
    assert torch.equal(deserialize_tensor(legacy), values.to(torch.bfloat16))
    grad = serialize_tensor(values.requires_grad_(True))
    assert codecs._deserialize_plain(grad, codecs.DEFAULT_TENSOR_LIMITS) is None
    assert deserialize_tensor(grad).requires_grad


def test_petals_step_structure_unpacks_like_the_general_unpacker() -> None:
    tensors, structure = pack_args_kwargs(torch.ones(1, 1, 8), torch.empty(0), torch.empty(0, dtype=torch.int64))
    assert structure == bf.PETALS_STEP_STRUCTURE
    fast = bf.unpack_request_args(tensors, structure)
    general, _ = unpack_args_kwargs(tensors, structure)
    assert len(fast) == len(general) == 3 and all(a is b for a, b in zip(fast, general, strict=True))
    with pytest.raises(ValueError, match="only 2 tensors were sent"):  # the shortcut needs all three tensors
        bf.unpack_request_args(tensors[:2], structure)
    listed = [[b"__T0", b"__T1", b"__T2"], {}]  # lists, not tuples: not the shortcut, same result
    assert all(a is b for a, b in zip(bf.unpack_request_args(tensors, listed), fast, strict=True))
