"""The start-up tuner's kernel choices kept on disk between starts (issue 35: a server re-timed every candidate
kernel of every shape at each start). One JSON file per directory; an entry's key names the card, the versions of
torch, Triton and corolla and the tuned problem, so another card or any upgrade misses and tunes again. Values are
JSON (tuples come back as tuples); an unreadable file is ignored (and replaced at the next store)."""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import torch

from corolla import __version__
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

FILE_NAME = "kernel_choices_v1.json"
LOCK_NAME = "kernel_choices.lock"


def _tuples(value: Any) -> Any:
    # JSON has no tuples: the choices are tuples of str/int (and None); lists come back as tuples
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def device_scope(device: torch.device) -> str:
    """What a choice depends on besides its problem: the card and the software that compiles and runs kernels."""
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "none"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{name}|torch {torch.__version__}|triton {triton}|corolla {__version__}"


class KernelChoices:
    """{problem: choice} of one device scope, read from and written to `directory`/FILE_NAME."""

    def __init__(self, directory: str | os.PathLike, scope: str):
        self.directory = Path(directory)
        self.path = self.directory / FILE_NAME
        self.scope = scope
        self._entries = self._read()

    def _read(self) -> dict[str, Any]:
        try:
            entries = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            logger.warning(f"kernel_choices.unreadable(path={self.path}, error={e!r})")
            return {}
        return entries if isinstance(entries, dict) else {}

    def _key(self, problem: str) -> str:
        return f"{self.scope}|{problem}"

    def get(self, problem: str) -> Any | None:
        """The stored choice for `problem` on this scope, None if there is none."""
        value = self._entries.get(self._key(problem))
        return None if value is None else _tuples(value)

    def put(self, problem: str, choice: Any) -> None:
        """Stores `choice` (JSON-able; tuples allowed) for `problem`, merged with what other processes stored."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / LOCK_NAME, "w") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # servers of one host may start together
            self._entries = {**self._read(), self._key(problem): choice}
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self._entries, indent=1, sort_keys=True))
            tmp.replace(self.path)
