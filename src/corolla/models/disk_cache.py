"""The on-disk cache of checkpoint files shared by all servers of a host: an `fcntl` lock (shared for reads,
exclusive for writes) and `max_disk_space` enforced by evicting least-recently-used files."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from corolla.utils.errors import AllocationFailed
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DEFAULT_CACHE_DIR = Path(os.environ.get("COROLLA_CACHE", Path.home() / ".cache" / "corolla"))
LOCK_FILE_NAME = "blocks.lock"
OS_QUOTA_BYTES = 1024**3  # keep this much of the disk free for everything else


@contextlib.contextmanager
def _locked(cache_dir: str | os.PathLike[str], mode: int) -> Iterator[None]:
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / LOCK_FILE_NAME, "a+") as lock:
        fcntl.flock(lock.fileno(), mode)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def allow_cache_reads(cache_dir: str | os.PathLike[str]) -> contextlib.AbstractContextManager[None]:
    """Shared lock: many servers may read while nobody evicts or writes."""
    return _locked(cache_dir, fcntl.LOCK_SH)


def allow_cache_writes(cache_dir: str | os.PathLike[str]) -> contextlib.AbstractContextManager[None]:
    """Exclusive lock: for downloading and evicting."""
    return _locked(cache_dir, fcntl.LOCK_EX)


def mark_used(path: str | os.PathLike[str]) -> None:
    """Records a read for LRU (atime is often not updated by the OS: relatime/noatime mounts)."""
    real = Path(path).resolve()
    with contextlib.suppress(OSError):
        st = real.stat()
        os.utime(real, (time.time(), st.st_mtime))


def cached_files(cache_dir: str | os.PathLike[str]) -> list[tuple[Path, int, float]]:
    """Regular files in the cache (not symlinks, not the lock): (path, size_bytes, last_access_time)."""
    result = []
    for root, _dirs, files in os.walk(cache_dir):
        for name in files:
            path = Path(root) / name
            if name == LOCK_FILE_NAME or path.is_symlink() or name.endswith(".lock"):
                continue
            with contextlib.suppress(OSError):
                st = path.stat()
                result.append((path, st.st_size, st.st_atime))
    return result


def _remove_dangling_links(cache_dir: str | os.PathLike[str]) -> None:
    for root, _dirs, files in os.walk(cache_dir):
        for name in files:
            path = Path(root) / name
            if path.is_symlink() and not path.exists():
                path.unlink(missing_ok=True)


def free_disk_space_for(
    size_bytes: int,
    *,
    cache_dir: str | os.PathLike[str],
    max_disk_space_bytes: int | None,
    os_quota_bytes: int = OS_QUOTA_BYTES,
) -> None:
    """Makes room for a new file of `size_bytes` (call under `allow_cache_writes`): evicts cached files in
    least-recently-used order; `AllocationFailed` saying how much is missing when even an empty cache is too small."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    files = sorted(cached_files(cache_dir), key=lambda f: f[2])  # oldest access first
    reclaimable = sum(size for _, size, _ in files)  # every cached file may go
    available = shutil.disk_usage(cache_dir).free - os_quota_bytes
    if max_disk_space_bytes is not None:
        available = min(available, max_disk_space_bytes - reclaimable)
    if size_bytes > available + reclaimable:
        raise AllocationFailed(
            f"Insufficient disk space to cache a {size_bytes} byte checkpoint file in {cache_dir}: "
            f"{max(available, 0)} bytes free and {reclaimable} reclaimable by evicting the cache "
            f"(max_disk_space={max_disk_space_bytes}); raise --max_disk_space or free disk space"
        )
    evicted = []
    for path, size, _ in files:
        if available >= size_bytes:
            break
        path.unlink(missing_ok=True)
        available += size
        evicted.append(path)
    if evicted:
        _remove_dangling_links(cache_dir)
        logger.info("disk_cache.evicted(files=%d, for_bytes=%d, dir=%s)", len(evicted), size_bytes, cache_dir)
