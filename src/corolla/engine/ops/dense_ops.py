"""The Falcon/BLOOM decode step's glue between projections, each with a torch reference (CPU, fallback) and a fused
CUDA version: the residual add(s) with the next LayerNorm in one Triton kernel (`dense_kernels`), and the up
projection with its bias and tanh GELU in cuBLASLt's epilogue (`torch._addmm_activation`) where the device's
epilogue computes the tanh GELU. All are CUDA-graph safe: static shapes, no host sync."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from corolla.engine.ops.decode_ops import triton_usable
from corolla.utils.logging import get_logger

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs use the reference versions.
    from corolla.engine.kernels import dense_kernels

    DENSE_TRITON_IMPORTED = True
except ImportError:  # pragma: no cover - depends on the installation
    DENSE_TRITON_IMPORTED = False

logger = get_logger(__name__)


def add_layer_norm_ref(
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h = residual + (a + b) (b None: residual + a; a None: residual), each sum rounded to the dtype as the blocks
    add their residuals; returns (h [N, H], LayerNorm(h) with weight/bias [H] or None when weight is None)."""
    h = residual
    if a is not None:
        h = residual + (a if b is None else a + b)  # [N, H]
    normed = None if weight is None else F.layer_norm(h, (h.shape[-1],), weight, bias, eps)
    return h, normed


class DenseOps:
    """Picks the fused CUDA versions or the references once per span; `gelu_epilogue` is set by
    `choose_gelu_epilogue`."""

    def __init__(self, device: torch.device, head_dim: int, *, use_triton: bool):
        self.use_triton = use_triton and DENSE_TRITON_IMPORTED and triton_usable(device, head_dim)
        self.gelu_epilogue = False  # up projection + bias + tanh GELU as one cuBLASLt call

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        # x [N, H] -> LayerNorm(x) [N, H]
        if self.use_triton and x.stride(-1) == 1:
            normed = dense_kernels.add_layer_norm(None, None, x, weight, bias, eps)[1]
            assert normed is not None
            return normed
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    def add_norm(
        self,
        a: torch.Tensor,
        b: torch.Tensor | None,
        residual: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, LayerNorm(h)) for h = residual + a (+ b, summed first); all [N, H]."""
        fn = dense_kernels.add_layer_norm if self.use_triton else add_layer_norm_ref
        h, normed = fn(a, b, residual, weight, bias, eps)
        assert normed is not None
        return h, normed

    def add(self, a: torch.Tensor, b: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
        """residual + a (+ b, summed first) [N, H], one kernel on CUDA."""
        fn = dense_kernels.add_layer_norm if self.use_triton else add_layer_norm_ref
        return fn(a, b, residual, None, None, 0.0)[0]

    def up_gelu(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """tanh-GELU(x @ weight^T + bias) with the bias and GELU in cuBLASLt's epilogue (fp32 before the one
        rounding; torch falls back to a GEMM and a GELU kernel where Lt does not apply); x [N, K] -> [N, I]."""
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)

    @torch.inference_mode()
    def choose_gelu_epilogue(self, weight: torch.Tensor, probe_rows: Sequence[int]) -> bool:
        """Sets `gelu_epilogue` (the up projections of `weight`'s shape through `up_gelu`) where cuBLASLt's epilogue
        runs and computes the tanh GELU at every row count of `probe_rows`; else the projection then a GELU kernel
        stay. Not timed: the epilogue was the faster wherever it ran (docs/decisions/0242)."""
        try:
            other_rows = self.rows_without_tanh_gelu(weight, probe_rows)
        except RuntimeError as e:  # an epilogue this cuBLAS cannot run: keep the separate kernels
            logger.warning(f"dense_ops.gelu_epilogue_unavailable(error={str(e)[:200]})")
            return False
        if other_rows:  # another GELU than the model's (a fallback computing erf-GELU): keep the separate kernels
            logger.warning(f"dense_ops.gelu_epilogue_not_tanh(rows={other_rows})")
            return False
        self.gelu_epilogue = True
        return True

    def rows_without_tanh_gelu(self, weight: torch.Tensor, probe_rows: Sequence[int]) -> list[int]:
        """The row counts of `probe_rows` at which `up_gelu` does not compute the tanh GELU (torch's CPU version and
        some fallbacks compute the erf form): an identity weight of `weight`'s shape on inputs in [-4, -2], where
        the two forms differ by ~10% (far above one bf16 rounding)."""
        i, k = weight.shape
        n = min(i, k)
        eye = torch.eye(i, k, device=weight.device, dtype=weight.dtype)  # [I, K]
        zeros = torch.zeros(i, device=weight.device, dtype=weight.dtype)
        line = torch.linspace(-4.0, -2.0, k, device=weight.device).to(weight.dtype)  # [K]
        other = []
        for rows in probe_rows:
            x = line.expand(rows, k).contiguous()  # [rows, K]
            got = self.up_gelu(x, eye, zeros)[:, :n].float()  # [rows, n]
            xs = x[:, :n].float()
            tanh_err = float((got - F.gelu(xs, approximate="tanh")).abs().max())
            erf_err = float((got - F.gelu(xs)).abs().max())
            if not tanh_err * 4 < erf_err:
                other.append(rows)
        return other
