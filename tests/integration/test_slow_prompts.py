"""A server that answers pings but holds a session's prompt (a long step: more than `stalls.DECODE_MAX_TOKENS`
tokens) close to `request_timeout_s`, through real processes (decision 0149): a `tests.helpers.hostile_server` of
blocks 0:2 in `slow` mode (its prompts answered late, right, its decode steps on time), announcing itself the fastest
(a 1e6 tokens/s prefill rate: its prompts' deadline is the floor, `LONG_STEP_MIN_S`); an honest replica of 0:2 and a
server of 2:4 (in this process). The loris loses the prompt to the replica within the floor plus the late budget and
the greedy output is local `transformers`'; a prompt late by less than the floor keeps its server. On the old client
a long step had no deadline: the loris held the prompt until `request_timeout_s` (60 s here), then failed as a timeout
(banned), never moved."""

from __future__ import annotations

import time

import pytest
import torch
from tests.helpers.hostile_server import start_hostile_server
from tests.helpers.swarm import bootstrapped, inprocess_servers
from tests.helpers.tiny_models import hf_greedy, make_tiny_model

from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.client.session import stalls

pytestmark = pytest.mark.timeout(300)

PROMPT = torch.tensor([[1, 8, 27, 64, 125, 3, 9, 81, 11, 2, 40, 17]])  # 12 tokens: a long step
NEW_TOKENS = 6
LORIS_DELAY_S = 40.0  # each prompt answered this late, under the client's request_timeout_s
REQUEST_TIMEOUT_S = 60.0
RECORD_TTL_S = 60.0  # no server of this module stops: records outlive a starved announcer


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"), seed=7)


@pytest.fixture(scope="module")
def mode_file(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("hostile") / "mode"
    path.write_text("honest")
    return path


@pytest.fixture(scope="module")
def swarm(model_path, mode_file, tmp_path_factory: pytest.TempPathFactory):
    with bootstrapped(tmp_path_factory.mktemp("swarm")) as swarm:
        loris = start_hostile_server(
            swarm, model_path, "honest", "--block_indices", "0:2", "--expiration", str(RECORD_TTL_S),
            attract=True, mode_file=mode_file, wait=False,
        )  # fmt: skip
        spans = [(model_path, blocks) for blocks in ("0:2", "2:4")]
        with inprocess_servers(
            spans, tmp_path_factory.mktemp("cache"), swarm.initial_peers, update_period_s=2.0, expiration_s=RECORD_TTL_S
        ) as honest:
            loris.wait_ready(150)
            swarm.loris, swarm.honest = loris, honest
            yield swarm


@pytest.fixture(scope="module")
def expected(model_path):
    return hf_greedy(model_path, PROMPT, NEW_TOKENS)


@pytest.fixture
def short_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stalls, "LATE_BUDGET_S", 2.0)  # (8 s by default: the same rule, a shorter test)


def _generate(swarm, model_path, local_transport: bool):
    config = ClientConfig(
        update_period_s=2.0, min_backoff_s=0.2, max_backoff_s=1.0, liveness_check_period_s=1.0, max_wait_s=30.0,
        request_timeout_s=REQUEST_TIMEOUT_S, local_transport=local_transport,
        max_pinged=0,  # no RTTs (a ping lost on a busy machine would steer the route): the announced speeds decide
    )  # fmt: skip
    with AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm.initial_peers, client_config=config
    ) as model:
        manager = model.manager
        manager.wait_ready()
        peers = {swarm.loris.peer_id, *(server.peer_id for server in swarm.honest)}
        while {span.peer_id for span in manager.spans} != peers:  # all announced (the test's timeout bounds it)
            time.sleep(0.2)
            manager.update()
        first_hop = manager.make_sequence(mode="min_latency")[0].peer_id
        with model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS) as session:
            output = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, session=session)
            route = [span.peer_id for span, _ in session.route]
        return output, first_hop, route, list(session.stall_events), manager


@pytest.mark.parametrize("local_transport", [True, False], ids=["socket", "p2p"])
def test_a_loris_holding_the_prompt_loses_it_to_the_replica(
    swarm, model_path, mode_file, expected, short_budget, local_transport: bool
):
    mode_file.write_text(f"slow 0 {LORIS_DELAY_S} {stalls.DECODE_MAX_TOKENS + 1}")  # long steps only
    output, first_hop, route, events, manager = _generate(swarm, model_path, local_transport)
    loris = swarm.loris.peer_id
    assert first_hop == loris  # the route went through the loris first
    assert output.tolist() == expected.tolist()
    assert loris not in route
    moved = [e for e in events if e.action == "moved"]
    assert [(e.peer_id, e.num_tokens) for e in moved] == [(loris, PROMPT.shape[1])], events
    assert moved[0].step_deadline_s == pytest.approx(stalls.LONG_STEP_MIN_S, abs=0.1)  # its absurd rate: the floor
    assert moved[0].detected_after_s < LORIS_DELAY_S  # it did not wait for the late answer
    assert loris in manager.avoided_peers() and not manager.bans.banned_peers()


def test_a_prompt_late_within_its_deadline_keeps_its_server(swarm, model_path, mode_file, expected, short_budget):
    mode_file.write_text(f"slow 0 1.5 {stalls.DECODE_MAX_TOKENS + 1}")  # 1.5 s late, the floor is 4 s
    output, first_hop, route, events, manager = _generate(swarm, model_path, local_transport=False)
    loris = swarm.loris.peer_id
    assert first_hop == loris and route[0] == loris  # kept
    assert output.tolist() == expected.tolist()
    assert not [e for e in events if e.action == "moved"], events
    assert loris not in manager.avoided_peers() and not manager.bans.banned_peers()
