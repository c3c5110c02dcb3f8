"""Throughput: measured on a random block of the real config, cached per model/device/dtype in a JSON file,
reused on the next start, re-measured on `eval`; the announced figure follows the reference formula; private
swarms never run speedtest."""

from __future__ import annotations

import json

import pytest
import torch

from corolla.server import throughput as tp
from helpers.tiny_models import tiny_config


@pytest.fixture
def config():
    return tiny_config("llama", num_layers=2)


def test_measure_cache_and_reuse(config, tmp_path, monkeypatch):
    monkeypatch.setattr(tp, "_speedtest_bits_per_s", lambda *_: pytest.fail("private swarm must not run speedtest"))
    kwargs = dict(num_blocks=3, cache_dir=tmp_path, forward_tokens=8)
    info = tp.get_server_throughput("tiny", config, torch.device("cpu"), torch.float32, **kwargs)
    assert info["inference_rps"] > 0 and info["forward_rps"] > 0
    assert info["network_rps"] == pytest.approx(100e6 / (config.hidden_size * 16))
    assert info["throughput"] == pytest.approx(min(info["forward_rps"] / 2, info["network_rps"]))
    stored = json.loads((tmp_path / tp.CACHE_FILE_NAME).read_text())
    key = tp.cache_key("tiny", torch.device("cpu"), torch.float32, "none")
    assert key == "model_tiny_device_CPU_dtype_float32" and set(stored) == {key}

    calls = []
    monkeypatch.setattr(tp, "measure_throughput_info", lambda *a, **k: calls.append(1) or dict(stored[key]))
    again = tp.get_server_throughput("tiny", config, torch.device("cpu"), torch.float32, **kwargs)
    assert calls == [] and again == info  # second start reuses the cached figures
    relayed = tp.get_server_throughput("tiny", config, torch.device("cpu"), torch.float32, using_relay=True, **kwargs)
    assert relayed["throughput"] == pytest.approx(min(info["forward_rps"] / 2, info["network_rps"] * 0.2))
    tp.get_server_throughput("tiny", config, torch.device("cpu"), torch.float32, force_eval=True, **kwargs)
    assert calls == [1]  # eval / dry_run re-measure
    other = tp.get_server_throughput("other", config, torch.device("cpu"), torch.float32, **kwargs)
    assert calls == [1, 1] and other["forward_rps"] == info["forward_rps"]
    assert set(json.loads((tmp_path / tp.CACHE_FILE_NAME).read_text())) == {key, "model_other_device_CPU_dtype_float32"}


def test_unreadable_cache_is_measured_again(config, tmp_path, monkeypatch):
    (tmp_path / tp.CACHE_FILE_NAME).write_text("{not json")
    figures = {"inference_rps": 5.0, "forward_rps": 40.0, "network_rps": 1e9}
    monkeypatch.setattr(tp, "measure_throughput_info", lambda *a, **k: dict(figures))
    info = tp.get_server_throughput("m", config, torch.device("cpu"), torch.float32, num_blocks=1, cache_dir=tmp_path)
    assert info["throughput"] == 40.0  # forward_rps / ((1 + 1) / 2)
    assert json.loads((tmp_path / tp.CACHE_FILE_NAME).read_text())["model_m_device_CPU_dtype_float32"] == figures


def test_quantized_key_and_derivation():
    key = tp.cache_key("m", torch.device("cpu"), torch.bfloat16, "nf4")
    assert key == "model_m_device_CPU_dtype_bfloat16, quantized to nf4"
    info = {"forward_rps": 1000.0, "network_rps": 300.0}
    assert tp.derive_throughput(info, num_blocks=7, using_relay=False) == 250.0
    assert tp.derive_throughput(info, num_blocks=7, using_relay=True) == pytest.approx(60.0)


def test_public_swarm_without_speedtest_uses_default(config, monkeypatch):
    monkeypatch.setattr(tp, "_speedtest_bits_per_s", lambda *_: None)  # not installed / failed
    assert tp.measure_network_rps(config, public_swarm=True) == pytest.approx(100e6 / (config.hidden_size * 16))
