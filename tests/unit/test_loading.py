"""Partial weight loading: only the shards holding a block are opened, `.bin` checkpoints load, missing or
mis-shaped tensors are named with their file, and the shared disk cache evicts least-recently-used files."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from corolla.models import disk_cache, loading
from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from corolla.utils.errors import AllocationFailed
from helpers.tiny_models import make_tiny_model, torch_threads


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with torch_threads(1):
        yield


@pytest.fixture
def opened_files():
    opened: list[str] = []
    loading.FILE_OPEN_HOOKS.append(opened.append)
    yield opened
    loading.FILE_OPEN_HOOKS.remove(opened.append)


def _load(model_dir, index, dtype=torch.float32):
    return load_pretrained_block(model_dir, index, config=load_config(model_dir), torch_dtype=dtype)


def _same_weights(a, b) -> None:
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("family", ["llama", "bloom"])
def test_sharded_checkpoint_opens_only_the_blocks_shards(family, tmp_path, opened_files):
    model_dir = make_tiny_model(family, tmp_path, sharded=True)
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    prefix = "model.layers.2." if family == "llama" else "transformer.h.2."
    needed = {file for name, file in weight_map.items() if name.startswith(prefix)}
    assert len(set(weight_map.values())) > len(needed) + 2  # the test is meaningful: many shards hold other things

    block = _load(model_dir, 2)
    assert {os.path.basename(p) for p in opened_files} == needed
    _same_weights(block, _load(make_tiny_model(family, tmp_path), 2))  # same as from the single file


def test_single_file_and_auto_dtype(tmp_path, opened_files):
    model_dir = make_tiny_model("qwen2", tmp_path)
    block = load_pretrained_block(model_dir, 0, config=load_config(model_dir), torch_dtype="auto")
    assert [os.path.basename(p) for p in opened_files] == ["model.safetensors"]
    assert block.dtype == torch.bfloat16  # float32 checkpoint + auto -> bfloat16
    assert not any(p.requires_grad for p in block.parameters())
    bf16_dir = make_tiny_model("qwen2", tmp_path, dtype=torch.bfloat16)
    assert _load(bf16_dir, 0, dtype="auto").dtype == torch.bfloat16
    assert _load(model_dir, 0, dtype="float32").dtype == torch.float32


def test_pytorch_bin_checkpoints_load(tmp_path, opened_files):
    source = make_tiny_model("mixtral", tmp_path)
    state = load_file(source / "model.safetensors")
    single, sharded = tmp_path / "bin-single", tmp_path / "bin-sharded"
    for d in (single, sharded):
        d.mkdir()
        (d / "config.json").write_text((source / "config.json").read_text())
    torch.save(state, single / "pytorch_model.bin")
    names = sorted(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, keys in halves.items():
        torch.save({k: state[k] for k in keys}, sharded / file)
    weight_map = {k: file for file, keys in halves.items() for k in keys}
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    reference = _load(source, 1)
    _same_weights(_load(single, 1), reference)
    _same_weights(_load(sharded, 1), reference)
    assert any(p.endswith("pytorch_model-00002-of-00002.bin") for p in opened_files)


def test_missing_and_misshaped_tensors_are_named_with_their_file(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path)
    path = model_dir / "model.safetensors"
    state = load_file(path)
    del state["model.layers.1.mlp.down_proj.weight"]
    state["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'mlp\.down_proj\.weight'.*block 1.*tiny-llama"):
        _load(model_dir, 1)
    with pytest.raises(ValueError, match=r"'self_attn\.k_proj\.weight'.*block 2.*model\.safetensors.*\(3, 64\)"):
        _load(model_dir, 2)
    _load(model_dir, 0)  # other blocks are fine
    with pytest.raises(ValueError, match="block_index"):
        _load(model_dir, 4)


def _fake_cached_file(cache_dir, name: str, size: int, accessed: float):
    """A file in the hub cache layout: blobs/<name> plus a snapshot symlink to it."""
    blob = cache_dir / "models--org--m" / "blobs" / name
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(b"x" * size)
    os.utime(blob, (accessed, accessed))
    link = cache_dir / "models--org--m" / "snapshots" / "abc" / f"{name}.safetensors"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(blob)
    return blob, link


def test_lru_eviction_under_max_disk_space(tmp_path):
    cache = tmp_path / "cache"
    now = time.time()
    old, old_link = _fake_cached_file(cache, "old", 400, now - 300)
    mid, _ = _fake_cached_file(cache, "mid", 400, now - 200)
    new, _ = _fake_cached_file(cache, "new", 400, now - 100)
    disk_cache.mark_used(mid)  # a recent read makes "mid" the most recently used
    assert disk_cache.cache_size_bytes(cache) == 1200

    disk_cache.free_disk_space_for(300, cache_dir=cache, max_disk_space_bytes=1500)  # fits: nothing evicted
    assert old.exists() and mid.exists() and new.exists()
    disk_cache.free_disk_space_for(500, cache_dir=cache, max_disk_space_bytes=1500)  # evicts the LRU file only
    assert not old.exists() and not old_link.is_symlink() and mid.exists() and new.exists()
    disk_cache.free_disk_space_for(1000, cache_dir=cache, max_disk_space_bytes=1500)  # needs one more: "new" goes
    assert not new.exists() and mid.exists()
    with pytest.raises(AllocationFailed, match=r"2000 byte.*max_disk_space=1500"):
        disk_cache.free_disk_space_for(2000, cache_dir=cache, max_disk_space_bytes=1500)
    assert mid.exists()  # a request that cannot fit evicts nothing


def test_cache_lock_writers_wait_for_readers(tmp_path):
    acquired = threading.Event()

    def writer():
        with disk_cache.allow_cache_writes(tmp_path):
            acquired.set()

    with disk_cache.allow_cache_reads(tmp_path), disk_cache.allow_cache_reads(tmp_path):  # readers share
        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        assert not acquired.wait(0.3)
    assert acquired.wait(5.0)
    thread.join(5.0)
