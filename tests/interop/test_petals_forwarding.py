"""Server-to-server forwarding (client.forwarding) with stock Petals 2.2 servers: corolla's client names
`next_servers` through a chain of stock Petals servers, and through a mixed chain corolla -> Petals -> corolla;
greedy tokens equal local transformers. A stock server runs the steps a corolla server pushes to it (it logs each
at debug level), but pushes nothing useful itself: it forwards every step with its session's *first* request's
metadata, whose `next_servers` our client leaves empty, so through it the chain falls back to the client's copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.swarm import Swarm
from helpers.tiny_models import make_tiny_model, torch_threads
from interop.test_petals_interop import (
    DHT_PREFIX,
    DRIVER,
    INPUT_IDS,
    NUM_LAYERS,
    PetalsServer,
    petals_python,
)

NEW_TOKENS = 8
PUSH_RECEIVED = "session received push"  # stock Petals' debug line for a pushed step it runs
LATE_PUSH = "arrived late"  # stock Petals' warning for a pushed step it had already run (e.g. a stale copy)
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def petals_py() -> Path:
    return petals_python()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("forwarding-model"), num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    with torch_threads(1):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        input_ids = torch.tensor([INPUT_IDS])
        with torch.no_grad():
            return model.generate(
                input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(input_ids)
            ).tolist()


@pytest.fixture
def swarm(tmp_path: Path, petals_py: Path):
    manager = Swarm(tmp_path)
    try:
        manager.start_bootstrap(timeout_s=180.0)
        yield manager
    finally:
        manager.close()


def start_petals_server(swarm: Swarm, petals_py: Path, model_dir: Path, blocks: str) -> PetalsServer:
    """A stock Petals server logging at debug level (its pushes show there)."""
    args = [str(petals_py), str(DRIVER), "server", "--model", str(model_dir), "--dht_prefix", DHT_PREFIX,
            "--block_indices", blocks, "--cache_dir", str(swarm.workdir / "petals-cache"),
            "--initial_peers", *swarm.initial_peers]  # fmt: skip
    env = {"PYTHONUNBUFFERED": "1", "HIVEMIND_LOGLEVEL": "DEBUG"}
    process = PetalsServer(args, name=f"petals-server{len(swarm.processes)}", env=env)
    swarm.processes.append(process)
    return process.wait_ready(180.0)


def start_corolla_server(swarm: Swarm, model_dir: Path, blocks: str) -> None:
    swarm.start_server(model_dir, "--dht_prefix", DHT_PREFIX, "--block_indices", blocks, timeout_s=240.0)


def generate_with_forwarding(model_dir: Path, initial_peers: list[str]) -> tuple[list[list[int]], int, list]:
    """(greedy tokens, replies flagged as answers to pushed steps, the route) from corolla's client."""
    from corolla.client import AutoDistributedModelForCausalLM, ClientConfig

    input_ids = torch.tensor([INPUT_IDS])  # [1, T]
    config = ClientConfig(max_retries=3, local_transport=False, server_forwarding=True)
    with (
        torch_threads(1),
        AutoDistributedModelForCausalLM.from_pretrained(
            model_dir, initial_peers=initial_peers, dht_prefix=DHT_PREFIX, client_config=config
        ) as model,
        torch.no_grad(),
        model.inference_session(max_length=input_ids.shape[1] + NEW_TOKENS) as session,
    ):
        generated = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, session=session)
        route = [(span.start, span.end) for span, _ in session.route]
        return generated.tolist(), session.num_pushed_steps, route


def test_forwarding_through_stock_petals_servers(swarm, petals_py, model_dir, expected):
    servers = [start_petals_server(swarm, petals_py, model_dir, blocks) for blocks in ("0:2", "2:4")]
    tokens, _, route = generate_with_forwarding(model_dir, swarm.initial_peers)
    assert tokens == expected
    assert route == [(0, 2), (2, 4)]
    for server in servers:  # no stale copies: our client never names next_servers in a session's first request
        assert PUSH_RECEIVED not in server.output and LATE_PUSH not in server.output


def test_forwarding_through_a_mixed_chain(swarm, petals_py, model_dir, expected):
    """corolla 0:1 -> Petals 1:3 -> corolla 3:4: a corolla server pushes into a stock one and a stock one into a
    corolla one."""
    start_corolla_server(swarm, model_dir, "0:1")
    petals = start_petals_server(swarm, petals_py, model_dir, "1:3")
    start_corolla_server(swarm, model_dir, "3:4")
    tokens, num_pushed, route = generate_with_forwarding(model_dir, swarm.initial_peers)
    assert tokens == expected
    assert route == [(0, 1), (1, 3), (3, 4)]
    assert petals.output.count(PUSH_RECEIVED) >= NEW_TOKENS - 2, petals.output[-3000:]
    assert num_pushed == 0  # the stock server forwards nothing after its first request: the client relays 1:3 -> 3:4
