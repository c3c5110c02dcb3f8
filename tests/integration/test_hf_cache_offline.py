"""Serving a hub model from the local Hugging Face cache with `HF_HUB_OFFLINE=1`: the cache is laid out as
huggingface_hub writes it (blobs, refs, snapshot symlinks); single-file, sharded and `.bin` repos, by branch, tag or
commit, load their blocks without the network and without copying into corolla's cache; two `corolla-server ORG/NAME`
processes serve from it and corolla's client, loading the same hub names offline, generates what transformers does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tests.helpers.hf_cache import populate_hf_cache
from tests.helpers.swarm import Swarm
from tests.helpers.tiny_models import make_tiny_model

from corolla.models import disk_cache
from corolla.models import loading as loading_module
from corolla.models.config import load_config
from corolla.models.loading import CheckpointSource, load_pretrained_block
from corolla.utils.errors import ConfigurationError

pytestmark = pytest.mark.timeout(300)

SINGLE, SHARDED, BIN = "corolla-test/tiny-llama", "corolla-test/tiny-llama-sharded", "corolla-test/tiny-llama-bin"
PROMPT = "An offline cache"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    models = tmp_path_factory.mktemp("models")
    single = make_tiny_model("llama", models)
    sharded = make_tiny_model("llama", models, sharded=True)
    bin_dir = models / "tiny-llama-bin"  # the same weights as one pytorch_model.bin
    bin_dir.mkdir()
    for path in single.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, bin_dir / path.name)
    from safetensors.torch import load_file

    torch.save(load_file(single / "model.safetensors"), bin_dir / "pytorch_model.bin")
    cache = tmp_path_factory.mktemp("hf") / "hub"
    commits = {
        SINGLE: populate_hf_cache(single, cache, SINGLE),
        SHARDED: populate_hf_cache(sharded, cache, SHARDED, refs=("main", "v1")),
        BIN: populate_hf_cache(bin_dir, cache, BIN),
    }
    return SimpleNamespace(cache=cache, dirs={SINGLE: single, SHARDED: sharded, BIN: bin_dir}, commits=commits)


@pytest.fixture
def offline(hub, monkeypatch, tmp_path) -> Path:
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE=the populated cache for this process; returns an empty corolla cache."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub.cache))
    return tmp_path / "corolla-cache"


def test_the_cache_is_what_huggingface_hub_reads(hub):
    from huggingface_hub import scan_cache_dir, snapshot_download

    info = scan_cache_dir(hub.cache)
    assert not info.warnings
    repos = {repo.repo_id: repo for repo in info.repos}
    assert set(repos) == {SINGLE, SHARDED, BIN}
    (revision,) = repos[SHARDED].revisions
    assert revision.commit_hash == hub.commits[SHARDED] and revision.refs == frozenset({"main", "v1"})
    folder = snapshot_download(SHARDED, cache_dir=hub.cache, local_files_only=True)
    assert (Path(folder) / "model.safetensors.index.json").is_symlink()


@pytest.mark.parametrize(
    "repo, revision",
    [(SINGLE, None), (SHARDED, None), (SHARDED, "v1"), (SHARDED, "commit"), (BIN, None)],
    ids=["single", "sharded", "sharded-tag", "sharded-commit", "bin"],
)
def test_blocks_load_offline_from_the_hf_cache(hub, offline, repo, revision, monkeypatch):
    revision = hub.commits[repo] if revision == "commit" else revision
    opened: list[str] = []
    monkeypatch.setattr(loading_module, "FILE_OPEN_HOOKS", [opened.append])
    config = load_config(repo, revision=revision)
    block = load_pretrained_block(
        repo, 1, config=config, torch_dtype=torch.float32, cache_dir=offline, revision=revision
    )
    opened_from_hub = list(opened)
    expected = load_pretrained_block(hub.dirs[repo], 1, config=config, torch_dtype=torch.float32)
    for (name, value), (_, reference) in zip(block.state_dict().items(), expected.state_dict().items(), strict=True):
        assert torch.equal(value, reference), name
    snapshot = hub.cache / f"models--{repo.replace('/', '--')}" / "snapshots" / hub.commits[repo]
    assert opened_from_hub and all(Path(path).parent == snapshot for path in opened_from_hub)
    if repo == SHARDED:  # only the shards holding block 1
        assert len(opened_from_hub) < len(list(hub.dirs[SHARDED].glob("model-*.safetensors")))
    # read in place, nothing copied
    assert not offline.exists() or sum(f[1] for f in disk_cache.cached_files(offline)) == 0


def test_what_is_not_cached_offline_is_one_clear_error(hub, offline):
    config = load_config(hub.dirs[SINGLE])
    with pytest.raises(ConfigurationError, match=r"corolla-test/absent .*HF_HUB_OFFLINE=1"):
        load_pretrained_block("corolla-test/absent", 0, config=config, cache_dir=offline)
    with pytest.raises(ConfigurationError, match=r"at revision v2 .*HF_HUB_OFFLINE"):
        load_pretrained_block(SHARDED, 0, config=config, cache_dir=offline, revision="v2")


def test_client_checkpoint_reads_offline(hub, offline):
    for repo in (SINGLE, SHARDED, BIN):
        tensors = CheckpointSource(repo, cache_dir=offline).read_named(["model.embed_tokens.weight", "lm_head.weight"])
        assert set(tensors) == {"model.embed_tokens.weight", "lm_head.weight"}, repo
    with pytest.raises(ConfigurationError, match="HF_HUB_OFFLINE"):
        CheckpointSource("corolla-test/absent", cache_dir=offline).read_named(["lm_head.weight"])


CLIENT_SCRIPT = """
import json, sys
from transformers import AutoTokenizer
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
out = {}
for arg in sys.argv[1:]:
    repo, peers = arg.split("=", 1)
    ids = AutoTokenizer.from_pretrained(repo)(sys.stdin.readline().strip() or "x", return_tensors="pt").input_ids
    config = ClientConfig(max_retries=3, min_backoff_s=0.2)
    with AutoDistributedModelForCausalLM.from_pretrained(
        repo, initial_peers=peers.split(), client_config=config
    ) as model:
        out[repo] = model.generate(ids, max_new_tokens=8, do_sample=False)[0].tolist()
print("RESULT " + json.dumps(out), flush=True)
"""


def test_servers_and_client_run_offline_from_the_hf_cache(hub, tmp_path):
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(hub.cache),
        "HF_HOME": str(tmp_path / "hf-home"),
        "COROLLA_CACHE": str(tmp_path / "client-cache"),
    }  # the client's corolla cache, empty
    swarm = Swarm(tmp_path)  # its servers use an empty corolla --cache_dir: blocks must come from the HF cache
    try:
        servers = {  # one small swarm per repo, started side by side
            repo: swarm.start_server(repo, "--new_swarm", "--num_blocks", "4", "--throughput", "1", env=env, wait=False)
            for repo in (SINGLE, SHARDED)
        }
        for server in servers.values():
            server.wait_ready(150)
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                CLIENT_SCRIPT,
                *(f"{repo}={' '.join(s.initial_peers)}" for repo, s in servers.items()),
            ],
            input=PROMPT + "\n" + PROMPT + "\n",
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=150,
        )
    finally:
        swarm.close()
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    generated = json.loads(lines[-1][len("RESULT ") :])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for repo in (SINGLE, SHARDED):
        local = AutoModelForCausalLM.from_pretrained(hub.dirs[repo], dtype=torch.float32).eval()
        ids = AutoTokenizer.from_pretrained(hub.dirs[repo])(PROMPT, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = local.generate(ids, max_new_tokens=8, do_sample=False)[0].tolist()
        assert generated[repo] == expected, repo
    assert not any((tmp_path / "cache").rglob("*.safetensors")), "blocks were copied into corolla's cache"
