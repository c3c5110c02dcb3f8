"""What a client checks in every server's outputs before using them or sending them downstream (finite, the shape
asked for, a floating dtype a server may use; within the range of the dtype the next server announces), and the
numeric tolerance when two servers' outputs are compared."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from hivemind.proto import runtime_pb2

from corolla.models.config import DTYPE_NAMES
from corolla.protocol.codecs import check_castable, deserialize_tensor, plain_record
from corolla.protocol.records import RemoteSpanInfo, ServerInfo
from corolla.utils.finite import all_finite, bytes_finite

WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what servers compute and send activations in

# Verification tolerance (relative L2 error between two servers' outputs for the same inputs):
# VERIFY_RTOL_PER_EPS x machine epsilon of the coarser of the two dtypes, never below VERIFY_MIN_RTOL:
# float32 -> 1e-3, float16 -> 0.031, bfloat16 -> 0.25. Honest servers differ by rounding (cached vs. uncached
# attention, other kernels, another dtype); a liar that changes a token's hidden state by less than this can pass.
# Per position, honest servers' errors measured 50x under these (`benchmarks.field.verify_tolerance`, RESULTS.md; a
# float replica checking a quantized server is not measured).
VERIFY_RTOL_PER_EPS = 32.0
VERIFY_MIN_RTOL = 1e-3
QUANTIZED_RTOL = 0.3  # a server announcing int8/nf4 weights differs from a float one by more than rounding
# what an honest reply holds besides its tensors' values: metadata (decoded within 64 KiB), codebooks, protobuf fields
REPLY_OVERHEAD_BYTES = 1 << 20


class BadServerOutput(ConnectionError):
    """A server's response failed a check: the failure is that server's (it is banned), never the next one's.
    `taints_history` is True when earlier unchecked outputs of the server may be wrong too (a failed comparison),
    so later spans must recompute from the start."""

    def __init__(self, peer_id: str, message: str, *, taints_history: bool = False):
        self.peer_id, self.taints_history = peer_id, taints_history
        super().__init__(f"server ...{peer_id[-6:]}: {message}")


class OutputsDisputed(BadServerOutput):
    """Two servers that agree with each other outvoted this server's outputs, but neither has the standing a witness
    needs (`client.verification.witnesses`, decision 0190: they may be one attacker's free identities): its outputs
    are not used (`taints_history`), it is avoided for a while, not banned."""

    def __init__(self, peer_id: str, message: str):
        super().__init__(peer_id, message, taints_history=True)


class InputsOutOfRange(ConnectionError):
    """A span's inputs (the previous span's outputs, legal in the client's dtype, or the client's own) hold values
    beyond the finite range of the dtype the span's server announces (float16: +-65504), which it would refuse, and
    the refusal, a failed request, got it banned (decision 0170). Nobody is at fault and nothing was sent: the server
    is left out of routes for a while (`retries.RANGE_AVOID_S`) and the span re-routed."""

    def __init__(self, peer_id: str, message: str):
        self.peer_id = peer_id
        super().__init__(f"server ...{peer_id[-6:]}: {message}")


def input_range_dtype(info: ServerInfo) -> torch.dtype | None:
    """The dtype whose range a server's inputs must keep (`check_fits`): float16 where it announces it computes in
    float16 (`torch_dtype`, as corolla and Petals servers write it), else None (not checked). float16 (+-65504) is the
    one wire dtype whose range legal activations reach; float32 values past bfloat16's range are a liar's alone, not
    worth a reduction a step (decision 0170)."""
    return (
        torch.float16 if info.torch_dtype is not None and DTYPE_NAMES.get(info.torch_dtype) is torch.float16 else None
    )


def check_fits(tensor: torch.Tensor, dtype: torch.dtype, *, peer_id: str, what: str) -> None:
    """InputsOutOfRange where finite `tensor` would not stay finite cast to `dtype`, as the server announcing it
    casts its inputs (`codecs.check_castable`: a pass over the values only where `dtype`'s range is narrower)."""
    try:
        check_castable(tensor, dtype, name=what, finite_checked=True)
    except ValueError as e:
        raise InputsOutOfRange(peer_id, str(e)) from None


def check_inputs_fit(span: RemoteSpanInfo, **tensors: torch.Tensor) -> None:
    """`check_fits` of each of a call's `tensors` (by name) against `span`'s server's `input_range_dtype`."""
    dtype = input_range_dtype(span.server_info)
    if dtype is not None:
        for name, tensor in tensors.items():
            check_fits(tensor, dtype, peer_id=span.peer_id, what=name)


def check_outputs(
    outputs: torch.Tensor,
    *,
    expected_shape: tuple[int, ...] | torch.Size,
    peer_id: str,
    what: str,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Returns `outputs` if they have `expected_shape`, a wire dtype and only finite values, which stay finite cast
    to `dtype` where given (the client's, in which they go on: float32 1e6 is inf in a float16 client, and the next
    server, given inf, was blamed for it); BadServerOutput else."""
    _check_form(tuple(outputs.shape), outputs.dtype, expected_shape=expected_shape, peer_id=peer_id, what=what)
    finite = not outputs.numel() or all_finite(outputs)
    return _check_values(outputs, finite, peer_id=peer_id, what=what, dtype=dtype)


def read_output(
    record: runtime_pb2.Tensor,
    *,
    expected_shape: tuple[int, ...] | torch.Size,
    peer_id: str,
    what: str,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`check_outputs(deserialize_tensor(record), ...)` (an undecodable record is BadServerOutput too), with the
    usual record (raw values: `codecs.plain_record`) checked on its header and bytes before its tensor is built:
    the same checks and messages, in fewer calls (a stepping thread runs them cold after each wait, where every torch
    or numpy call costs 5-10 us: benchmarks.users.client_cpu)."""
    plain = plain_record(record)
    if plain is None:  # another codec or form: decoded, then checked as a tensor
        try:
            outputs = deserialize_tensor(record)
        except ValueError as e:
            raise BadServerOutput(peer_id, f"undecodable {what}: {e}") from e
        return check_outputs(outputs, expected_shape=expected_shape, peer_id=peer_id, what=what, dtype=dtype)
    wire_dtype, shape, buffer = plain
    _check_form(shape, wire_dtype, expected_shape=expected_shape, peer_id=peer_id, what=what)
    if not buffer:  # no values (every itemsize is >= 1)
        return torch.empty(shape, dtype=wire_dtype)
    outputs = torch.frombuffer(bytearray(buffer), dtype=wire_dtype).view(shape)  # [*shape] writable, its own memory
    return _check_values(outputs, bytes_finite(buffer, wire_dtype), peer_id=peer_id, what=what, dtype=dtype)


def _check_form(
    shape: tuple[int, ...], wire_dtype: torch.dtype, *, expected_shape: Sequence[int], peer_id: str, what: str
) -> None:
    """BadServerOutput unless an output's shape is `expected_shape` and its dtype a wire dtype."""
    if shape != tuple(expected_shape):
        raise BadServerOutput(peer_id, f"{what} has shape {list(shape)}, expected {list(expected_shape)}")
    if wire_dtype not in WIRE_DTYPES:
        raise BadServerOutput(peer_id, f"{what} has dtype {wire_dtype}, expected one of {list(WIRE_DTYPES)}")


def _check_values(
    outputs: torch.Tensor, finite: bool, *, peer_id: str, what: str, dtype: torch.dtype | None
) -> torch.Tensor:
    """`outputs` if `finite` (their values were checked, on the tensor or on its bytes) and they stay finite cast to
    `dtype` where given; BadServerOutput else."""
    if not finite:
        count = int((~torch.isfinite(outputs)).sum())
        raise BadServerOutput(peer_id, f"{what} has {count} non-finite values (NaN/Inf)")
    if dtype is not None and dtype != outputs.dtype:
        try:
            check_castable(outputs, dtype, name=what, finite_checked=True)
        except ValueError as e:
            raise BadServerOutput(peer_id, str(e)) from None
    return outputs


def reply_limit_bytes(*shapes: Sequence[int]) -> int:
    """The most bytes an honest reply carrying tensors of `shapes` holds: 4 a value (float32, the widest wire dtype;
    every codec writes at most that plus a header of its own) and `REPLY_OVERHEAD_BYTES`. A reply past it is the
    server's failure, refused as its bytes arrive."""
    return 4 * sum(math.prod(shape) for shape in shapes) + REPLY_OVERHEAD_BYTES


def verify_rtol(*dtypes: torch.dtype, quantized: bool = False) -> float:
    """Tolerance of the relative L2 error between outputs computed in `dtypes` (see VERIFY_RTOL_PER_EPS), at least
    QUANTIZED_RTOL where either server announces `quantized` weights."""
    eps = max(torch.finfo(d).eps if d.is_floating_point else 1.0 for d in dtypes)
    rtol = max(VERIFY_MIN_RTOL, VERIFY_RTOL_PER_EPS * eps)
    return max(rtol, QUANTIZED_RTOL) if quantized else rtol


def comparison_rtol(configured: float | None, spans: Sequence[RemoteSpanInfo], *dtypes: torch.dtype) -> float:
    """The tolerance comparing outputs of `spans`' servers in `dtypes`: `ClientConfig.verify_rtol` where set."""
    if configured is not None:
        return configured
    return verify_rtol(*dtypes, quantized=any(s.server_info.quant_type not in (None, "", "none") for s in spans))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||a||, ||b||) in float32 (inf if shapes differ; 0 for two zero tensors)."""
    if a.shape != b.shape:
        return float("inf")
    a32, b32 = a.float(), b.float()
    scale = max(float(a32.norm()), float(b32.norm()))
    if scale == 0.0:
        return 0.0
    return float((a32 - b32).norm()) / scale
