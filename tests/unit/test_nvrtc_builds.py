"""Every build of the NVRTC row GEMVs that the engine can launch (the NF4 tile GEMV's offered tilings in each form:
bf16 / fp16 / prescaled x, RMSNorm prologue, residual, gated, experts one-row and grouped, x staged one word or
X_BATCH words a thread; the INT8 row GEMV's offered tilings, gated, with and without the prologue) compiles with
NVRTC for Hopper (sm_90a) and Ampere (sm_80) without spilling to local memory. No GPU: NVRTC is a library (the
`nvidia-cuda-nvrtc-cu12` wheel of the dev install), so a kernel that stops compiling, or starts spilling, fails
here rather than on a card."""

from __future__ import annotations

import re

import pytest

from corolla.engine.kernels import nvrtc_kernels
from corolla.engine.quant import quant_int8_gemv, quant_tile_gemv

ARCHS = ("sm_90a", "sm_80")


def _builds() -> list[tuple[str, nvrtc_kernels.NvrtcKernel]]:
    t, i8 = quant_tile_gemv, quant_int8_gemv
    out = []
    for cfg in t.NF4_TILE_CONFIGS:
        for bf16 in (True, False):
            for prescaled in (False, True) if bf16 else (False,):
                for prologue in (0,) if prescaled else t.PROLOGUE_CODES:
                    for res, gated in ((False, False), (True, False), (False, True)):
                        for xb in (1, t.X_BATCH):
                            kernel = t.tile_kernel(cfg, bf16 and not prescaled, bf16, res, prologue, gated, x_batch=xb)
                            out.append((f"nf4-{cfg[:4]}", kernel))
            for gated in (False, True):
                for grouped in (False, True):
                    for xb in (1, t.X_BATCH):
                        out.append(
                            (
                                f"nf4-experts-{cfg[:4]}",
                                t.tile_kernel(cfg, bf16, bf16, False, 0, gated, True, grouped, xb),
                            )
                        )
    for cfg, gated in [(c, False) for c in i8.INT8_MMA_CONFIGS] + [(c, True) for c in i8.GATED_CONFIGS]:
        for bf16 in (True, False):
            for prologue in i8.PROLOGUE_CODES:
                out.append((f"int8-{cfg[:3]}{'-gated' if gated else ''}", i8.row_kernel(cfg, bf16, prologue, gated)))
    return out


BUILDS = _builds()


def test_nvrtc_is_installed() -> None:
    # the dev install's wheel (pyproject's dev extra): without it every build below would fail the same way
    assert nvrtc_kernels.nvrtc_library()


def test_the_builds_are_distinct() -> None:
    keys = {(k.name, tuple(sorted(k.defines.items()))) for _, k in BUILDS}
    assert len(keys) == len(BUILDS) > 100


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("index", range(len(BUILDS)), ids=lambda i: f"{BUILDS[i][0]}-{i}")
def test_each_build_compiles_without_spills(arch: str, index: int) -> None:
    label, kernel = BUILDS[index]
    options = [f"--gpu-architecture={arch}", "--std=c++17", "--ptxas-options=-v"]
    options += [f"-D{k}={v}" for k, v in kernel.defines.items()]
    _, log = nvrtc_kernels.compile_cubin(kernel.source, kernel.name, options)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    assert spills and not any(spills), (label, kernel.defines, log[-600:])
