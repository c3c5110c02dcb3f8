"""The client sends activations in the compression a server advertises (as Petals clients do), never integers."""

from __future__ import annotations

import torch
from hivemind.proto.runtime_pb2 import CompressionType

from corolla.client.calls.remote_forward_backward import serialize_activations
from corolla.protocol.codecs import deserialize_tensor


def test_float_activations_take_the_servers_compression_and_ints_stay_raw():
    hidden = torch.randn(1, 3, 8)
    hypo_ids = torch.arange(1, dtype=torch.int64)
    dummy = torch.empty(0)
    out = serialize_activations([hidden, dummy, hypo_ids], CompressionType.FLOAT16)
    assert [t.compression for t in out] == [CompressionType.FLOAT16, CompressionType.NONE, CompressionType.NONE]
    assert len(out[0].buffer) == hidden.numel() * 2  # float16 on the wire
    torch.testing.assert_close(deserialize_tensor(out[0]), hidden, atol=1e-2, rtol=1e-3)
    assert deserialize_tensor(out[2]).tolist() == hypo_ids.tolist()


def test_bfloat16_is_not_squeezed_into_float16():
    hidden = torch.randn(1, 2, 8, dtype=torch.bfloat16)
    (out,) = serialize_activations([hidden], CompressionType.FLOAT16)
    assert out.compression == CompressionType.NONE
    assert torch.equal(deserialize_tensor(out), hidden)
    (meanstd,) = serialize_activations([hidden.float()], CompressionType.MEANSTD_16BIT)
    assert meanstd.compression == CompressionType.MEANSTD_16BIT
