"""Longest files first on pytest-xdist workers, and a record of each file's duration for the next run.

`make test` runs the suite as `-n 2 --dist loadfile`: whole files go to a worker in the order of the workers'
collection (with `--no-loadscope-reorder`; xdist's default order is by number of tests, which put the few-test,
minutes-long swarm files last, where one worker ran them while the other sat idle). Ordering the files by their
expected duration, longest first, is the classic longest-processing-time schedule: the many short unit files fill
the gaps at the end.

Expected durations come from `tests/file_durations.json` (committed; seconds per file, summed over setup, call and
teardown of its tests), overlaid by the file named in `COROLLA_TEST_DURATIONS_OUT` when it exists (the Makefile
points it at `build/test-durations.json`, which each `make test` rewrites from what it measured). A file in neither
gets a default by kind (a swarm test or a unit test). The order changes only which worker runs a file and when,
never the order of the tests inside a file (module fixtures stay shared). To refresh the committed table, copy
`build/test-durations.json` over it after a full `make test` on the reference VM: files that skip there (the Docker
image test, tests/interop without the Petals venv) keep the committed entry, measured where they ran (Docker: the
README's figures, wheel + rebuild + `docker run`)."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]
COMMITTED_DURATIONS = TESTS_DIR / "file_durations.json"
DURATIONS_OUT_ENV = "COROLLA_TEST_DURATIONS_OUT"
# A file with no recorded duration: swarm tests start processes (tens of seconds), unit tests take a fraction of one.
DEFAULT_SWARM_FILE_S = 30.0
DEFAULT_UNIT_TEST_S = 0.3
SWARM_DIRS = ("tests/integration/", "tests/interop/")
MAX_DURATIONS_BYTES = 1 << 20  # the table is a few kB; anything bigger is not ours


class HasNodeId(Protocol):
    nodeid: str


ItemT = TypeVar("ItemT", bound=HasNodeId)


def file_of(nodeid: str) -> str:
    """`tests/x/test_y.py::test_z[a]` -> `tests/x/test_y.py`."""
    return nodeid.split("::", 1)[0]


def read_durations(path: Path) -> dict[str, float]:
    """`{file: seconds}` from a table written by `write_durations`; {} when the file is missing. A malformed table
    raises ValueError (it is ours: a silent fallback would hide that the order is no longer the measured one)."""
    try:
        if path.stat().st_size > MAX_DURATIONS_BYTES:
            raise ValueError(f"{path}: over {MAX_DURATIONS_BYTES} bytes, not a durations table")
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object of file -> seconds")
    durations = {}
    for name, seconds in data.items():
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds):
            raise ValueError(f"{path}: {name!r} has {seconds!r}, expected seconds")
        if seconds < 0:
            raise ValueError(f"{path}: {name!r} has negative seconds {seconds}")
        durations[str(name)] = float(seconds)
    return durations


def expected_durations() -> dict[str, float]:
    """The committed table, overlaid by this machine's last recorded run (when there is one)."""
    durations = read_durations(COMMITTED_DURATIONS)
    recorded = os.environ.get(DURATIONS_OUT_ENV)
    if recorded:
        durations.update(read_durations(Path(recorded)))
    return durations


def default_seconds(file: str, num_tests: int) -> float:
    if file.startswith(SWARM_DIRS):
        return DEFAULT_SWARM_FILE_S
    return DEFAULT_UNIT_TEST_S * num_tests


def longest_files_first(items: Sequence[ItemT], durations: Mapping[str, float]) -> list[ItemT]:
    """`items` grouped by file, files by expected duration (longest first, ties by name: every worker must compute
    the same order), each file's items in their collected order."""
    by_file: dict[str, list[ItemT]] = defaultdict(list)
    for item in items:
        by_file[file_of(item.nodeid)].append(item)

    def key(file: str) -> tuple[float, str]:
        seconds = durations.get(file)
        return (-(default_seconds(file, len(by_file[file])) if seconds is None else seconds), file)

    return [item for file in sorted(by_file, key=key) for item in by_file[file]]


class DurationRecorder:
    """A pytest plugin for the controller (or a run without xdist): sums each file's setup, call and teardown
    seconds from the test reports and, at the end, merges them into `path` (the files that ran replace their old
    entries; the others stay). A file none of whose tests ran (all skipped: no Docker daemon, no Petals venv, no GPU
    here) did not run: its old entry stays. Its ~0 s would otherwise schedule it last where it does run (CI), as
    one worker's long tail (tests/interop's ~150 s did exactly that once a refresh from a VM without the Petals venv
    zeroed it). Written via a temporary file and a rename, so a reader never sees half a table."""

    def __init__(self, path: Path, base: Mapping[str, float] | None = None):
        self.path = path
        self.base = dict(base or {})  # under the previous record (the committed table: see the module's doc)
        self.seconds: dict[str, float] = defaultdict(float)
        self.ran: set[str] = set()  # files with at least one test that passed or failed (xfail included)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        file = file_of(report.nodeid)
        self.seconds[file] += report.duration
        if report.when == "call" and (not report.skipped or hasattr(report, "wasxfail")):
            self.ran.add(file)

    def pytest_sessionfinish(self) -> None:
        ran = {file: round(seconds, 1) for file, seconds in self.seconds.items() if file in self.ran}
        if not ran:
            return
        merged = {**self.base, **read_durations(self.path), **ran}
        write_durations(self.path, merged)


def write_durations(path: Path, durations: Mapping[str, float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(sorted(durations.items())), indent=1) + "\n")
    tmp.replace(path)
