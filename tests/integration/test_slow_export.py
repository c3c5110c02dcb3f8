"""A draining server that holds its KV export, through real processes (decision 0168): the session's server (blocks
0:4, a `tests.helpers.hostile_server` in `slow_export` mode: it drains as any server does, then holds the export's
header 200 s while it answers pings) drains mid-generation with 120 s announced; an honest replica joined just before.
The export has a step's deadline (its header a decode step's; its parts the bytes the header announces at the
slow-link rate plus that); past it and the late budget the hand-off fails and the span's history is replayed on the
replica; the greedy output is local `transformers`'. On the old client the export had no deadline of its own: the
hand-off waited the notice's 120 s (+ `connect_timeout_s`) before the replay."""

from __future__ import annotations

import signal

import pytest
import torch
from tests.helpers.hostile_server import start_hostile_server
from tests.helpers.swarm import bootstrapped
from tests.helpers.tiny_models import hf_greedy, make_tiny_model

from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.client.session import stalls

pytestmark = pytest.mark.timeout(300)

PROMPT = torch.tensor([[1, 8, 27, 64, 125, 3, 9, 81, 11, 2, 40, 17]])
NEW_TOKENS = 8
LORIS_DELAY_S = 200.0  # past the drain's 120 s: the old client waited the drain out
HONEST = ("--block_indices", "0:4", "--throughput", "1.0", "--drain_timeout_s", "120")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"), seed=7)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory):
    with bootstrapped(tmp_path_factory.mktemp("swarm")) as swarm:
        yield swarm


def test_a_draining_server_holding_its_export_is_left_for_a_replay_on_the_replica(
    swarm, model_path, tmp_path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(stalls, "LATE_BUDGET_S", 2.0)  # (8 s by default: the same rule, a shorter test)
    mode_file = tmp_path / "mode"
    mode_file.write_text(f"slow_export 0 {LORIS_DELAY_S}")
    serving = start_hostile_server(swarm, model_path, "honest", *HONEST, mode_file=mode_file)
    joined: dict[str, str] = {}

    class JoinThenDrain:
        """At the 3rd generated token: an honest replica joins, then the serving server drains."""

        def __init__(self) -> None:
            self.count = 0

        def put(self, value) -> None:
            self.count += 1
            if self.count != 4:  # (the first put is the prompt)
                return
            replica = swarm.start_server(model_path, *HONEST, wait=False)
            replica.wait_ready(150)
            joined.update(replica=replica.peer_id)
            serving.signal(signal.SIGTERM)

        def end(self) -> None:
            pass

    config = ClientConfig(
        update_period_s=60.0, min_backoff_s=0.2, max_backoff_s=1.0, liveness_check_period_s=1.0, max_wait_s=30.0,
        request_timeout_s=150.0, local_transport=False, max_pinged=0,
    )  # fmt: skip
    with AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm.initial_peers, client_config=config
    ) as model:
        model.manager.wait_ready()
        with model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS) as session:
            output = model.generate(
                PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, session=session, streamer=JoinThenDrain()
            )
            (record,) = session.handoffs.records
            route = [span.peer_id for span, _ in session.route]
        banned = model.manager.bans.banned_peers()
    assert record.from_peer == serving.peer_id and record.to_peer is None, record
    assert "ServerTooSlow" in str(record.error) and record.seconds < 60.0, record  # before: 125 s, then the replay
    assert route == [joined["replica"]] and not banned
    assert output.tolist() == hf_greedy(model_path, PROMPT, NEW_TOKENS).tolist()
