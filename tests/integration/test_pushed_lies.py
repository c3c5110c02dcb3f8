"""A server that lies only in its answers to pushed steps, which it flags as such (real processes, decision 0169):
the liar (`tests.helpers.hostile_server` mode `flag`) serves 2:4 after a 0:2 server that answers and pushes truly,
its replies sent once its pushes are in (mode `pushfirst`: the pushed copy is always the one the liar answers), both
announced the fastest; an honest 2:4 runs in this process. The flagged lie blames nobody (the upstream may have
pushed it so, decision 0154); before, each session of a client forwarded again, so each paid the liar's lie and a
replay. Now the client's process remembers the push (`routing.push_suspects`) and names neither server for pushes for
a while: one lie for the client, nobody banned, the reference text every time."""

from __future__ import annotations

import logging

import pytest
import torch
from tests.helpers.hostile_server import start_hostile_server
from tests.helpers.swarm import bootstrapped, inprocess_servers
from tests.helpers.tiny_models import hf_greedy, make_tiny_model

from corolla.client import AutoDistributedModelForCausalLM, ClientConfig

pytestmark = pytest.mark.timeout(300)

PROMPT = torch.tensor([[1, 8, 27, 64, 125]])
NEW_TOKENS = 6
SESSIONS = 4
RECORD_TTL_S = 60.0  # (as test_client_hostile_servers: no server stops, and a starved announcer must not lapse)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"), seed=5)


@pytest.fixture(scope="module")
def swarm(model_path, tmp_path_factory: pytest.TempPathFactory):
    with bootstrapped(tmp_path_factory.mktemp("swarm")) as swarm:
        flags = ("--expiration", str(RECORD_TTL_S))
        upstream, liar = (
            start_hostile_server(swarm, model_path, mode, "--block_indices", blocks, *flags, attract=True, wait=False)
            for mode, blocks in (("pushfirst", "0:2"), ("flag", "2:4"))
        )
        cache_dir = tmp_path_factory.mktemp("cache")
        with inprocess_servers(
            [(model_path, "2:4")], cache_dir, swarm.initial_peers, update_period_s=2.0, expiration_s=RECORD_TTL_S
        ):
            upstream.wait_ready(150)
            liar.wait_ready(150)
            swarm.upstream, swarm.liar = upstream, liar
            yield swarm


def test_a_liar_flagging_its_lies_as_push_answers_lies_once_to_a_client(swarm, model_path, caplog):
    expected = hf_greedy(model_path, PROMPT, NEW_TOKENS)
    config = ClientConfig(
        update_period_s=2.0, min_backoff_s=0.2, max_backoff_s=1.0, max_wait_s=20.0, max_pinged=0,
        local_transport=False,  # (a chain of same-host sockets is not forwarded)
    )  # fmt: skip
    caplog.set_level(logging.WARNING, logger="corolla.client.session.inference_session")
    with AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm.initial_peers, client_config=config
    ) as model:
        model.manager.wait_ready()
        for _ in range(SESSIONS):
            with model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS) as session:
                output = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, session=session)
            assert output.tolist() == expected.tolist()
        banned = model.manager.bans.banned_peers()
        failures = model.manager.push_suspects.failures(swarm.upstream.peer_id, swarm.liar.peer_id)
    # the client's replays of a span for a pushed answer that failed its checks (the liar's NaN)
    replays = sum("span_failed" in r.getMessage() and "PushedReplyRejected" in r.getMessage() for r in caplog.records)
    assert replays == 1, replays  # before: one a session (each forwarded again after the last one's lie)
    assert failures == 1 and not banned
