"""Fixtures unit test modules ask for by name."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from helpers.tiny_models import torch_threads


@pytest.fixture(scope="module")
def single_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for a module's tests (tiny tensors: fastest, above all on a loaded machine), the
    count restored after the module: `pytestmark = pytest.mark.usefixtures("single_torch_thread")`."""
    with torch_threads(1):
        yield


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """The objects the worker held before the test left out of the garbage collector's passes during it
    (`gc.freeze`), given back after (`gc.unfreeze`): the test's own objects are collected as usual. For tests that
    time steps in real time against scaled-down budgets (a 0.2 s deadline, a 1 s late budget): a full collection of
    a worker's heap late in the suite (4M objects: 1.2-1.8 s on the loaded 2-core VM) paused the client's event loop
    past them (CI, stop 57's rerun: every racer moved, 18 moves for 2), where the product's own (1 s, 8 s) hold it.
    `pytestmark = pytest.mark.usefixtures("frozen_heap")`."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
