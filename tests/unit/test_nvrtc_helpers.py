"""The quantized row GEMVs' CUDA sources take their shared helpers from nvrtc_kernels.CUDA_HELPERS instead of
defining their own copies (no GPU: the sources are read as text)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import corolla.engine.kernels.nvrtc_kernels as nvrtc_kernels
import corolla.engine.quant as quant

HELPERS = ("ld_stream", "ld_nc", "bf16x2_to_f16x2", "load_out_type", "to_out_type")


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
