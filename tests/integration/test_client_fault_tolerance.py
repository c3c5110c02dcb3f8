"""Fail-over through real server processes: a server SIGKILLed during a 64-token greedy generation is replaced by
another holding the same blocks (history replayed, output identical); when the only server of a span dies, a new
one started within the retry window takes over."""

from __future__ import annotations

import signal
import threading

import pytest
import torch
from tests.helpers.swarm import Swarm, bootstrapped, inprocess_servers
from tests.helpers.tiny_models import hf_greedy, make_tiny_model

from corolla.client import AutoDistributedModelForCausalLM, ClientConfig

pytestmark = pytest.mark.timeout(240)

PROMPT = torch.tensor([[1, 8, 27, 64, 125]])
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"), seed=3)


@pytest.fixture(scope="module")
def swarm(model_path, tmp_path_factory: pytest.TempPathFactory):
    """Blocks 0:2 by a server in this process (never killed); 2:4 by three server processes (SIGKILL needs a
    process), all started at once: one for each SIGKILL of the fail-over cases, and the last for the outage."""
    with bootstrapped(tmp_path_factory.mktemp("swarm")) as swarm:
        servers = [
            swarm.start_server(model_path, "--block_indices", "2:4", "--throughput", "1.0", wait=False)
            for _ in range(3)
        ]
        cache_dir = tmp_path_factory.mktemp("cache")
        with inprocess_servers([(model_path, "0:2")], cache_dir, swarm.initial_peers, update_period_s=2.0):
            for server in servers:
                server.wait_ready(120)
            yield swarm


@pytest.fixture(scope="module")
def expected(model_path):
    return hf_greedy(model_path, PROMPT, NEW_TOKENS)


class KillAt:
    """A streamer that, at generated token `at`, runs `action(session)` once."""

    def __init__(self, at: int, action):
        self.at, self.action, self.count, self.session = at, action, 0, None

    def put(self, value):
        self.count += 1
        if self.count == self.at + 1:  # the first put is the prompt
            self.action(self.session)

    def end(self):
        pass


def _server_of_block(swarm: Swarm, session, block: int):
    peers = [s.span.peer_id for s in session._spans if s.span.start <= block < s.span.end]
    assert len(peers) == 1
    return next(p for p in swarm.processes if getattr(p, "peer_id", None) == peers[0])


def _alive_servers_of_block(swarm: Swarm, block: int):
    return [
        p
        for p in swarm.processes
        if getattr(p, "start_block", -1) <= block < getattr(p, "end_block", -1) and p.proc.poll() is None
    ]


def _generate(swarm, model_path, streamer, config: ClientConfig) -> torch.Tensor:
    with AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm.initial_peers, client_config=config
    ) as model:
        with model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS) as session:
            streamer.session = session
            return model.generate(
                PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, session=session, streamer=streamer
            )


@pytest.mark.parametrize("local_transport", [True, False], ids=["socket", "p2p"])
def test_sigkill_mid_generation_fails_over_to_a_replica(swarm, model_path, expected, local_transport):
    while len(_alive_servers_of_block(swarm, 2)) < 2:  # a replica to fail over to (the fixture started enough)
        swarm.start_server(model_path, "--block_indices", "2:4", "--throughput", "1.0", wait=False).wait_ready(120)
    killed = []

    def kill(session):
        victim = _server_of_block(swarm, session, 2)
        victim.signal(signal.SIGKILL)  # the server process only: its DHT process and p2pd follow (orphan-proof)
        killed.append(victim)

    config = ClientConfig(
        max_retries=5,
        min_backoff_s=0.2,
        update_period_s=2.0,
        liveness_check_period_s=1.0,
        local_transport=local_transport,
    )
    streamer = KillAt(20, kill)
    output = _generate(swarm, model_path, streamer, config)
    assert killed and killed[0].wait(10) is not None
    # with sockets (the servers share this machine) the steps ran in this thread, before and after the fail-over
    assert (streamer.session.num_steps_here > 20) == local_transport
    assert output.shape[1] == PROMPT.shape[1] + NEW_TOKENS
    assert output.tolist() == expected.tolist()


def test_only_server_of_a_span_dies_and_a_new_one_takes_over(swarm, model_path, expected):
    started = []

    def kill_all_and_restart(session):
        for victim in _alive_servers_of_block(swarm, 2):
            victim.signal(signal.SIGKILL)
        # a new server joins while the client is retrying
        threading.Thread(
            target=lambda: started.append(
                swarm.start_server(model_path, "--block_indices", "2:4", "--throughput", "1.0", wait=False)
            ),
            daemon=True,
        ).start()

    config = ClientConfig(
        max_retries=40,
        min_backoff_s=0.5,
        max_backoff_s=2.0,
        update_period_s=1.0,
        ban_timeout_s=5.0,
        request_timeout_s=3.0,
    )
    output = _generate(swarm, model_path, KillAt(30, kill_all_and_restart), config)
    assert started and started[0].proc.poll() is None
    assert output.tolist() == expected.tolist()
