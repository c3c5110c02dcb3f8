"""Training through a 2-server loopback swarm, the Qwen3/Qwen3-MoE/Phi-3/DeepSeek-V3/Gemma 2/Gemma 3/gpt-oss
families: the same check as `test_training_families_a` (loss and gradients of every client-side parameter and
prompt equal local `transformers` fp32, relative 1e-4)."""

from __future__ import annotations

import pytest

import helpers.tiny_models_fam_a as fam_a
import helpers.tiny_models_fam_b as fam_b
from helpers.training import check_family_gradients, split_swarm

pytestmark = pytest.mark.timeout(900)

FAMILIES = fam_a.FAM_A_FAMILIES + fam_b.FAM_B_FAMILIES


@pytest.fixture(scope="module")
def swarm_and_paths(tmp_path_factory: pytest.TempPathFactory):
    with split_swarm(tmp_path_factory, FAMILIES) as swarm_and_paths:
        yield swarm_and_paths


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_and_client_gradients_equal_local_transformers(swarm_and_paths, family):
    swarm, paths = swarm_and_paths
    check_family_gradients(swarm, paths[family], split=family == FAMILIES[0])
