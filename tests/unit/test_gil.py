"""The GIL switch interval: a GPU fast-path server lowers it to 0.5 ms and never raises it; nothing else sets it (the
environment variable and the flag lost their A/B, docs/decisions/0007, and are gone)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from corolla.cli.run_server import parse_config
from corolla.server.core.engine_executor import GIL_SWITCH_INTERVAL_S, shorten_gil_switch_interval


@pytest.fixture(autouse=True)
def restore_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_fast_path_lowers_but_never_raises() -> None:
    sys.setswitchinterval(0.005)
    shorten_gil_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)
    sys.setswitchinterval(0.0001)
    shorten_gil_switch_interval()  # would raise it
    assert sys.getswitchinterval() == pytest.approx(0.0001)


def test_no_environment_variable_or_flag_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COROLLA_GIL_SWITCH_INTERVAL_MS", "2.5")
    sys.setswitchinterval(0.005)
    shorten_gil_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)
    with pytest.raises(SystemExit):
        parse_config(["some/model", "--new_swarm", "--gil_switch_interval_ms", "0.25"])
