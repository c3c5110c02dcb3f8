"""The environment of a bench's child processes: the repository root on `PYTHONPATH`, so that a child started as
`python -m benchmarks...` imports this checkout's benchmarks whatever its working directory."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` plus `PYTHONPATH` with the repository root first (the caller's `PYTHONPATH` after it)."""
    paths = [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**(env or {}), "PYTHONPATH": os.pathsep.join(paths)}
