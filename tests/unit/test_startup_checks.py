"""Start-up checks: a device, quantization or dtype that cannot run here is one `ConfigurationError` line (exit code 2
from `corolla-server`, within seconds, no traceback, no restarts); the default quantization on CUDA follows whether
bitsandbytes works. CUDA is simulated where this machine has none."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from tests.helpers.tiny_models import make_tiny_model

from corolla.server import startup_checks
from corolla.utils.errors import ConfigurationError

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def fake_cuda(monkeypatch):
    """One CUDA device without bfloat16 (a T4-like card), whatever this machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(startup_checks, "_bf16_supported", lambda device: device.type != "cuda")


def _bitsandbytes(monkeypatch, problem: str | None) -> None:
    monkeypatch.setattr(startup_checks, "bitsandbytes_problem", lambda: problem)


@pytest.mark.skipif(HAS_CUDA, reason="checks the message of a machine without CUDA")
def test_cuda_requested_without_cuda():
    with pytest.raises(ConfigurationError, match=r"^--device cuda: CUDA is not available here"):
        startup_checks.check_device("cuda")
    with pytest.raises(ConfigurationError, match=r"--tensor_parallel_devices cuda:1: CUDA is not available"):
        startup_checks.resolve_device_and_quant("cpu", None, ["cuda:1"])


def test_device_names_and_indices(fake_cuda):
    assert startup_checks.check_device("cuda") == torch.device("cuda:0")
    assert startup_checks.check_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigurationError, match=r"--device cuda:3: this machine has 1 CUDA device\(s\) \(0..0\)"):
        startup_checks.check_device("cuda:3")
    with pytest.raises(ConfigurationError, match=r"--device gpu0: not a torch device"):
        startup_checks.check_device("gpu0")


def test_quantization_needs_cuda_and_bitsandbytes(fake_cuda, monkeypatch):
    with pytest.raises(ConfigurationError, match=r"--quant_type nf4 needs a CUDA device \(the device is cpu\)"):
        startup_checks.resolve_quant_type("nf4", torch.device("cpu"))
    _bitsandbytes(monkeypatch, "bitsandbytes is not installed")
    with pytest.raises(ConfigurationError, match=r"--quant_type int8 needs bitsandbytes: .* pip install bitsandbytes"):
        startup_checks.resolve_quant_type("int8", torch.device("cuda:0"))
    assert startup_checks.resolve_quant_type("none", torch.device("cuda:0")) == "none"
    _bitsandbytes(monkeypatch, None)
    assert startup_checks.resolve_quant_type("int8", torch.device("cuda:0")) == "int8"


def test_default_quantization_follows_what_is_installed(fake_cuda, monkeypatch, caplog):
    assert startup_checks.resolve_quant_type(None, torch.device("cpu")) == "none"
    _bitsandbytes(monkeypatch, None)
    assert startup_checks.resolve_quant_type(None, torch.device("cuda:0")) == "nf4"
    _bitsandbytes(monkeypatch, "bitsandbytes is not installed")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=startup_checks.logger.name):
        assert startup_checks.resolve_device_and_quant("cuda", None) == (torch.device("cuda:0"), "none")
    (record,) = [r for r in caplog.records if "quant_default" in r.getMessage() and r.levelno == logging.WARNING]
    assert "quant=none" in record.getMessage() and "pip install bitsandbytes" in record.getMessage()


def test_a_prequantized_checkpoint_is_served_in_its_own_kind_unless_told_otherwise():
    int8_save = SimpleNamespace(quantization_config={"quant_method": "bitsandbytes", "load_in_8bit": True})
    nf4_save = SimpleNamespace(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True,
                                                    "bnb_4bit_quant_type": "nf4"})  # fmt: skip
    plain = SimpleNamespace()
    # unset --quant_type on a GPU (resolved nf4): an LLM.int8 save stays int8, an NF4 save and a 16-bit one nf4
    assert startup_checks.checkpoint_quant_type(None, "nf4", int8_save) == "int8"
    assert startup_checks.checkpoint_quant_type(None, "nf4", nf4_save) == "nf4"
    assert startup_checks.checkpoint_quant_type(None, "nf4", plain) == "nf4"
    # an explicit choice, or no quantization here (CPU, no bitsandbytes), stands
    assert startup_checks.checkpoint_quant_type("nf4", "nf4", int8_save) == "nf4"
    assert startup_checks.checkpoint_quant_type(None, "none", int8_save) == "none"
    # a quantization corolla does not read ends the start before any block is loaded
    with pytest.raises(ConfigurationError, match="gptq"):
        startup_checks.checkpoint_quant_type(None, "nf4", SimpleNamespace(quantization_config={"quant_method": "gptq"}))


def test_bitsandbytes_problem_tells_missing_from_broken(monkeypatch, tmp_path):
    monkeypatch.setattr(startup_checks.importlib.util, "find_spec", lambda name: None)
    assert startup_checks.bitsandbytes_problem() == "bitsandbytes is not installed"
    monkeypatch.undo()
    broken = tmp_path / "bitsandbytes"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise OSError('libcudart.so.12: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    problem = startup_checks.bitsandbytes_problem()
    assert problem is not None and problem.startswith("bitsandbytes is installed but does not import (OSError")


def test_dtype_checks(fake_cuda):
    bf16_config = SimpleNamespace(dtype="bfloat16")
    with pytest.raises(ConfigurationError, match=r"--torch_dtype bfloat16: cuda:0 \(Tesla T4\) has no bfloat16"):
        startup_checks.resolve_dtype(bf16_config, "bfloat16", torch.device("cuda:0"))
    assert startup_checks.resolve_dtype(bf16_config, "auto", torch.device("cuda:0")) == torch.float16
    assert startup_checks.resolve_dtype(bf16_config, "auto", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ConfigurationError, match=r"--torch_dtype float16: .*not supported on CPU"):
        startup_checks.resolve_dtype(bf16_config, "float16", torch.device("cpu"))


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--device", "cuda"], "--device cuda: CUDA is not available here"),
        (["--device", "cpu", "--quant_type", "nf4"], "--quant_type nf4 needs a CUDA device"),
    ],
    ids=["cuda", "nf4-on-cpu"],
)
def test_server_cli_exits_2_with_one_line(tmp_path, flags, message):
    """Before: nf4 was chosen, the server joined the swarm and crashed while loading, restarted 5 times, exit 1."""
    model = make_tiny_model("llama", tmp_path)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "corolla.cli.run_server", str(model), "--new_swarm", "--num_blocks", "2", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COROLLA_CACHE": str(tmp_path / "cache")},
    )
    elapsed_s = time.monotonic() - started
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert lines == [lines[0]] and message in lines[0] and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert elapsed_s < 60, elapsed_s  # seconds (imports only) on an idle machine; generous for a loaded CI
