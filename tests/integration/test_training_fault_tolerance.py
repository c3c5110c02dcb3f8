"""Training survives servers that die or lie mid-step: a deep-prompt-tuned model trains through a loopback swarm
(blocks 0:4 on three servers, one of them the liar); the server that computed a step's forward is SIGKILLed, or starts
returning NaN gradients, before that step's backward, or returns finite garbage that only verification (other
servers' votes) catches. The client re-runs the span on a replica and the loss curve is identical (fp32, CPU) to an
undisturbed run's. Two honest replicas because a verifying client never trusts a lone server's outputs and outvotes
a liar 2:1; the kill test runs last (it leaves one replica)."""

from __future__ import annotations

import dataclasses
import random
import signal
from pathlib import Path

import pytest
import torch

from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.client.training import remote_sequential
from helpers.hostile_server import start_hostile_server
from helpers.swarm import Swarm
from helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(600)

IDS = torch.tensor([[1, 8, 27, 64, 125, 33, 7], [1, 99, 5, 12, 200, 41, 3]])
STEPS, EVENT_STEP = 4, 2
SPAN = "0:4"  # every server holds the whole model
CLIENT = ClientConfig(max_retries=5, min_backoff_s=0.2, update_period_s=2.0, request_timeout_s=30.0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"), seed=3)


@pytest.fixture(scope="module")
def swarm(model_path, tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("swarm")
    swarm = Swarm(workdir)
    mode_file = workdir / "hostile-mode"
    mode_file.write_text("honest")
    try:
        swarm.start_bootstrap()
        servers = [
            swarm.start_server(model_path, "--block_indices", SPAN, "--throughput", "1.0", wait=False) for _ in range(2)
        ]
        liar = start_hostile_server(
            swarm, model_path, "honest", "--block_indices", SPAN, "--throughput", "1.0", mode_file=mode_file,
            wait=False,
        )  # fmt: skip
        for server in [*servers, liar]:
            server.wait_ready(300)
        swarm.mode_file, swarm.liar, swarm.replicas = mode_file, liar, servers
        yield swarm
    finally:
        swarm.close()


class PreferPeer(random.Random):
    """Routing's random choice, except that `peer_id` is taken whenever it may be (it is not banned): a server that
    attracts the traffic, as a liar would."""

    def __init__(self, peer_id: str):
        super().__init__(0)
        self.peer_id = peer_id

    def choices(self, population, weights=None, *, cum_weights=None, k=1):
        preferred = [span for span in population if span.peer_id == self.peer_id]
        return preferred[:1] if preferred else super().choices(population, weights, cum_weights=cum_weights, k=k)


def train(
    swarm: Swarm, model_path: Path, monkeypatch, *, prefer: str, event=None, client: ClientConfig = CLIENT
) -> tuple[list[float], list[str]]:
    """STEPS Adam steps of the deep prompts; `event(peer)` runs after step EVENT_STEP's forward with the peer that
    computed it. Returns (the losses, the peer of each forward call, retries included)."""
    forwards: list[tuple[int, str]] = []
    original = remote_sequential.run_remote_forward

    async def recording_forward(manager, span, inputs, prompts):
        forwards.append((span.start, span.peer_id))
        return await original(manager, span, inputs, prompts)

    monkeypatch.setattr(remote_sequential, "run_remote_forward", recording_forward)
    with AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm.initial_peers, client_config=client, tuning_mode="deep_ptune", pre_seq_len=2
    ) as model:
        model.manager.rng = PreferPeer(prefer)
        generator = torch.Generator().manual_seed(0)
        tuning = model.prompt_tuning
        with torch.no_grad():
            for weight in (tuning.prompt_embeddings.weight, tuning.intermediate_prompt_embeddings.weight):
                weight.copy_(0.3 * torch.randn(weight.shape, generator=generator))
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
        losses = []
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = model(IDS, labels=IDS).loss
            if step == EVENT_STEP and event is not None:
                event(forwards[-1][1])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    monkeypatch.undo()
    return losses, [peer for _, peer in forwards]


@pytest.fixture(scope="module")
def reference_losses(swarm, model_path):
    with pytest.MonkeyPatch.context() as monkeypatch:
        losses, _ = train(swarm, model_path, monkeypatch, prefer=swarm.replicas[1].peer_id)
    assert losses[-1] < losses[0]  # it trains
    return losses


def test_server_lying_mid_step_is_replaced_with_identical_losses(swarm, model_path, reference_losses, monkeypatch):
    liar = swarm.liar.peer_id

    def start_lying(peer: str) -> None:
        assert peer == liar
        swarm.mode_file.write_text("nan")  # the backward of this step gets NaN gradients from it

    try:
        losses, peers = train(swarm, model_path, monkeypatch, prefer=liar, event=start_lying)
    finally:
        swarm.mode_file.write_text("honest")
    assert losses == reference_losses
    assert peers[: EVENT_STEP + 1] == [liar] * (EVENT_STEP + 1)  # it served every forward until it lied
    assert peers[EVENT_STEP + 1] != liar  # the step's span re-run forward on a replica, whose backward was used


@pytest.mark.parametrize("lie_in", ["forward", "backward"])
def test_finite_garbage_is_outvoted_with_identical_losses(swarm, model_path, reference_losses, monkeypatch, lie_in):
    """Finite garbage passes every check but a comparison: with `verify_fraction=1` the two honest replicas outvote
    the liar (in a forward, or in the backward of the step whose forward it computed honestly)."""
    liar = swarm.liar.peer_id
    verifying = dataclasses.replace(CLIENT, verify_fraction=1.0, ban_timeout_s=300.0)  # banned for the whole run

    def start_lying(peer: str) -> None:
        assert peer == liar
        swarm.mode_file.write_text("garbage")

    if lie_in == "forward":
        swarm.mode_file.write_text("garbage")
    try:
        losses, peers = train(
            swarm, model_path, monkeypatch, prefer=liar, client=verifying,
            event=start_lying if lie_in == "backward" else None,
        )  # fmt: skip
    finally:
        swarm.mode_file.write_text("honest")
    assert losses == reference_losses
    lied_at = 0 if lie_in == "forward" else EVENT_STEP
    assert peers[: lied_at + 1] == [liar] * (lied_at + 1) and liar not in peers[lied_at + 1 :]


def test_server_killed_mid_step_is_replaced_with_identical_losses(swarm, model_path, reference_losses, monkeypatch):
    victim = swarm.replicas[0]
    killed = []

    def kill(peer: str) -> None:
        assert peer == victim.peer_id
        victim.signal(signal.SIGKILL)
        assert victim.wait(10) is not None
        killed.append(peer)

    losses, peers = train(swarm, model_path, monkeypatch, prefer=victim.peer_id, event=kill)
    assert killed and losses == reference_losses
    assert peers[: EVENT_STEP + 1] == [victim.peer_id] * (EVENT_STEP + 1)
    assert victim.peer_id not in peers[EVENT_STEP + 1 :]  # the run went on without it
