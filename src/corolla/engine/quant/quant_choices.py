"""Which quantized kernel serves each row range of each weight shape: the kernels by name (`quant_kernel`) and the
start-up tuner that times them per shape and keeps the fastest per row range and prologue (`tune_quantized`, into
DecodeOps' quant_small / quant_mid / quant_gemm / quant_fused). Importing fails without Triton."""

from __future__ import annotations

import zlib

import torch

from corolla.engine.kernels.graph_timing import graph_median_ms, time_configs
from corolla.engine.quant import quant_gemv, quant_int8_gemv, quant_kernels, quant_mma, quant_tile_gemv
from corolla.engine.quant.prologues import PROLOGUES

Choice = tuple[str, tuple[int, int, int, int, int]]
MID_MAX_ROWS = quant_mma.MMA_MID_MAX_ROWS  # NF4: 2 to this many rows on the 16-row-tile configs (quant_mid)
# the matrix-unit kernel's two decodes: "mma" levels with the product scaled per block, "mmaf" the folded table
MMA_KERNELS = ("mma", "mmaf")


def mma_candidates() -> list[Choice]:
    """The matrix-unit (kernel, config) candidates the tuner times for NF4 in 16-bit dtypes: both decodes on the
    16-row tiles, the folded one on the 64-row tiles (the per-block product lost on every Llama-3-8B projection
    there: docs/decisions/0097-nf4-mma-folded-table.md)."""
    return [
        (name, c)
        for c in quant_mma.NF4_MMA_CONFIGS
        for name in MMA_KERNELS
        if name == "mmaf" or c[1] <= quant_mma.MMA_MID_MAX_ROWS
    ]


def quant_kernel(
    kernel: str,
    config: tuple[int, int, int, int, int],
    prologue: int = 0,
    *,
    gated: bool = False,
    released: bool = False,
):
    """(x, weight, residual, norm_weight, eps) -> out of the quantized kernel `kernel` with `config` and `prologue`
    (prologues.PROLOGUES; see fusable): "gemv" (quant_gemv, fp32 NF4, up to GEMV_MAX_ROWS rows), "tile"
    (quant_tile_gemv.nf4_tile_gemv, NF4 in 16-bit dtypes, each row on its own, RMSNorm), "i8mma"
    (quant_int8_gemv.int8_row_mma, INT8 in 16-bit dtypes), "block" (quant_kernels.quant_matmul) or "mma" / "mmaf"
    (quant_mma.nf4_mma_matmul, NF4, no prologue; "mmaf" folded). `gated` ("i8mma", "tile"): silu(gate) * up of
    W = [gate | up]; `released` ("tile"): the kernel ahead lets it start at that kernel's start
    (`nf4_tile_gemv(released=True)`)."""
    if gated:
        if kernel == "i8mma":
            return lambda x, w, res, nw=None, eps=0.0: quant_int8_gemv.int8_row_mma(
                x, w, res, config, prologue, nw, eps, gated=True
            )
        if kernel == "tile" and prologue in quant_tile_gemv.PROLOGUE_CODES:
            return lambda x, w, res, nw=None, eps=0.0: quant_tile_gemv.nf4_tile_gemv(
                x, w, res, config, prologue=prologue, norm_weight=nw, eps=eps, gated=True
            )
        raise ValueError(f"only the INT8 row GEMV and the NF4 tile GEMV gate their output, not {kernel!r}")
    if kernel == "gemv" and not prologue:
        return lambda x, w, res, nw=None, eps=0.0: quant_gemv.quant_gemv(x, w, res, config)
    if kernel == "tile" and prologue in quant_tile_gemv.PROLOGUE_CODES:
        return lambda x, w, res, nw=None, eps=0.0: quant_tile_gemv.nf4_tile_gemv(
            x, w, res, config, prologue=prologue, norm_weight=nw, eps=eps, released=released
        )
    if kernel == "i8mma":
        return lambda x, w, res, nw=None, eps=0.0: quant_int8_gemv.int8_row_mma(x, w, res, config, prologue, nw, eps)
    if kernel in MMA_KERNELS and not prologue:
        fold = kernel == "mmaf"
        return lambda x, w, res, nw=None, eps=0.0: quant_mma.nf4_mma_matmul(x, w, res, config, fold)
    if kernel == "block":
        return lambda x, w, res, nw=None, eps=0.0: quant_kernels.quant_matmul(x, w, res, config, prologue, nw, eps)
    raise ValueError(f"unknown quantized kernel {kernel!r} (prologue {prologue})")


def fusable(key: tuple[str, int, int], choice: Choice, prologue: str) -> bool:
    """Whether the small-row kernel `choice` for shape `key` runs the `prologue` (INT8: the block kernel and the
    matrix-unit row GEMV RMSNorm; NF4: the tile GEMV RMSNorm; SiLU gating: none, it runs as its own kernel)."""
    int8, code = key[0] == "int8", PROLOGUES.get(prologue)
    if code is None:
        return False
    if choice[0] == "i8mma":
        return int8 and code in quant_int8_gemv.PROLOGUE_CODES
    if choice[0] == "tile":
        return not int8 and code in quant_tile_gemv.PROLOGUE_CODES
    return int8 and choice[0] == "block"


def tune_prologue(ops, key, items: list, prologue: str, best: Choice, timings: dict, reps: int) -> dict:
    """Times the `prologue` kernel (RMSNorm, DecodeOps `ops`) + `best` against the three fastest small-row kernels
    of `timings` that run the prologue themselves, each as a CUDA graph over all layers; the faster serves decode
    rows with that prologue (ops.quant_fused). The pair is timed as DecodeOps runs it: before the NF4 tile GEMV
    (bf16) the norm kernel writes x prescaled for it. {} where no candidate fuses (SiLU gating: none does)."""
    candidates = sorted((c for c in timings if fusable(key, c, prologue)), key=timings.__getitem__)[:3]
    if not candidates:
        return {}
    k, code = key[2], PROLOGUES[prologue]
    x = torch.randn(1, k, device=items[0].device, dtype=items[0].dtype)
    nw = torch.ones(k, device=x.device, dtype=x.dtype)  # the gain's values do not change the time
    if best[0] == "tile" and x.dtype == torch.bfloat16:

        def pair(w):
            normed = ops.rms_norm(x, nw, 1e-6, quant_tile_gemv.X_SCALE)
            return quant_tile_gemv.nf4_tile_gemv(normed, w, None, best[1], prescaled=True)
    else:

        def pair(w):
            return quant_kernel(*best)(ops.rms_norm(x, nw, 1e-6), w, None)

    unfused = graph_median_ms(lambda: [pair(w) for w in items], reps)
    fused = time_configs(candidates, lambda c, w: quant_kernel(c[0], c[1], code)(x, w, None, nw, 1e-6), items, reps)
    choice = min(fused, key=fused.__getitem__) if fused else None
    ops.quant_fused.pop((*key, prologue), None)
    if choice is not None and fused[choice] < unfused:
        ops.quant_fused[(*key, prologue)] = choice
    per_call = 1000 / len(items)
    return {"unfused_us": unfused * per_call, "fused": ops.quant_fused.get((*key, prologue)),
            "all_us": {str(c): t * per_call for c, t in fused.items()}}  # fmt: skip


def gating_candidates(key: tuple[str, int, int], dtype: torch.dtype) -> list[Choice]:
    """The kernels that gate a [gate | up] shape's output themselves: INT8's row GEMV (GATED_CONFIGS; N even, K a
    multiple of its CHUNK_VALUES) and NF4's tile GEMV (its configs; N a multiple of 32), in 16-bit dtypes."""
    if dtype == torch.float32:
        return []
    if key[0] == "int8" and not key[1] % 2 and not key[2] % quant_int8_gemv.CHUNK_VALUES:
        return [("i8mma", c) for c in quant_int8_gemv.GATED_CONFIGS]
    if key[0] == "nf4" and not key[1] % (2 * quant_tile_gemv.TILE_ROWS):
        return [("tile", c) for c in quant_tile_gemv.NF4_TILE_CONFIGS]
    return []


def tune_gated(ops, key, items: list, reps: int) -> dict:
    """For a [gate | up] shape (w_gate_up, RMSNorm before it): its one-row path as the step runs it ungated (the
    RMSNorm choice `tune_prologue` kept, or the norm kernel + quant_small's choice; then silu_mul) against the row
    GEMVs gating their own output (`gating_candidates`, the norm in their x staging), each as a CUDA graph over all
    layers; the faster: ops.quant_fused[(*key, "gated")] (DecodeOps.gate_up), absent for the pair. {} for a shape no
    gating kernel takes."""
    candidates = gating_candidates(key, items[0].dtype)
    if not candidates:
        return {}
    rms = PROLOGUES["rmsnorm"]
    x = torch.randn(1, key[2], device=items[0].device, dtype=items[0].dtype)
    nw = torch.ones(key[2], device=x.device, dtype=x.dtype)  # the gain's values do not change the time
    fused: Choice | None = ops.quant_fused.get((*key, "rmsnorm"))
    if fused is not None:  # the RMSNorm in the GEMV's x staging
        norm_gemv = quant_kernel(fused[0], fused[1], rms)
        unfused = graph_median_ms(lambda: [ops.silu_mul(norm_gemv(x, w, None, nw, 1e-6)) for w in items], reps)
    else:  # the norm kernel, then the GEMV
        gemv = quant_kernel(*ops.quant_small[key])
        unfused = graph_median_ms(lambda: [ops.silu_mul(gemv(ops.rms_norm(x, nw, 1e-6), w, None)) for w in items], reps)
    gated = time_configs(
        candidates, lambda c, w: quant_kernel(c[0], c[1], rms, gated=True)(x, w, None, nw, 1e-6), items, reps
    )
    choice = min(gated, key=gated.__getitem__) if gated else None
    ops.quant_fused.pop((*key, "gated"), None)
    if choice is not None and gated[choice] < unfused:
        ops.quant_fused[(*key, "gated")] = choice
    per_call = 1000 / len(items)
    return {"unfused_us": unfused * per_call, "fused": ops.quant_fused.get((*key, "gated")),
            "all_us": {str(c): t * per_call for c, t in gated.items()}}  # fmt: skip


@torch.inference_mode()
def tune_quantized(ops, weights: dict[tuple[str, int, int], list], *, reps: int = 7, prologues: dict | None = None):
    """For each quantized shape (kind, N, K) -> [weight per layer], times on a single-row input every tile-GEMV
    config (NF4 in 16-bit dtypes) or every "block" tl.dot config (INT8, fp32 NF4; fp32 NF4 also the table GEMV's,
    "gemv"; INT8 in 16-bit dtypes also the row GEMV's, "i8mma"): the fastest
    serves steps of up to GEMV_MAX_ROWS rows (NF4 in 16-bit dtypes: one row; ops.quant_small); NF4 in 16-bit dtypes: the matrix-unit kernel's 16-row-tile
    configs on MID_MAX_ROWS rows (2 to MID_MAX_ROWS rows, ops.quant_mid; INT8 where the row GEMV won one row: the
    "block" configs on MID_MAX_ROWS rows, as the row GEMV reads the weight once per row); on a `QUANT_KERNEL_MAX_ROWS`-row input
    the "block" configs (INT8, fp32 NF4) or the matrix-unit kernel's 64-row-tile configs (larger merged steps,
    ops.quant_gemm); each as a CUDA graph over all layers' weights. Then, per prologue (`prologues`: shape -> the
    names its projections take, none for a shape missing there; None: "rmsnorm"), the norm
    kernel + the one-row best against the fused kernels (`tune_prologue`); "gated" (w_gate_up's shape): after
    "rmsnorm", that path + silu_mul against the row GEMVs gating their own output (`tune_gated`). One (kernel, config) per row range and
    prologue keeps rows batch-invariant within it. A shape whose choices `ops.kernel_choices` holds (same card and
    versions) takes them without timing anything. Returns {shape: {"best", "best_us", "all_us", "mid_best",
    "mid_all_us", "gemm_best", "gemm_best_us", "gemm_all_us", "prologues"}}, microseconds per layer call."""
    report = {}
    for key, items in weights.items():
        wanted = ("rmsnorm",) if prologues is None else tuple(prologues.get(key, ()))
        # NF4 in 16-bit dtypes: the matrix-unit kernel replaces the tl.dot kernels, which were slower on every
        # Llama-3-8B projection (docs/decisions/0012-nf4-matrix-units.md)
        nf4 = key[0] == "nf4" and items[0].dtype != torch.float32
        block_configs = [] if nf4 else [("block", c) for c in quant_kernels.QUANT_CONFIGS]
        # NF4 in 16-bit dtypes: one row on the tile GEMV, which beat the streaming GEMV on every Llama-3-8B
        # projection of an H200 (docs/decisions/0031, 0060); fp32 NF4 weights on the fp32 table GEMV
        if nf4:
            small_configs = [("tile", c) for c in quant_tile_gemv.NF4_TILE_CONFIGS]
        else:
            gemv_configs = quant_gemv.NF4_GEMV_CONFIGS if key[0] == "nf4" else ()
            small_configs = [("gemv", c) for c in gemv_configs] + block_configs
            if key[0] == "int8" and items[0].dtype != torch.float32 and key[2] % quant_int8_gemv.CHUNK_VALUES == 0:
                small_configs += [("i8mma", c) for c in quant_int8_gemv.INT8_MMA_CONFIGS]
        mma = mma_candidates() if nf4 else []
        gemm_configs = block_configs + [c for c in mma if c[1][1] > MID_MAX_ROWS]
        # the candidates are part of the problem (those that fuse a prologue too): a changed list tunes again
        fusing = [[c for c in small_configs if fusable(key, c, p)] for p in wanted if p != "gated"]
        gating = gating_candidates(key, items[0].dtype) if "gated" in wanted else []
        candidates = zlib.crc32(repr((small_configs, mma, block_configs, fusing, gating)).encode())
        problem = f"quant {key[0]} {key[1]}x{key[2]} {items[0].dtype} prologues={','.join(wanted)} {candidates:08x}"
        cached = ops.kernel_choices.get(problem) if ops.kernel_choices is not None else None
        if cached is not None:
            report[key] = _restore(ops, key, cached)
            continue
        k = key[2]
        one = torch.randn(1, k, device=items[0].device, dtype=items[0].dtype)
        many = torch.randn(quant_kernels.QUANT_KERNEL_MAX_ROWS, k, device=one.device, dtype=one.dtype)
        gemv = time_configs(small_configs, lambda c, w, x=one: quant_kernel(*c)(x, w, None), items, reps)
        gemm = time_configs(gemm_configs, lambda c, w, x=many: quant_kernel(*c)(x, w, None), items, reps)
        if not gemv or not gemm:
            raise RuntimeError(f"no dequantize-GEMV or -GEMM config runs for {key}")
        best, gemm_best = min(gemv, key=gemv.__getitem__), min(gemm, key=gemm.__getitem__)
        ops.quant_small[key] = best
        ops.quant_gemm[key] = gemm_best
        ops.quant_mid.pop(key, None)  # (a tuning before may have left one)
        # 2 to MID_MAX_ROWS rows, timed at that many rows: NF4's 16-row-tile matrix-unit configs; INT8's block
        # configs where the row GEMV serves one row (it reads the weight once per x row)
        if mma:
            mid_configs = [c for c in mma if c[1][1] <= MID_MAX_ROWS]
        else:
            mid_configs = block_configs if best[0] == "i8mma" else []
        mid = {}
        if mid_configs:
            rows16 = many[:MID_MAX_ROWS]
            mid = time_configs(mid_configs, lambda c, w, x=rows16: quant_kernel(*c)(x, w, None), items, reps)
            if mid:
                ops.quant_mid[key] = min(mid, key=mid.__getitem__)
        per_call = 1000 / len(items)
        report[key] = {
            "best": best,
            "best_us": gemv[best] * per_call,
            "all_us": {str(c): t * per_call for c, t in gemv.items()},
            "mid_best": ops.quant_mid.get(key),
            "mid_all_us": {str(c): t * per_call for c, t in mid.items()},
            "gemm_best": gemm_best,
            "gemm_best_us": gemm[gemm_best] * per_call,
            "gemm_all_us": {str(c): t * per_call for c, t in gemm.items()},
            # "gated" last: it starts from the RMSNorm choice
            "prologues": {
                p: tune_gated(ops, key, items, reps)
                if p == "gated"
                else tune_prologue(ops, key, items, p, best, gemv, reps)
                for p in sorted(wanted, key=lambda p: p == "gated")
            },
        }
        if ops.kernel_choices is not None:
            ops.kernel_choices.put(problem, {
                "best": best, "best_us": report[key]["best_us"], "mid_best": ops.quant_mid.get(key),
                "gemm_best": gemm_best, "gemm_best_us": report[key]["gemm_best_us"],
                "fused": {p: ops.quant_fused.get((*key, p)) for p in wanted},
            })  # fmt: skip
    return report


def _restore(ops, key: tuple[str, int, int], cached: dict) -> dict:
    """Puts a stored tuning of shape `key` into `ops`; its report entry (the times measured when it was tuned)."""
    ops.quant_small[key], ops.quant_gemm[key] = cached["best"], cached["gemm_best"]
    if cached["mid_best"] is not None:
        ops.quant_mid[key] = cached["mid_best"]
    for prologue, choice in cached["fused"].items():
        ops.quant_fused.pop((*key, prologue), None)
        if choice is not None:
            ops.quant_fused[(*key, prologue)] = choice
    return {**cached, "cached": True}
