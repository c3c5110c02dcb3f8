"""Where a hub repo's files already are on this machine, without touching the network: corolla's block cache and
Hugging Face's own cache (`HF_HUB_CACHE`, where `hf download` and transformers put them), at any revision (branch,
tag or commit); whether downloading is allowed (`HF_HUB_OFFLINE`); progress bars only on a terminal."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from tqdm.auto import tqdm

from corolla.utils.errors import ConfigurationError


def hub_offline() -> bool:
    """True when `HF_HUB_OFFLINE` is set (read by huggingface_hub when it was imported)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hf_cache_dir() -> str:
    """Hugging Face's cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def search_dirs(cache_dir: str | os.PathLike | None) -> tuple[str, ...]:
    """Caches to look in, in order: `cache_dir` (corolla's, or one given by the user), then Hugging Face's."""
    dirs = [str(cache_dir)] if cache_dir is not None else []
    if hf_cache_dir() not in dirs:
        dirs.append(hf_cache_dir())
    return tuple(dirs)


def cached_file(repo_id: str, filename: str, *, revision: str | None, cache_dirs: Iterable[str]) -> str | None:
    """The local path of `filename` of `repo_id` at `revision` in the first cache holding it, else None. Reads only
    the cache layout (`refs/`, `snapshots/`), never the network; a dangling snapshot link (evicted blob) is a miss."""
    from huggingface_hub import try_to_load_from_cache

    for cache_dir in cache_dirs:
        try:
            path = try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir, revision=revision)
        except (OSError, ValueError):  # unreadable cache dir, a malformed name
            continue
        if isinstance(path, str) and os.path.isfile(path):
            return path
    return None


def known_missing(repo_id: str, filename: str, *, revision: str | None, cache_dirs: Iterable[str]) -> bool:
    """True when a cache recorded that the repo has no such file at that revision (`.no_exist/`)."""
    from huggingface_hub import _CACHED_NO_EXIST, try_to_load_from_cache

    for cache_dir in cache_dirs:
        try:
            if try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir, revision=revision) is _CACHED_NO_EXIST:
                return True
        except (OSError, ValueError):
            continue
    return False


def not_cached_offline(repo_id: str, what: str, *, revision: str | None, cache_dirs: Iterable[str]):
    """The error for a file that offline mode forbids downloading."""
    at = f" at revision {revision}" if revision else ""
    return ConfigurationError(
        f"{what} of {repo_id}{at} is not in the local caches ({', '.join(cache_dirs)}) and HF_HUB_OFFLINE=1 forbids "
        f"downloading it: download the model once online (e.g. `hf download {repo_id}`) or unset HF_HUB_OFFLINE"
    )


class TerminalTqdm(tqdm):
    """huggingface_hub's download bars, shown only when stderr is a terminal (no bar noise in logs and CI)."""

    def __init__(self, *args, **kwargs):
        if not _stderr_is_tty():
            kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
