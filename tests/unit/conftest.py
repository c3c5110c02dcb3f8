"""Fixtures unit test modules ask for by name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers.tiny_models import torch_threads


@pytest.fixture(scope="module")
def single_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for a module's tests (tiny tensors: fastest, above all on a loaded machine), the
    count restored after the module: `pytestmark = pytest.mark.usefixtures("single_torch_thread")`."""
    with torch_threads(1):
        yield
