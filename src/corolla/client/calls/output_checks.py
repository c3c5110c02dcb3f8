"""What a client checks in every server's outputs before using them or sending them downstream (finite, the shape
asked for, a floating dtype a server may use), and the numeric tolerance when two servers' outputs are compared."""

from __future__ import annotations

import torch

from corolla.utils.finite import all_finite

WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what servers compute and send activations in

# Verification tolerance (relative L2 error between two servers' outputs for the same inputs):
# VERIFY_RTOL_PER_EPS x machine epsilon of the coarser of the two dtypes, never below VERIFY_MIN_RTOL:
# float32 -> 1e-3, float16 -> 0.031, bfloat16 -> 0.25. Honest servers differ by rounding (cached vs. uncached
# attention, other kernels, another dtype); a liar that changes a token's hidden state by less than this can pass.
VERIFY_RTOL_PER_EPS = 32.0
VERIFY_MIN_RTOL = 1e-3


class BadServerOutput(ConnectionError):
    """A server's response failed a check: the failure is that server's (it is banned), never the next one's.
    `taints_history` is True when earlier unchecked outputs of the server may be wrong too (a failed comparison),
    so later spans must recompute from the start."""

    def __init__(self, peer_id: str, message: str, *, taints_history: bool = False):
        self.peer_id, self.taints_history = peer_id, taints_history
        super().__init__(f"server ...{peer_id[-6:]}: {message}")


def check_outputs(
    outputs: torch.Tensor, *, expected_shape: tuple[int, ...] | torch.Size, peer_id: str, what: str
) -> torch.Tensor:
    """Returns `outputs` if they have `expected_shape`, a wire dtype and only finite values; BadServerOutput else."""
    if tuple(outputs.shape) != tuple(expected_shape):
        raise BadServerOutput(peer_id, f"{what} has shape {list(outputs.shape)}, expected {list(expected_shape)}")
    if outputs.dtype not in WIRE_DTYPES:
        raise BadServerOutput(peer_id, f"{what} has dtype {outputs.dtype}, expected one of {list(WIRE_DTYPES)}")
    if outputs.numel() and not all_finite(outputs):
        count = int((~torch.isfinite(outputs)).sum())
        raise BadServerOutput(peer_id, f"{what} has {count} non-finite values (NaN/Inf)")
    return outputs


def verify_rtol(*dtypes: torch.dtype) -> float:
    """Tolerance of the relative L2 error between outputs computed in `dtypes` (see VERIFY_RTOL_PER_EPS)."""
    eps = max(torch.finfo(d).eps if d.is_floating_point else 1.0 for d in dtypes)
    return max(VERIFY_MIN_RTOL, VERIFY_RTOL_PER_EPS * eps)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||a||, ||b||) in float32 (inf if shapes differ; 0 for two zero tensors)."""
    if a.shape != b.shape:
        return float("inf")
    a32, b32 = a.float(), b.float()
    scale = max(float(a32.norm()), float(b32.norm()))
    if scale == 0.0:
        return 0.0
    return float((a32 - b32).norm()) / scale
