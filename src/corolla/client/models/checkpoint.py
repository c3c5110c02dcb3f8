"""Reads only the named tensors of a checkpoint (safetensors index/single file, or `.bin`), from a local
directory or the Hugging Face hub, so that a client never touches the transformer blocks' weights."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from corolla.models import hub_files
from corolla.models.loading import read_named_tensors, tensor_names
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")


class CheckpointReader:
    """`read(names)` -> {name: tensor} for the names present; downloads (hub) only the shards that hold them."""

    def __init__(
        self,
        name_or_path: str | os.PathLike,
        *,
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | None = None,
    ):
        self.name_or_path = str(name_or_path)
        self.revision, self.token, self.cache_dir = revision, token, cache_dir
        self._local = Path(self.name_or_path).is_dir()
        self._weight_map: dict[str, str] | None = None  # tensor name -> file
        self._single_file: str | None = None
        self._resolve()

    def _fetch(self, filename: str) -> str | None:
        """A local path of `filename`, or None when the repo has no such file (or, offline, no cached copy)."""
        if self._local:
            path = Path(self.name_or_path) / filename
            return str(path) if path.exists() else None
        dirs = hub_files.search_dirs(self.cache_dir)
        cached = hub_files.cached_file(self.name_or_path, filename, revision=self.revision, cache_dirs=dirs)
        if cached is not None:
            return cached
        if hub_files.hub_offline() or hub_files.known_missing(
            self.name_or_path, filename, revision=self.revision, cache_dirs=dirs
        ):
            return None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return hf_hub_download(
                self.name_or_path, filename, revision=self.revision, token=self.token, cache_dir=self.cache_dir,
                tqdm_class=hub_files.TerminalTqdm,
            )  # fmt: skip
        except EntryNotFoundError:
            return None

    def _resolve(self) -> None:
        for index_name in _INDEX_FILES:
            index_path = self._fetch(index_name)
            if index_path is not None:
                with open(index_path) as f:
                    self._weight_map = dict(json.load(f)["weight_map"])
                return
        for single in _SINGLE_FILES:
            if self._fetch(single) is not None:
                self._single_file = single
                return
        if not self._local:
            if hub_files.hub_offline():
                raise hub_files.not_cached_offline(
                    self.name_or_path, "A checkpoint", revision=self.revision,
                    cache_dirs=hub_files.search_dirs(self.cache_dir),
                )  # fmt: skip
        raise FileNotFoundError(f"no safetensors or .bin checkpoint found in {self.name_or_path}")

    def _names_in_file(self, filename: str) -> list[str]:
        path = self._fetch(filename)
        assert path is not None
        return tensor_names(path)

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        names = list(names)
        if self._weight_map is not None:
            by_file: dict[str, list[str]] = {}
            for name in names:
                if name in self._weight_map:
                    by_file.setdefault(self._weight_map[name], []).append(name)
        else:
            assert self._single_file is not None
            available = set(self._names_in_file(self._single_file))
            by_file = {self._single_file: [n for n in names if n in available]}
        result: dict[str, torch.Tensor] = {}
        for filename, wanted in by_file.items():
            if not wanted:
                continue
            path = self._fetch(filename)
            assert path is not None
            logger.debug("checkpoint.read(file=%s, tensors=%d)", filename, len(wanted))
            result.update(read_named_tensors(path, wanted))
        return result
