"""A Hugging Face hub cache on disk laid out as `huggingface_hub` writes it (`models--ORG--NAME/blobs/<etag>`,
`refs/<branch or tag>` holding the commit, `snapshots/<commit>/<file>` as relative symlinks to the blobs), filled from
a model folder: what a user has after `hf download ORG/NAME`, without any network."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # stored through git LFS on the hub: etag = sha256


def _etag(path: Path) -> str:
    data = path.read_bytes()
    if path.name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id for regular files


def populate_hf_cache(
    model_dir: str | Path,
    cache_dir: str | Path,
    repo_id: str,
    *,
    refs: Iterable[str] = ("main",),
    files: Iterable[str] | None = None,
) -> str:
    """Adds the files of `model_dir` (or only `files`) as one commit of `repo_id` to the cache `cache_dir`, with
    each of `refs` pointing at it; returns the commit hash."""
    model_dir, cache_dir = Path(model_dir), Path(cache_dir)
    names = sorted(files) if files is not None else sorted(p.name for p in model_dir.iterdir() if p.is_file())
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(("|".join(names) + repo_id + str(model_dir)).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in names:
        source = model_dir / name
        etag = _etag(source)
        blob = repo / "blobs" / etag
        if not blob.exists():
            blob.write_bytes(source.read_bytes())
        link = snapshot / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes the bare hash, no newline
    return commit
