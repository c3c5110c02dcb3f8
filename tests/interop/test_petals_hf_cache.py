"""A stock Petals 2.2 client loading a hub name from the local Hugging Face cache, offline, through a corolla server
that serves the same hub name offline from the same cache (`HF_HUB_OFFLINE=1`, `HF_HUB_CACHE`): the same results as
local transformers. Skipped without the Petals venv (`make interop-setup`)."""

from __future__ import annotations

import test_petals_interop as interop
from test_petals_interop import model_dir, petals_py, reference  # noqa: F401  (fixtures)

from helpers.hf_cache import populate_hf_cache
from helpers.swarm import swarm  # noqa: F401  (fixture)

REPO = "corolla-test/tiny-llama"


def test_petals_client_loads_the_hub_name_offline_through_corolla(request, tmp_path, monkeypatch):
    manager, petals_python, model_path, expected = (
        request.getfixturevalue(name) for name in ("swarm", "petals_py", "model_dir", "reference")
    )
    cache = tmp_path / "hf" / "hub"
    populate_hf_cache(model_path, cache, REPO)
    offline = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",  # transformers 4.x in the Petals venv
        "HF_HUB_CACHE": str(cache),
        "HUGGINGFACE_HUB_CACHE": str(cache),  # older huggingface_hub's name for it
        "HF_HOME": str(tmp_path / "hf-home"),
    }
    for name, value in offline.items():  # the Petals client subprocess inherits this process's environment
        monkeypatch.setenv(name, value)
    server = manager.start_server(
        REPO,
        "--new_swarm",
        "--dht_prefix",
        interop.DHT_PREFIX,
        "--block_indices",
        f"0:{interop.NUM_LAYERS}",
        env=offline,
    )
    runs = {interop.DHT_PREFIX: interop.ALL_CASES}
    results = interop.run_petals_client(petals_python, REPO, server.initial_peers, tmp_path / "out.pt", runs)
    interop.check_results(results[interop.DHT_PREFIX], expected, interop.ALL_CASES)
    interop.assert_clean_logs([server])
