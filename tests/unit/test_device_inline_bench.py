"""`bench.device_inline` runs the device side's per-step work in one thread on the CPU: every step is served (a
refused step would make the figure meaningless and raises), the forward is timed apart, both figures positive (a
smoke test of the measurement; no timing bound)."""

from __future__ import annotations

import pytest

from corolla.bench import device_inline
from corolla.bench.device_inline import DeviceInlineConfig, run


def test_device_inline_bench_serves_every_step_and_reports_cpu_per_step() -> None:
    cfg = DeviceInlineConfig(sessions=6, channels=2, rounds=3, repeats=2, prefix_tokens=4, hidden_size=32,
                             num_layers=1, cache_mib=4)  # fmt: skip
    result = run(cfg)
    assert result.steps == 18
    assert result.non_forward_us_per_step > 0 and result.forward_us_per_step > 0


def test_device_inline_bench_refuses_to_report_refused_steps(monkeypatch) -> None:
    frame = device_inline._frame

    def past_the_prefix(handles, token, position):  # positions past what was written: every step refused
        return frame(handles, token, position + 5)

    monkeypatch.setattr(device_inline, "_frame", past_the_prefix)
    cfg = DeviceInlineConfig(sessions=2, channels=1, rounds=2, repeats=1, prefix_tokens=4, hidden_size=32,
                             num_layers=1, cache_mib=4)  # fmt: skip
    with pytest.raises(RuntimeError, match="refused"):
        run(cfg)
