"""The quantized row GEMVs' CUDA sources take their shared helpers from nvrtc_kernels.CUDA_HELPERS instead of
defining their own copies (no GPU: the sources are read as text)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch

import corolla.engine.kernels.nvrtc_kernels as nvrtc_kernels
import corolla.engine.quant as quant
from corolla.engine.quant import quant_tile_gemv

HELPERS = ("ld_stream", "ld_stream_256", "ld_nc", "bf16x2_to_f16x2", "load_out_type", "to_out_type", "rounded",
           "silu_times", "unpack_pair", "pack_pair", "sum_squares", "norm_pair", "grid_release", "grid_wait",
           "x_operand", "stage_x", "copy_async4", "copy_async16_256", "copy_async_wait",
           "load_written_out_type", "load_written_i64")  # fmt: skip


def _definitions(text: str, name: str) -> int:
    return len(re.findall(rf"__forceinline__[^;{{]*\b{name}\(", text))


def test_helpers_are_defined_once_in_the_shared_snippet() -> None:
    for name in HELPERS:
        assert _definitions(nvrtc_kernels.CUDA_HELPERS, name) == 1, name


@pytest.mark.parametrize("module", ["quant_int8_gemv.py", "quant_tile_gemv.py"])
def test_row_gemvs_use_the_shared_snippet(module: str) -> None:
    text = (Path(quant.__file__).parent / module).read_text()
    assert "NvrtcKernel(CUDA_HELPERS + _SOURCE, " in text
    for name in HELPERS:
        assert _definitions(text, name) == 0, (module, name)


@pytest.mark.parametrize("module", ["quant_int8_gemv.py", "quant_tile_gemv.py"])
def test_row_gemvs_release_first_and_wait_before_reading_x(module: str) -> None:
    # every launch is programmatic (nvrtc_kernels): the kernel ahead may still run until grid_wait() returns
    text = (Path(quant.__file__).parent / module).read_text()
    release, wait = text.index("grid_release();"), text.index("grid_wait();")
    assert text.count("grid_wait();") == 1 and release < wait < text.index("stage_x<THREADS")
    assert wait < text.index("out[m * som")


@pytest.mark.parametrize(("module", "pointer", "load"), [("quant_int8_gemv.py", "res", "load_written_out_type"),
                                                         ("quant_tile_gemv.py", "routes", "load_written_i64")])  # fmt: skip
def test_what_the_kernels_ahead_wrote_is_read_by_a_volatile_load_after_the_wait(
    module: str, pointer: str, load: str
) -> None:
    # a plain load through a const __restrict__ pointer may be moved above griddepcontrol.wait (NVVM did it to the
    # INT8 residual; ptxas to the NF4 experts' routes[m] in every one-row EXPERTS build: SASS, NVRTC 12.9 sm_90a)
    text = (Path(quant.__file__).parent / module).read_text()
    text = text[text.index('_SOURCE = r"""') :]
    text = text[: text.index('"""\n', 16)]  # the CUDA source
    wait = text.index("grid_wait();")
    reads = [i for i in range(len(text)) if text.startswith(f"{load}({pointer} + ", i)]
    assert reads and all(i > wait for i in reads)
    assert f"{pointer}[" not in text and f"load_out_type({pointer} " not in text


def test_int8_row_gemv_copies_its_first_chunks_before_the_wait() -> None:
    # ptxas moved the ungated builds' first ld_stream_256 loads, written before grid_wait(), below
    # griddepcontrol.wait (SASS, NVRTC 12.9 sm_90a: ACQBULK before every weight LDG of (1, 8, 4), (1, 16, 2));
    # cp.async copies stay where they are written, and are read back only after copy_async_wait()
    text = (Path(quant.__file__).parent / "quant_int8_gemv.py").read_text()
    text = text[text.index('_SOURCE = r"""') :]
    text = text[: text.index('"""\n', 16)]  # the CUDA source
    wait = text.index("grid_wait();")
    copies = [m.start() for m in re.finditer(r"copy_async16_256\(RING_WORDS", text)]
    reads = [m.start() for m in re.finditer(r"= RING_WORDS\[", text)]
    assert len(copies) == 2 and all(i < wait for i in copies)
    drained = text.index("copy_async_wait();", wait)
    assert len(reads) == 2 and all(drained < i < text.index("__syncthreads();", drained) for i in reads)


def test_a_source_without_the_programmatic_calls_is_refused() -> None:
    body = 'extern "C" __global__ void k(float* p) { p[0] = 1.f; }'
    with pytest.raises(ValueError, match="grid_release"):
        nvrtc_kernels.NvrtcKernel(nvrtc_kernels.CUDA_HELPERS + body, "k", {})
    released = 'extern "C" __global__ void k(float* p) { grid_release(); p[0] = 1.f; }'
    with pytest.raises(ValueError, match="grid_wait"):
        nvrtc_kernels.NvrtcKernel(nvrtc_kernels.CUDA_HELPERS + released, "k", {})
    waited = 'extern "C" __global__ void k(float* p) { grid_release(); grid_wait(); p[0] = 1.f; }'
    assert nvrtc_kernels.NvrtcKernel(nvrtc_kernels.CUDA_HELPERS + waited, "k", {}).name == "k"


def test_launch_config_has_cuda_h_layout() -> None:
    # CUlaunchAttribute: 72 bytes, 8-aligned, value at 8; CUlaunchConfig: 56 bytes, hStream at 32, attrs at 40,
    # numAttrs at 48 (cuda.h, 64-bit); attribute 6 = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr_type, config_type = nvrtc_kernels._LaunchAttribute, nvrtc_kernels._LaunchConfig
    assert (ctypes.sizeof(attr_type), ctypes.alignment(attr_type), attr_type.value.offset) == (72, 8, 8)
    assert ctypes.sizeof(config_type) == 56
    assert (config_type.stream.offset, config_type.attrs.offset, config_type.num_attrs.offset) == (32, 40, 48)
    config, attr = nvrtc_kernels.launch_config((3, 2, 1), 256, 4096, 1234, True)
    assert (config.grid_x, config.grid_y, config.grid_z, config.block_x, config.block_y) == (3, 2, 1, 256, 1)
    assert (config.shared_bytes, config.stream, config.num_attrs) == (4096, 1234, 1)
    assert (config.attrs.contents.id, config.attrs.contents.value) == (6, 1)
    assert nvrtc_kernels.launch_config((1, 1, 1), 32, 0, 0, False)[0].num_attrs == 0


def _compile_tile(grouped: bool, prologue: int, experts: bool) -> bytes:
    """The NF4 tile GEMV compiled for an H200 (sm_90a) on the CPU (NVRTC: the dev install's wheel)."""
    kernel = quant_tile_gemv.tile_kernel(
        quant_tile_gemv.NF4_TILE_CONFIGS[0], True, True, False, prologue, True, experts, grouped
    )
    options = ["--gpu-architecture=sm_90a", "--std=c++17", *(f"-D{k}={v}" for k, v in kernel.defines.items())]
    return nvrtc_kernels.compile_cubin(kernel.source, kernel.name, options)[0]


def test_the_grouped_tile_gemv_refuses_the_prologue_at_compile_time() -> None:
    # GROUPED places the warps' sums right after the group's x: with the prologue's gain there too they would overlap
    assert _compile_tile(grouped=False, prologue=quant_tile_gemv.RMSNORM, experts=False)
    assert _compile_tile(grouped=True, prologue=0, experts=True)
    with pytest.raises(RuntimeError, match="the grouped experts form runs no RMSNorm prologue"):
        _compile_tile(grouped=True, prologue=quant_tile_gemv.RMSNORM, experts=True)


def test_kernels_on_the_cpu_never_launch_programmatically() -> None:
    # the Triton decode kernels ask this for every launch (the interpreter's CPU tensors included): no CUDA call
    assert nvrtc_kernels.programmatic_launches(torch.device("cpu")) is False
