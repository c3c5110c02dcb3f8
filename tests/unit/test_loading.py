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
from helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.usefixtures("single_torch_thread")


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
    assert sum(f[1] for f in disk_cache.cached_files(cache)) == 1200

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


class _FakeHub:
    """Serves a local folder as hub repo "org/tiny" into the hub-style cache (blobs + snapshot symlinks)."""

    def __init__(self, remote_dir, monkeypatch):
        import huggingface_hub

        self.remote = remote_dir
        self.downloads: list[str] = []
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", self.hf_hub_download)
        monkeypatch.setattr(huggingface_hub, "hf_hub_url", lambda repo, filename, revision=None: filename)
        monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", self.metadata)
        monkeypatch.setattr(huggingface_hub, "file_exists", lambda repo, name, **kw: (self.remote / name).exists())

    def metadata(self, url, token=None):
        return type("Meta", (), {"size": (self.remote / url).stat().st_size})()

    def hf_hub_download(
        self, repo_id, filename, *, revision=None, token=None, cache_dir=None, local_files_only=False, **_bars
    ):
        root = cache_dir / "models--org--tiny"
        link = root / "snapshots" / "main" / filename
        if link.exists():
            return str(link)
        if local_files_only:
            raise FileNotFoundError(filename)
        blob = root / "blobs" / f"blob-{filename}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes((self.remote / filename).read_bytes())
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(blob)
        self.downloads.append(filename)
        return str(link)


def test_hub_loading_downloads_only_needed_shards_and_evicts(tmp_path, monkeypatch):
    remote = make_tiny_model("llama", tmp_path, sharded=True)
    hub = _FakeHub(remote, monkeypatch)
    config = load_config(remote)
    cache = tmp_path / "cache"
    weight_map = json.loads((remote / "model.safetensors.index.json").read_text())["weight_map"]

    def shards(index):
        return {f for n, f in weight_map.items() if n.startswith(f"model.layers.{index}.")}

    def size(files):
        return sum((remote / f).stat().st_size for f in files)

    block = load_pretrained_block("org/tiny", 2, config=config, torch_dtype=torch.float32, cache_dir=cache)
    assert set(hub.downloads) == {"model.safetensors.index.json"} | shards(2)
    _same_weights(block, _load(remote, 2))

    hub.downloads.clear()  # cached: a second server on this host downloads nothing
    load_pretrained_block("org/tiny", 2, config=config, torch_dtype=torch.float32, cache_dir=cache)
    assert hub.downloads == []

    # A disk budget that holds block 0's shards but not block 2's as well: the least recently used go.
    budget = size(shards(0) | {"model.safetensors.index.json"}) + 1024
    assert budget < sum(f[1] for f in disk_cache.cached_files(cache)) + size(shards(0) - shards(2))
    block0 = load_pretrained_block(
        "org/tiny", 0, config=config, torch_dtype=torch.float32, cache_dir=cache, max_disk_space_bytes=budget
    )
    _same_weights(block0, _load(remote, 0))
    assert sum(f[1] for f in disk_cache.cached_files(cache)) <= budget
    with pytest.raises(AllocationFailed, match="Insufficient disk space"):
        load_pretrained_block(
            "org/tiny", 3, config=config, torch_dtype=torch.float32, cache_dir=tmp_path / "c2", max_disk_space_bytes=100
        )


def test_fetching_a_block_downloads_its_shards_and_reads_no_tensor(tmp_path, monkeypatch, opened_files):
    """A server moving to a span fetches its files while it serves the old one (decision 0025): the shards come to
    the cache, no tensor file is opened, and the load that follows downloads nothing."""
    remote = make_tiny_model("llama", tmp_path, sharded=True)
    hub = _FakeHub(remote, monkeypatch)
    config = load_config(remote)
    cache = tmp_path / "cache"
    weight_map = json.loads((remote / "model.safetensors.index.json").read_text())["weight_map"]
    loading.fetch_pretrained_block("org/tiny", 1, config=config, cache_dir=cache)
    assert set(hub.downloads) == {"model.safetensors.index.json"} | {
        f for n, f in weight_map.items() if n.startswith("model.layers.1.")
    }
    assert opened_files == []
    hub.downloads.clear()
    load_pretrained_block("org/tiny", 1, config=config, torch_dtype=torch.float32, cache_dir=cache)
    assert hub.downloads == []
