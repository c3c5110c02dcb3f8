"""CPU projections chosen by measurement: at the engine's warm-up, each projection shape of the span (N, K, with or
without bias and residual) times a few formulations of the same float32 GEMM on the real weights, for each row
bucket of a decode step, and keeps the fastest; `DecodeOps` then runs that formulation for inputs of that bucket.

Why: on a CPU a decode step is bound by streaming the weights from memory, which a merged forward of M rows should
pay once. Which library call does that best depends on the CPU and the BLAS: on an AVX2 AMD EPYC with torch's MKL,
`F.linear` at 4-16 rows cost ~3.5x its single-row GEMV, while the transposed problem (`W @ x^T`, MKL's wide GEMM)
or oneDNN's inner product cost 1.3-2.5x. The candidates are plain torch calls (no kernels of our own); one is
chosen per (shape, bucket), so a row's result may differ in the last float32 bits between buckets (never within
one: every row of a merged forward goes through the same call).

`CpuLinearConfig` is the typed setting (an opt-out, the candidates, the buckets, repetitions, how many layers'
weights each timing streams); `tune` measures and returns a `CpuLinearChoices`, the table `DecodeOps` reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

# (x [M, K], weight [N, K], bias [N] | None, residual [M, N] | None) -> [M, N] contiguous
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]
# (N, K, has_bias, has_residual): one projection shape as the chooser keys it
SlotKey = tuple[int, int, bool, bool]
# (candidate name, kernel, [(weight, bias)] of the timed layers, x [M, K], residual [M, N] | None) -> milliseconds
TimeFn = Callable[
    [str, Kernel, Sequence[tuple[torch.Tensor, torch.Tensor | None]], torch.Tensor, torch.Tensor | None], float
]


def linear_kernel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, res: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, the residual in `addmm`'s epilogue: what the engine ran before (and runs above every bucket)."""
    if res is None:
        return F.linear(x, w, b)  # [M, N]
    out = torch.addmm(res, x, w.t())  # [M, N]
    return out if b is None else out + b


def transposed_kernel(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, res: torch.Tensor | None
) -> torch.Tensor:
    """The transposed problem (W @ x^T)^T: the BLAS sees a [N, K] x [K, M] GEMM (wide output, M columns)."""
    if res is None:
        out_t = torch.mm(w, x.t())  # [N, M]
    else:
        out_t = torch.addmm(res.t(), w, x.t())  # [N, M], the residual's transpose in the epilogue
    out = out_t.t().contiguous()  # [M, N]
    return out if b is None else out.add_(b)


def onednn_kernel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, res: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's inner product on the plain weight (no packed copy), the residual added in its post-op."""
    x = x.contiguous()  # [M, K]
    if res is None:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")  # [M, N]
    return torch.ops.mkldnn._linear_pointwise.binary(x, res.contiguous(), w, b, "add")  # [M, N]


KERNELS: dict[str, Kernel] = {"linear": linear_kernel, "transposed": transposed_kernel, "onednn": onednn_kernel}
DEFAULT_CANDIDATES = ("linear", "transposed", "onednn")


def available(name: str) -> bool:
    """Whether candidate `name` can run in this torch build (oneDNN needs torch built with it)."""
    if name == "onednn":
        return bool(torch.backends.mkldnn.is_available())
    return name in KERNELS


@dataclass(frozen=True)
class CpuLinearConfig:
    """How the CPU projections are chosen at warm-up. `bucket_rows`: the top of each row bucket (a bucket serves
    rows above the previous top up to its own; each is timed at its top); inputs above the last bucket (prefill)
    run `linear`. `bytes_timed`: one timing streams the first layers' weights of a shape until this many bytes
    (or all layers): distinct weights past the last-level cache, so no cache flatters a candidate. `reps`: timed
    passes per candidate, candidates alternated, the fastest pass kept (robust to other processes on the same
    cores). Warm-up cost: (1 + reps) x candidates x buckets passes over about `bytes_timed` of each shape's weights
    (one layer's at least), so it does not grow with the number of layers: ~2-4 s for the 159M CPU span on a quiet
    2-core VM, 10-18 s with another process busy on one of the cores and libgomp spinning (logged as
    `cpu_linear.tuned(seconds=...)`; `enabled=False` skips it)."""

    enabled: bool = True
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    bucket_rows: tuple[int, ...] = (1, 4, 16, 64)
    reps: int = 3
    bytes_timed: int = 40 << 20  # past a 32 MiB last-level cache

    def __post_init__(self) -> None:
        unknown = [c for c in self.candidates if c not in KERNELS]
        if unknown or not self.candidates:
            raise ValueError(f"candidates must be a non-empty subset of {sorted(KERNELS)}, got {self.candidates}")
        if not self.bucket_rows or any(b < 1 for b in self.bucket_rows):
            raise ValueError(f"bucket_rows must be positive row counts, got {self.bucket_rows}")
        if list(self.bucket_rows) != sorted(set(self.bucket_rows)):
            raise ValueError(f"bucket_rows must be strictly increasing, got {self.bucket_rows}")
        if self.reps < 1 or self.bytes_timed < 1:
            raise ValueError(f"reps and bytes_timed must be >= 1, got {self.reps}, {self.bytes_timed}")


class CpuLinearChoices:
    """The chosen candidate per (shape, bucket); `kernel(...)` is what `DecodeOps` asks per projection call."""

    def __init__(self, bucket_rows: tuple[int, ...], chosen: dict[tuple[SlotKey, int], str]):
        self.bucket_rows = bucket_rows
        self.chosen = dict(chosen)  # (slot, bucket top) -> candidate name
        self._kernels = {key: KERNELS[name] for key, name in chosen.items()}
        # rows -> bucket top, for every row count a bucket serves (a list index instead of a search per call)
        self._bucket_of = [0] + [next(b for b in bucket_rows if b >= rows) for rows in range(1, bucket_rows[-1] + 1)]

    def bucket_of(self, rows: int) -> int | None:
        """The top of the bucket serving `rows` (None above the last bucket)."""
        return self._bucket_of[rows] if 0 < rows < len(self._bucket_of) else None

    def kernel(self, rows: int, n: int, k: int, has_bias: bool, has_residual: bool) -> Kernel | None:
        """The chosen kernel for `rows` rows of this shape, or None (not tuned, or above the buckets)."""
        bucket = self.bucket_of(rows)
        if bucket is None:
            return None
        return self._kernels.get(((n, k, has_bias, has_residual), bucket))


def time_passes(
    name: str,
    kernel: Kernel,
    items: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    x: torch.Tensor,
    residual: torch.Tensor | None,
) -> float:
    """Wall milliseconds of one pass of `kernel` over every (weight, bias) in `items`."""
    start = time.perf_counter()
    for w, b in items:
        kernel(x, w, b, residual)
    return (time.perf_counter() - start) * 1000


def pick(timings: dict[str, float]) -> str:
    """The fastest candidate (the first listed among equals)."""
    if not timings:
        raise ValueError("no candidate was timed")
    return min(timings, key=timings.__getitem__)


def _timed_layers(
    layers: list[tuple[torch.Tensor, torch.Tensor | None]], bytes_timed: int
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The first layers whose weights add up to `bytes_timed` (at least one, at most all)."""
    total = 0
    for i, (w, _) in enumerate(layers):
        total += w.numel() * w.element_size()
        if total >= bytes_timed:
            return layers[: i + 1]
    return layers


def _runs(
    name: str,
    time_fn: TimeFn,
    items: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    x: torch.Tensor,
    residual: torch.Tensor | None,
) -> bool:
    """One untimed pass of candidate `name` (library warm-up, first touch); False, logged, where the library
    refuses these inputs (e.g. oneDNN's 16-bit inner product on a CPU without AVX-512 or AVX-NE-CONVERT)."""
    try:
        time_fn(name, KERNELS[name], items, x, residual)
    except RuntimeError as e:  # torch's refusals (NotImplementedError included) for this dtype, shape or CPU
        logger.warning(f"cpu_linear.candidate_refused(candidate={name}, dtype={x.dtype}, error={str(e)[:120]!r})")
        return False
    return True


@torch.inference_mode()
def tune(
    slots: dict[SlotKey, list[tuple[torch.Tensor, torch.Tensor | None]]],
    config: CpuLinearConfig,
    *,
    time_fn: TimeFn = time_passes,
) -> tuple[CpuLinearChoices, dict]:
    """For each shape `slots[(N, K, has_bias, has_residual)] = [(weight [N, K], bias [N] | None) per layer]` and
    each row bucket, times every available candidate (one untimed pass first: library warm-up, first-touch;
    then `reps` passes, candidates alternated) on the first layers' weights (`bytes_timed`) and keeps the
    candidate of the fastest pass. Returns the table and a report {(slot, bucket): {"best", "all_ms"}} (ms per pass)."""
    started = time.perf_counter()
    names = [c for c in config.candidates if available(c)]
    for c in config.candidates:
        if c not in names:
            logger.warning(f"cpu_linear.candidate_unavailable(candidate={c})")
    if not names:
        raise RuntimeError(f"none of the CPU linear candidates {config.candidates} can run in this torch build")
    chosen: dict[tuple[SlotKey, int], str] = {}
    report: dict = {}
    for key, layers in slots.items():
        n, k, _, has_res = key
        items = _timed_layers(layers, config.bytes_timed)
        dtype = items[0][0].dtype
        for bucket in config.bucket_rows:
            x = torch.randn(bucket, k, dtype=dtype)  # [M, K]
            res = torch.randn(bucket, n, dtype=dtype) if has_res else None  # [M, N]
            runnable = [c for c in names if _runs(c, time_fn, items, x, res)]  # the untimed first pass
            if not runnable:
                continue  # nothing chosen: `linear` serves the bucket as before
            best_ms = {c: float("inf") for c in runnable}
            for _ in range(config.reps):
                for c in runnable:
                    best_ms[c] = min(best_ms[c], time_fn(c, KERNELS[c], items, x, res))
            best = pick(best_ms)
            chosen[(key, bucket)] = best
            report[(key, bucket)] = {"best": best, "all_ms": best_ms}
            timed = ", ".join(f"{c}={t:.2f}" for c, t in best_ms.items())
            logger.info(f"cpu_linear.choice(n={n}, k={k}, bias={key[2]}, residual={has_res}, rows<={bucket}, "
                        f"best={best}, layers={len(items)}, ms=[{timed}])")  # fmt: skip
    logger.info(f"cpu_linear.tuned(shapes={len(slots)}, buckets={len(config.bucket_rows)}, "
                f"seconds={time.perf_counter() - started:.2f})")  # fmt: skip
    return CpuLinearChoices(config.bucket_rows, chosen), report
