"""Every test of this folder needs a CUDA device: each is marked `gpu` and skipped where none is present."""

from __future__ import annotations

import pytest
import torch

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.gpu)
    item.add_marker(NEEDS_CUDA)
