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
from tests.helpers.drained_generation import HONEST, NEW_TOKENS, PROMPT, generate_through_a_drain
from tests.helpers.hostile_server import start_hostile_server
from tests.helpers.swarm import bootstrapped
from tests.helpers.tiny_models import hf_greedy, make_tiny_model

from corolla.client.session import stalls

pytestmark = pytest.mark.timeout(300)

LORIS_DELAY_S = 200.0  # past the drain's 120 s: the old client waited the drain out


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

    def join_then_drain() -> None:
        """An honest replica joins, then the serving server drains."""
        replica = swarm.start_server(model_path, *HONEST, wait=False)
        replica.wait_ready(150)
        joined.update(replica=replica.peer_id)
        serving.signal(signal.SIGTERM)

    output, record, route, _, banned = generate_through_a_drain(swarm, model_path, join_then_drain)
    assert record.from_peer == serving.peer_id and record.to_peer is None, record
    assert "ServerTooSlow" in str(record.error) and record.seconds < 60.0, record  # before: 125 s, then the replay
    assert route == [joined["replica"]] and not banned
    assert output.tolist() == hf_greedy(model_path, PROMPT, NEW_TOKENS).tolist()
