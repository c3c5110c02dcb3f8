"""The suite's own scheduling aid (tests/helpers/file_order.py): files longest first with their tests in collected
order, the durations table read strictly, and the controller's record merged into the previous one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.file_order import (
    COMMITTED_DURATIONS,
    DEFAULT_SWARM_FILE_S,
    DurationRecorder,
    longest_files_first,
    read_durations,
)


@dataclass
class Node:
    nodeid: str
    duration: float = 0.0
    when: str = "call"
    skipped: bool = False


def test_files_go_longest_first_and_keep_their_tests_in_order() -> None:
    items = [
        Node("tests/unit/test_a.py::test_1"),
        Node("tests/unit/test_a.py::test_2"),
        Node("tests/integration/test_swarm.py::test_x[p2p]"),
        Node("tests/unit/test_b.py::test_1"),
        Node("tests/integration/test_swarm.py::test_x[socket]"),
        Node("tests/integration/test_new.py::test_unrecorded"),
        Node("tests/unit/test_b.py::Case::test_0"),
    ]
    durations = {"tests/unit/test_a.py": 3.0, "tests/unit/test_b.py": 3.0, "tests/integration/test_swarm.py": 90.0}
    ordered = [item.nodeid for item in longest_files_first(items, durations)]
    assert ordered == [
        "tests/integration/test_swarm.py::test_x[p2p]",
        "tests/integration/test_swarm.py::test_x[socket]",
        "tests/integration/test_new.py::test_unrecorded",  # an unrecorded swarm file: DEFAULT_SWARM_FILE_S
        "tests/unit/test_a.py::test_1",  # equal durations: by name, the same order on every worker
        "tests/unit/test_a.py::test_2",
        "tests/unit/test_b.py::test_1",
        "tests/unit/test_b.py::Case::test_0",
    ]
    assert 3.0 < DEFAULT_SWARM_FILE_S < 90.0
    # an unrecorded unit file is short: behind every recorded one here
    ordered = longest_files_first([Node("tests/unit/test_c.py::t"), *items], durations)
    assert ordered[-1].nodeid == "tests/unit/test_c.py::t"


def test_durations_table_is_read_strictly(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    assert read_durations(path) == {}  # no record yet
    path.write_text('{"tests/unit/test_a.py": 1.5, "tests/unit/test_b.py": 2}')
    assert read_durations(path) == {"tests/unit/test_a.py": 1.5, "tests/unit/test_b.py": 2.0}
    for bad in ('["a"]', '{"a": "1"}', '{"a": -1}', '{"a": true}', '{"a": NaN}', "{"):
        path.write_text(bad)
        with pytest.raises(ValueError):
            read_durations(path)


def test_committed_table_names_files_that_exist() -> None:
    durations = read_durations(COMMITTED_DURATIONS)
    assert len(durations) > 50
    root = COMMITTED_DURATIONS.parents[1]
    missing = [name for name in durations if not (root / name).is_file()]
    assert len(missing) <= len(durations) // 10, f"stale entries in {COMMITTED_DURATIONS.name}: {missing}"


def test_recorder_sums_phases_per_file_and_merges(tmp_path: Path) -> None:
    path = tmp_path / "build" / "durations.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"tests/unit/test_old.py": 4.0, "tests/unit/test_a.py": 100.0}))
    recorder = DurationRecorder(path)
    for nodeid, seconds in [("tests/unit/test_a.py::t1", 1.25), ("tests/unit/test_a.py::t2", 2.0),
                            ("tests/unit/test_b.py::t", 0.5), ("tests/unit/test_a.py::t1", 0.25)]:  # fmt: skip
        recorder.pytest_runtest_logreport(Node(nodeid, seconds))  # type: ignore[arg-type]
    recorder.pytest_sessionfinish()
    assert read_durations(path) == {
        "tests/unit/test_old.py": 4.0,
        "tests/unit/test_a.py": 3.5,
        "tests/unit/test_b.py": 0.5,
    }
    assert [p.name for p in path.parent.iterdir()] == ["durations.json"]  # no temporary file left


def test_recorder_keeps_the_entry_of_a_file_whose_tests_all_skipped(tmp_path: Path) -> None:
    """A file skipped here (no Docker daemon, no Petals venv) keeps the seconds it took where it ran: recorded as ~0 s
    it would be scheduled last there, one worker's long tail."""
    path = tmp_path / "durations.json"
    path.write_text(json.dumps({"tests/interop/test_stock.py": 150.0, "tests/unit/test_a.py": 9.0}))
    committed = {"tests/integration/test_image.py": 90.0, "tests/interop/test_stock.py": 140.0}
    recorder = DurationRecorder(path, committed)
    reports = [
        Node("tests/interop/test_stock.py::t1", 0.01, "setup", skipped=True),  # a skip mark or a fixture's skip
        Node("tests/interop/test_stock.py::t1", 0.0, "teardown"),
        Node("tests/interop/test_stock.py::t2", 0.1, "call", skipped=True),  # pytest.skip() in the test body
        Node("tests/unit/test_a.py::t1", 0.5, "setup"),
        Node("tests/unit/test_a.py::t1", 1.0, "call"),
        Node("tests/unit/test_a.py::t2", 0.2, "call", skipped=True),  # one skip among tests that ran
        Node("tests/integration/test_image.py::t", 0.1, "call", skipped=True),  # no Docker daemon here
    ]
    for report in reports:
        recorder.pytest_runtest_logreport(report)  # type: ignore[arg-type]
    recorder.pytest_sessionfinish()
    # the record is complete (the committed table under the previous record under this run): it can replace the
    # committed table without losing the files that skipped here
    assert read_durations(path) == {
        "tests/integration/test_image.py": 90.0,
        "tests/interop/test_stock.py": 150.0,
        "tests/unit/test_a.py": 1.7,
    }

    only_skips = DurationRecorder(path)
    only_skips.pytest_runtest_logreport(Node("tests/unit/test_a.py::t2", 0.2, "call", skipped=True))  # type: ignore[arg-type]
    only_skips.pytest_sessionfinish()
    assert read_durations(path)["tests/unit/test_a.py"] == 1.7
