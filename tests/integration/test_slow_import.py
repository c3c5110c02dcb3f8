"""A replacement server that takes a drained session's KV cache and then holds its answer to the import, through
real processes (decision 0162): the session's server (honest, blocks 0:4) drains mid-generation; the client's view
holds no other server, so the hand-off reads the records again and finds a `tests.helpers.hostile_server` in `slow`
mode (it takes the import, then holds its answer 60 s; it answers pings and announces itself the fastest, so it is
tried first) and an honest replica. The import's answer has a deadline (its bytes at the slow-link
rate plus a decode step's); past it and the late budget the loris is left (avoided, not banned) and the replica
imports the cache; the greedy output is local `transformers`'. On the old client the import's answer had no
deadline: the hand-off waited the loris's 60 s (within the drain's 120 s) and moved the session there."""

from __future__ import annotations

import signal

import pytest
from tests.helpers.drained_generation import HONEST, NEW_TOKENS, PROMPT, generate_through_a_drain
from tests.helpers.hostile_server import start_hostile_server
from tests.helpers.swarm import bootstrapped
from tests.helpers.tiny_models import hf_greedy, make_tiny_model

from corolla.client.session import stalls

pytestmark = pytest.mark.timeout(300)

LORIS_DELAY_S = 60.0


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"), seed=7)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory):
    with bootstrapped(tmp_path_factory.mktemp("swarm")) as swarm:
        yield swarm


def test_a_replacement_holding_the_imports_answer_is_left_for_the_replica(
    swarm, model_path, tmp_path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(stalls, "LATE_BUDGET_S", 2.0)  # (8 s by default: the same rule, a shorter test)
    mode_file = tmp_path / "mode"
    mode_file.write_text(f"slow_import 0 {LORIS_DELAY_S}")
    serving = swarm.start_server(model_path, *HONEST)
    joined: dict[str, str] = {}

    def join_then_drain() -> None:
        """A loris and an honest replica join, then the serving server drains."""
        loris = start_hostile_server(
            swarm, model_path, "honest", "--block_indices", "0:4", attract=True, mode_file=mode_file, wait=False
        )
        replica = swarm.start_server(model_path, *HONEST, wait=False)
        loris.wait_ready(150)
        replica.wait_ready(150)
        joined.update(loris=loris.peer_id, replica=replica.peer_id)
        serving.signal(signal.SIGTERM)

    output, record, route, avoided, banned = generate_through_a_drain(swarm, model_path, join_then_drain)
    assert record.from_peer == serving.peer_id and record.to_peer == joined["replica"], record
    assert route == [joined["replica"]]
    assert joined["loris"] in avoided and not banned
    assert output.tolist() == hf_greedy(model_path, PROMPT, NEW_TOKENS).tolist()
    assert serving.wait(30) == 0
