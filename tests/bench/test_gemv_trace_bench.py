"""The per-program GEMV trace's CPU half (the GPU run is `python -m benchmarks.engine.gemv_trace`): its trace points
still land in today's quant_tile_gemv.py (every anchor once), the instrumented copy imports and its step's builds
compile with NVRTC for sm_90a without spilling, an anchor the kernel lost is named, and the phase table reads a
synthetic trace as the kernels ran it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from benchmarks.engine import gemv_trace
from corolla.engine.kernels import nvrtc_kernels
from corolla.engine.quant import quant_tile_gemv


def test_the_copy_imports_and_its_step_builds_compile(tmp_path: Path) -> None:
    traced = gemv_trace.load_instrumented(tmp_path)
    assert traced.TRACE == {"buf": None, "next": 0, "launches": []}
    assert traced.NF4_TILE_CONFIGS == quant_tile_gemv.NF4_TILE_CONFIGS
    rms = quant_tile_gemv.RMSNORM
    # the step's four: w_qkv (RMSNorm), w_o (residual), w_gate_up (RMSNorm, gated), w_down (residual, X_BATCH)
    for res, prologue, gated, x_batch in ((False, rms, False, 1), (True, 0, False, 1), (False, rms, True, 1),
                                          (True, 0, False, quant_tile_gemv.X_BATCH)):  # fmt: skip
        kernel = traced.tile_kernel(quant_tile_gemv.NF4_TILE_CONFIGS[0], True, True, res, prologue, gated,
                                    x_batch=x_batch)  # fmt: skip
        assert kernel.source.count("TSTAMP(") == 7  # the macro and its six points
        options = ["--gpu-architecture=sm_90a", "--std=c++17", "--ptxas-options=-v"]
        options += [f"-D{k}={v}" for k, v in kernel.defines.items()]
        _, log = nvrtc_kernels.compile_cubin(kernel.source, kernel.name, options)
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
        assert spills and not any(spills), log[-600:]


def test_a_lost_anchor_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemv_trace, "PATCHES", (("no such line in the kernel", ""),))
    with pytest.raises(RuntimeError, match="no such line"):
        gemv_trace.instrumented_source()


def test_phase_table_reads_each_gemv_against_the_kernel_ahead() -> None:
    # 3 layers x 4 GEMVs of 2 programs; each launch starts 10 us after the previous one's start, its kernel ahead
    # ends at start - 1 us; program p enters 2 p us late, waits until 1 us, stages 0.5, loops 3 + p, stores 0.25
    launches = []
    for i in range(3 * len(gemv_trace.GEMVS)):
        base = 10_000 * i
        rows = []
        for p in range(2):
            enter = base + 2_000 * p
            wait = base + 1_000 + 2_000 * p
            staged = wait + 500
            loop = staged + 3_000 + 1_000 * p
            rows.append([enter, enter + 700, wait, staged, loop, loop + 250, 0, 0])
        launches.append(torch.tensor(rows, dtype=torch.int64))
    # launch i's ahead: launch i - 1, whose last program stored at 10 (i - 1) + 2 + 1 + 0.5 + 4 + 0.25 = 10 i - 2.25 us
    table = gemv_trace.phase_table(launches, range(1, 3))
    for name in gemv_trace.GEMVS:
        row = table[name]
        assert row["enter_first"] == pytest.approx(2.25) and row["enter_last"] == pytest.approx(4.25)
        assert row["wait_return_first"] == pytest.approx(3.25) and row["wait_return_last"] == pytest.approx(5.25)
        assert row["end"] == pytest.approx(10.0)  # its own last program: 7.75 us after its start
        assert row["prologue"] == pytest.approx(0.7) and row["x_staged"] == pytest.approx(0.5)
        assert row["loop"] == pytest.approx(3.0) and row["stores"] == pytest.approx(0.25)
