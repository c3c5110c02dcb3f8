"""Counts the launched forwards of `benchmarks.users.device_cpu`'s simulated device: the rows of each graph run."""

from __future__ import annotations

import pytest

from benchmarks.users import device_cpu


def count_graph_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patches `NoopGraphs.run` to record each launch's rows (in the returned list) before running it."""
    launched: list[int] = []
    run = device_cpu.NoopGraphs.run

    def counted(self, rows, *args, **kwargs):  # type: ignore[no-untyped-def]
        launched.append(rows)
        return run(self, rows, *args, **kwargs)

    monkeypatch.setattr(device_cpu.NoopGraphs, "run", counted)
    return launched
