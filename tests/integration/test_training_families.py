"""Training through a 2-server loopback swarm: a deep-prompt-tuned causal LM with every client-side weight trainable
gets the loss and gradients of local `transformers` fp32 (relative 1e-4) for its prefix, its deep prompts (sent per
block to the servers), embeddings, norms and head.

The suite runs one family per distinct client-side path (the servers' backward is the same code for every family, and
each family's block input gradients equal `transformers`' in tests/unit/test_models_*.py): Llama split over two
servers (RMSNorm), BLOOM (LayerNorm, an embeddings norm, ALiBi), Gemma 2 (scaled embeddings, (1 + w) norm, logit
soft-capping, windowed attention) and gpt-oss (its norm, attention sinks, MoE). `COROLLA_ALL_TRAINING_FAMILIES=1`
runs every served family (14)."""

from __future__ import annotations

import os

import pytest

import helpers.tiny_models_fam_a as fam_a
import helpers.tiny_models_fam_b as fam_b
from helpers.tiny_models import FAMILIES as BASE_FAMILIES
from helpers.training import check_family_gradients, split_swarm

pytestmark = pytest.mark.timeout(900)

SUITE_FAMILIES = ("llama", "bloom", "gemma2", "gpt_oss")
ALL_FAMILIES = BASE_FAMILIES + fam_a.FAM_A_FAMILIES + fam_b.FAM_B_FAMILIES
FAMILIES = ALL_FAMILIES if os.environ.get("COROLLA_ALL_TRAINING_FAMILIES") == "1" else SUITE_FAMILIES


@pytest.fixture(scope="module")
def swarm_and_paths(tmp_path_factory: pytest.TempPathFactory):
    with split_swarm(tmp_path_factory, FAMILIES) as swarm_and_paths:
        yield swarm_and_paths


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_and_client_gradients_equal_local_transformers(swarm_and_paths, family):
    swarm, paths = swarm_and_paths
    check_family_gradients(swarm, paths[family], split=family == FAMILIES[0])
