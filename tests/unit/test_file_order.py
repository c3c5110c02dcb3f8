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
