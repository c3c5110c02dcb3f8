"""The GIL switch interval setting: bounds, an explicit value winning over a component's default, the server's
environment variable (an experiment knob: no config field or flag)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from corolla.cli.run_server import parse_config
from corolla.server.core.engine_executor import GIL_SWITCH_INTERVAL_S, shorten_gil_switch_interval
from corolla.utils import gil


@pytest.fixture(autouse=True)
def restore_interval(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    before = sys.getswitchinterval()
    monkeypatch.setattr(gil, "_explicit_s", None)
    yield
    sys.setswitchinterval(before)


def test_component_default_lowers_but_never_raises() -> None:
    sys.setswitchinterval(0.005)
    assert gil.lower_switch_interval(0.0005, reason="test")
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert not gil.lower_switch_interval(0.002, reason="test")  # would raise it
    assert sys.getswitchinterval() == pytest.approx(0.0005)


def test_explicit_setting_wins_over_the_fast_path_default() -> None:
    sys.setswitchinterval(0.005)
    gil.configure_switch_interval(2.0)  # ms
    assert gil.explicit_switch_interval_s() == pytest.approx(0.002)
    shorten_gil_switch_interval()  # what a GPU fast-path executor calls once built
    assert sys.getswitchinterval() == pytest.approx(0.002)
    gil.configure_switch_interval(0.1)
    assert sys.getswitchinterval() == pytest.approx(0.0001)


def test_fast_path_default_without_an_explicit_setting() -> None:
    sys.setswitchinterval(0.005)
    shorten_gil_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)


@pytest.mark.parametrize("value_ms", [0.0, 0.001, -1.0, 101.0, float("nan")])
def test_out_of_bounds_values_are_refused(value_ms: float) -> None:
    before = sys.getswitchinterval()
    with pytest.raises(ValueError, match="gil_switch_interval_ms must be in"):
        gil.configure_switch_interval(value_ms)
    assert sys.getswitchinterval() == before
    assert gil.explicit_switch_interval_s() is None


def test_the_environment_variable_sets_it_and_the_flag_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gil.ENV_SWITCH_INTERVAL_MS, raising=False)
    assert gil.switch_interval_from_env() is None
    monkeypatch.setenv(gil.ENV_SWITCH_INTERVAL_MS, "0.25")
    assert gil.switch_interval_from_env() == 0.25
    for bad in ("500", "0", "nan", "fast"):
        monkeypatch.setenv(gil.ENV_SWITCH_INTERVAL_MS, bad)
        with pytest.raises(ValueError, match=gil.ENV_SWITCH_INTERVAL_MS if bad == "fast" else "must be in"):
            gil.switch_interval_from_env()
    with pytest.raises(SystemExit):
        parse_config(["some/model", "--new_swarm", "--gil_switch_interval_ms", "0.25"])
