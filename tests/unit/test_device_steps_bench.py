"""`bench.device_steps` runs end to end on the CPU (scripted handler processes, real channels, runtime and fast
executor): every scripted step is answered, the forwards merged steps of several channels, and the per-step CPU
figures are positive (a smoke test of the device-side measurement; no timing bound)."""

from __future__ import annotations

from corolla.bench.device_steps import DeviceStepsConfig, run


def test_device_steps_bench_answers_every_step_and_reports_cpu_per_step() -> None:
    cfg = DeviceStepsConfig(sessions=6, channels=2, rounds=4, prefix_tokens=4, hidden_size=32, num_layers=1, cache_mib=4,
                            timeout_s=60.0)  # fmt: skip
    result = run(cfg)
    assert result.steps == 24
    assert result.runtime_us_per_step > result.forward_us_per_step > 0
    assert result.channel_us_per_step > 0
    assert 1.0 <= result.steps_per_merged_forward <= 6.0
