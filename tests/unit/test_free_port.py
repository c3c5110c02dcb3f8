"""The suite's port picker (tests/helpers/ports.py): ports for servers that bind them later, so one it handed out must
not come back while it is still unbound."""

from __future__ import annotations

import random

import pytest

from helpers import ports


def test_a_port_is_handed_out_once_though_nothing_bound_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # the same candidate order on every ask (as two asks drawing the same first port would have): before, the port
    # checked free and closed again was returned to both; a chain's servers then raced for it at start-up
    monkeypatch.setattr(random, "sample", lambda population, k: list(population)[:k])
    chosen = [ports.free_port() for _ in range(3)]
    assert len(set(chosen)) == 3, chosen
    assert all(port < 32768 for port in chosen)  # below the kernel's ephemeral range
