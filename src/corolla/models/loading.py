"""Loading one block's weights and nothing else: from a safetensors index (only the shards holding the block),
a single safetensors file, or pytorch `.bin` files; from a local directory or the hub (through the shared
disk cache of `disk_cache`); bitsandbytes' pre-quantized checkpoints through `prequantized`."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from corolla.models import disk_cache, hub_files
from corolla.models.block_base import CorollaBlock
from corolla.models.config import checkpoint_dtype, is_local_path, parse_dtype
from corolla.models.prequantized import PrequantizedFormat
from corolla.models.registry import ModelFamily, get_family
from corolla.utils.errors import ConfigurationError
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

CHECKPOINT_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)
# Called with the path of every checkpoint file opened to read weights (tests assert which shards were read).
FILE_OPEN_HOOKS: list[Callable[[str], None]] = []
HUB_DOWNLOAD_RETRIES = 3


def load_pretrained_block(
    name_or_path: str | os.PathLike,
    block_index: int,
    *,
    config,
    torch_dtype: str | torch.dtype = "auto",
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    token=None,
    max_disk_space_bytes: int | None = None,
) -> CorollaBlock:
    """Builds block `block_index` of the model on CPU in `torch_dtype` ("auto": the checkpoint's dtype unless
    float32, else bfloat16) with its parameters frozen, reading only that block's tensors."""
    family, source = _block_source(name_or_path, block_index, config, cache_dir, revision, token, max_disk_space_bytes)
    dtype = parse_dtype(torch_dtype)
    if dtype is None:
        found = checkpoint_dtype(config)
        dtype = torch.bfloat16 if found is None or found == torch.float32 else found
    started = time.perf_counter()

    with torch.device("meta"):
        block = family.build_block(config, block_index)
    block = block.to(dtype).to_empty(device="cpu")
    state_dict, origin = source.read_block(family.block_prefixes, block_index)
    prequantized = PrequantizedFormat.of_config(config)
    if prequantized is not None:  # bitsandbytes' stored codes: dequantized here, quantized again at placement
        state_dict = prequantized.dequantized(state_dict, dtype)
    block.load_hf_state_dict(state_dict, source=f"the checkpoint {source.name_or_path}", origin=origin)
    block.requires_grad_(False)
    logger.info(
        "load_pretrained_block.done(model=%s, block=%d, dtype=%s, files=%d, seconds=%.2f)",
        name_or_path, block_index, dtype, len(set(origin.values())), time.perf_counter() - started,
    )  # fmt: skip
    return block


def fetch_pretrained_block(
    name_or_path: str | os.PathLike,
    block_index: int,
    *,
    config,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    token=None,
    max_disk_space_bytes: int | None = None,
) -> None:
    """Brings the checkpoint files of block `block_index` to the local cache without building the block
    (`load_pretrained_block` then reads them from the disk)."""
    family, source = _block_source(name_or_path, block_index, config, cache_dir, revision, token, max_disk_space_bytes)
    source.fetch_block(family.block_prefixes, block_index)


def _block_source(
    name_or_path, block_index: int, config, cache_dir, revision, token, max_disk_space_bytes
) -> tuple[ModelFamily, CheckpointSource]:
    """The family of `config` and the checkpoint to read block `block_index` from (ValueError past the last block)."""
    if not 0 <= block_index < config.num_hidden_layers:
        raise ValueError(f"block_index must be in [0, {config.num_hidden_layers}), got {block_index}")
    source = CheckpointSource(
        name_or_path, cache_dir=cache_dir, revision=revision, token=token, max_disk_space_bytes=max_disk_space_bytes
    )
    return get_family(config), source


def _notify_open(path: str) -> None:
    logger.debug("load.open_file(path=%s)", path)
    for hook in list(FILE_OPEN_HOOKS):
        hook(path)


def read_file_tensors(path: str | os.PathLike, keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The one reader of checkpoint files: `{name: tensor}` of the tensors whose name `keep` accepts; safetensors
    are read lazily (only those tensors), `.bin` files are loaded with `weights_only=True` and filtered."""
    path = str(path)
    _notify_open(path)
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys() if keep(k)}
    return {k: v for k, v in _torch_load(path).items() if keep(k)}


def _torch_load(path: str) -> dict[str, torch.Tensor]:
    """`weights_only` (no pickled code); memory-mapped when the file format allows it (zip, torch >= 1.6)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        return torch.load(path, map_location="cpu", weights_only=True)


class CheckpointSource:
    """A checkpoint in a local directory or a hub repo; hands out local paths of its files and reads a block's
    tensors (servers) or named tensors (a client's embeddings and head), fetching only the files that hold them."""

    def __init__(self, name_or_path, *, cache_dir=None, revision=None, token=None, max_disk_space_bytes=None):
        self.name_or_path = str(name_or_path)
        self.local = is_local_path(name_or_path)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else disk_cache.DEFAULT_CACHE_DIR
        self.revision = revision
        # Meta's Llama 2 repos are gated: use the locally saved token when none is given (as the reference does).
        self.token = True if token is None and self.name_or_path.startswith("meta-llama/Llama-2-") else token
        self.max_disk_space_bytes = max_disk_space_bytes
        self.search_dirs = hub_files.search_dirs(self.cache_dir)  # corolla's cache, then Hugging Face's

    # --- which files -------------------------------------------------------------------------------------
    def _find_index_file(self) -> str:
        if self.local:
            for name in CHECKPOINT_FILES:
                if (Path(self.name_or_path) / name).is_file():
                    return name
            raise ConfigurationError(f"No checkpoint in {self.name_or_path}: expected one of {CHECKPOINT_FILES}")
        for name in CHECKPOINT_FILES:  # a cached copy first (corolla's cache, then HF's): offline restarts work
            if self._cached_path(name) is not None:
                return name
        if hub_files.hub_offline():
            raise hub_files.not_cached_offline(
                self.name_or_path, f"A checkpoint ({' or '.join(CHECKPOINT_FILES)})",
                revision=self.revision, cache_dirs=self.search_dirs,
            )  # fmt: skip
        import huggingface_hub
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

        for name in CHECKPOINT_FILES:
            if hub_files.known_missing(self.name_or_path, name, revision=self.revision, cache_dirs=self.search_dirs):
                continue
            try:
                if huggingface_hub.file_exists(self.name_or_path, name, revision=self.revision, token=self.token):
                    return name
            except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError) as e:
                raise ConfigurationError(f"Can't read hub repo {self.name_or_path}: {_first_line(e)}") from None
        raise ConfigurationError(f"No checkpoint in hub repo {self.name_or_path}: expected one of {CHECKPOINT_FILES}")

    def block_files(self, prefixes: tuple[str, ...], block_index: int) -> tuple[list[str], str | None]:
        """(the checkpoint files holding block `block_index`, its tensors' name prefix where the index names it)."""
        index_name, weight_map = self._weight_map()
        if weight_map is None:
            return [index_name], None
        prefix = _pick_prefix(prefixes, block_index, weight_map.keys())
        if prefix is None:
            raise ConfigurationError(
                f"No tensors of block {block_index} (prefixes {[f'{p}.{block_index}.' for p in prefixes]}) "
                f"in {self.name_or_path}/{index_name}"
            )
        return sorted({file for name, file in weight_map.items() if name.startswith(prefix)}), prefix

    def fetch_block(self, prefixes: tuple[str, ...], block_index: int) -> None:
        """Brings the files of block `block_index` to the local cache (a download where they are not there yet),
        reading no tensor: a server fetches the span it moves to while it still serves its old one."""
        if not self.local:
            for file in self.block_files(prefixes, block_index)[0]:
                self.get_file(file)

    def read_block(self, prefixes: tuple[str, ...], block_index: int):
        """(state dict relative to the layer prefix, {name: file it came from})."""
        files, prefix = self.block_files(prefixes, block_index)
        state_dict: dict[str, torch.Tensor] = {}
        origin: dict[str, str] = {}

        def read(path: str) -> dict[str, torch.Tensor]:
            nonlocal prefix
            if prefix is None:
                prefix = _pick_prefix(prefixes, block_index, tensor_names(path))
                if prefix is None:
                    raise ConfigurationError(f"No tensors of block {block_index} in {path}")
            loaded = read_file_tensors(path, lambda name: name.startswith(prefix))
            return {k[len(prefix) :]: v for k, v in loaded.items()}  # names relative to the layer prefix

        progress = tqdm(files, desc=f"Loading block {block_index}", unit="file", disable=len(files) < 4, leave=False)
        for file in progress:
            local_path, tensors = self._read_file(file, read)
            state_dict.update(tensors)
            origin.update({name: local_path for name in tensors})
        return state_dict, origin

    def read_named(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors named in `names` that the checkpoint holds (absent names left out), from the files holding
        them only."""
        wanted = set(names)
        index_name, weight_map = self._weight_map()
        files = [index_name] if weight_map is None else sorted({weight_map[n] for n in wanted if n in weight_map})
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(self._read_file(file, lambda path: read_file_tensors(path, wanted.__contains__))[1])
        return tensors

    def _weight_map(self) -> tuple[str, dict[str, str] | None]:
        """(the checkpoint's index or single file, the index's {tensor name: file}, None for a single file)."""
        index_name = self._find_index_file()
        if not index_name.endswith(".index.json"):
            return index_name, None
        with open(self.get_file(index_name)) as f:
            return index_name, json.load(f)["weight_map"]

    def _read_file(
        self, file: str, read: Callable[[str], dict[str, torch.Tensor]]
    ) -> tuple[str, dict[str, torch.Tensor]]:
        """(local path, `read(local path)`) of one checkpoint file, fetched if needed, read under the disk cache's
        read lock and marked used there."""
        local_path = self.get_file(file)
        with disk_cache.allow_cache_reads(self.cache_dir) if not self.local else contextlib.nullcontext():
            tensors = read(local_path)
        if not self.local:
            disk_cache.mark_used(local_path)
        return local_path, tensors

    # --- fetching -------------------------------------------------------------------------------------------
    def _cached_path(self, filename: str) -> str | None:
        """A local copy in corolla's cache or Hugging Face's (at `revision`), found without the network."""
        return hub_files.cached_file(self.name_or_path, filename, revision=self.revision, cache_dirs=self.search_dirs)

    def get_file(self, filename: str) -> str:
        if self.local:
            return str(Path(self.name_or_path) / filename)
        cached = self._cached_path(filename)
        if cached is not None:
            return cached
        if hub_files.hub_offline():
            raise hub_files.not_cached_offline(
                self.name_or_path, filename, revision=self.revision, cache_dirs=self.search_dirs
            )
        import huggingface_hub
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        last_error: Exception | None = None
        for attempt in range(HUB_DOWNLOAD_RETRIES):
            try:
                with disk_cache.allow_cache_writes(self.cache_dir):
                    url = huggingface_hub.hf_hub_url(self.name_or_path, filename, revision=self.revision)
                    size = huggingface_hub.get_hf_file_metadata(url, token=self.token).size or 0
                    disk_cache.free_disk_space_for(
                        size, cache_dir=self.cache_dir, max_disk_space_bytes=self.max_disk_space_bytes
                    )
                    logger.info("load.download(repo=%s, file=%s, bytes=%d)", self.name_or_path, filename, size)
                    return huggingface_hub.hf_hub_download(
                        self.name_or_path, filename, revision=self.revision, token=self.token,
                        cache_dir=self.cache_dir, tqdm_class=hub_files.TerminalTqdm,
                    )  # fmt: skip
            except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError, EntryNotFoundError) as e:
                raise ConfigurationError(
                    f"Can't download {filename} of {self.name_or_path}: {_first_line(e)}"
                ) from None
            except OfflineModeIsEnabled:
                raise hub_files.not_cached_offline(
                    self.name_or_path, filename, revision=self.revision, cache_dirs=self.search_dirs
                ) from None
            except (OSError, huggingface_hub.errors.HfHubHTTPError) as e:
                last_error = e
                logger.warning("load.download_retry(file=%s, attempt=%d, error=%r)", filename, attempt + 1, e)
                time.sleep(min(30.0, 2.0**attempt))
        raise RuntimeError(f"Could not download {filename} from {self.name_or_path}: {last_error}") from last_error


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def tensor_names(path: str) -> list[str]:
    """The names of the tensors in one checkpoint file (safetensors: without reading them)."""
    if str(path).endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys())
    return list(_torch_load(str(path)).keys())


def _pick_prefix(prefixes: tuple[str, ...], block_index: int, names) -> str | None:
    names = list(names)
    for p in prefixes:
        full = f"{p}.{block_index}."
        if any(n.startswith(full) for n in names):
            return full
    return None
