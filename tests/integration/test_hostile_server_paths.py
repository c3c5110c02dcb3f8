"""The lying test server (`tests.helpers.hostile_server`) lies on every path a reply takes, or the tests that run
clients against it prove nothing: a server process whose front runs in its own loop (a CPU step's output is a tensor:
the reply is a message, `step_reply`) and one with handler processes (`--num_handlers 2`: a step's output comes back
from the device process as its bytes, `TensorBytes`, and leaves as they are, `plain_step_reply`, as a GPU's launched
step does in a server's own loop); each answers a step, a forward and a backward honestly, then with finite garbage
of the same shape, which must differ. Its `slow` mode (a loris) answers a prefill and a one-token step late, on either
front, with the honest outputs.

The GPU's launched step (`TensorBytes` in the front of the server's own loop) takes the handler processes' path
here: `plain_step_reply`, from `SessionSteps._answer`, where the helper hands a lying step on as a tensor."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from hivemind.compression.serialization import deserialize_torch_tensor
from tests.helpers.engine_reference import blocks_forward
from tests.helpers.hostile_server import start_hostile_server
from tests.helpers.swarm import ClientThread, InferenceStream, Swarm, make_request, packed_request
from tests.helpers.tiny_models import HIDDEN_SIZE as HIDDEN
from tests.helpers.tiny_models import make_tiny_model

from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from corolla.protocol.uids import make_chain

pytestmark = pytest.mark.timeout(300)

PREFIX = "liar"
UID = make_chain(PREFIX, 0, 2)
# how each server process answers (its extra flags)
FRONTS = {"own_loop": (), "handler_processes": ("--num_handlers", "2")}
SLOW_S = 1.5  # `slow` mode's delay of a step in the test of that mode


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def mode_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "mode"
    path.write_text("honest")
    return path


@pytest.fixture(scope="module")
def clients(model_path, mode_file, tmp_path_factory: pytest.TempPathFactory):
    """A client of each liar (each a swarm of its own: nothing here looks servers up), by the name of its front."""
    swarm = Swarm(tmp_path_factory.mktemp("swarm"))
    clients: dict[str, ClientThread] = {}
    try:
        servers = {}
        for name, flags in FRONTS.items():
            servers[name] = start_hostile_server(
                swarm, model_path, "honest", "--new_swarm", "--block_indices", "0:2", "--dht_prefix", PREFIX, *flags,
                mode_file=mode_file, wait=False, name=name,
            )  # fmt: skip
        for name, server in servers.items():
            server.wait_ready(150)
            clients[name] = ClientThread(server.initial_peers, server.peer_id)
        yield clients
    finally:
        for client in clients.values():
            client.close()
        swarm.close()


@pytest.fixture(scope="module")
def blocks(model_path: Path) -> list[torch.nn.Module]:
    config = load_config(model_path)
    return [load_pretrained_block(model_path, i, config=config, torch_dtype=torch.float32).eval() for i in range(2)]


def _step(client: ClientThread, hidden: torch.Tensor) -> torch.Tensor:
    stream = InferenceStream(client).open()
    try:
        return deserialize_torch_tensor(stream.step(packed_request(UID, hidden, max_length=16)).tensors[0])
    finally:
        stream.close()


def _forward(client: ClientThread, hidden: torch.Tensor) -> torch.Tensor:
    response = client.run(lambda stub: stub.rpc_forward(make_request(UID, [hidden]), timeout=30))
    return deserialize_torch_tensor(response.tensors[0])


def _backward(client: ClientThread, hidden: torch.Tensor) -> torch.Tensor:
    grad_outputs = torch.ones_like(hidden)
    request = packed_request(UID, hidden, grad_outputs, torch.empty(0))
    return deserialize_torch_tensor(client.run(lambda stub: stub.rpc_backward(request, timeout=30)).tensors[0])


@pytest.mark.parametrize("front", FRONTS)
def test_a_liar_lies_on_every_reply_path(clients, mode_file, blocks, front):
    client = clients[front]
    hidden = torch.randn(1, 3, HIDDEN, generator=torch.Generator().manual_seed(7))
    calls = {"step": _step, "forward": _forward, "backward": _backward}
    mode_file.write_text("honest")
    honest = {name: call(client, hidden) for name, call in calls.items()}
    # an honest step of 3 tokens from position 0 is a forward (the server's kernels sum in another order: 3.5e-4 seen)
    reference = blocks_forward(blocks, hidden)
    torch.testing.assert_close(honest["step"], reference, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(honest["forward"], reference, atol=1e-3, rtol=1e-3)
    mode_file.write_text("garbage")
    lies = {name: call(client, hidden) for name, call in calls.items()}
    for name, lie in lies.items():
        assert lie.shape == honest[name].shape and torch.isfinite(lie).all(), name
        assert not torch.allclose(lie, honest[name], atol=1e-2), f"the {front} liar told the truth on {name}"


def _steps(client: ClientThread, hidden: torch.Tensor) -> tuple[list[torch.Tensor], list[float]]:
    """A prefill of all but the last token of `hidden` [1, T, H], then a one-token decode step, on one stream: each
    step's output and how long its reply took (s)."""
    stream = InferenceStream(client).open()
    outputs, took = [], []
    try:
        for position, chunk in ((0, hidden[:, :-1]), (hidden.shape[1] - 1, hidden[:, -1:])):
            started = time.monotonic()
            response = stream.step(packed_request(UID, chunk, max_length=16, start_from_position=position))
            took.append(time.monotonic() - started)
            outputs.append(deserialize_torch_tensor(response.tensors[0]))
    finally:
        stream.close()
    return outputs, took


@pytest.mark.parametrize("front", FRONTS)
def test_a_slow_server_answers_one_token_steps_late_but_answers(clients, mode_file, front):
    """`slow` holds every step of at least SLOW_MIN_TOKENS tokens (1 here: the decode steps too) `SLOW_S` late, and
    then answers it right (a loris under the deadline floor). A lone session's steps run inline in the own-loop front
    of a CPU server: the helper's late reply of those read the step's future after it was rebound to the pending
    one it returned, and such a server never answered (fails on that helper: own_loop times out)."""
    client = clients[front]
    hidden = torch.randn(1, 4, HIDDEN, generator=torch.Generator().manual_seed(9))
    mode_file.write_text("honest")
    honest, _ = _steps(client, hidden)
    mode_file.write_text(f"slow 0 {SLOW_S} 1")
    slow, took = _steps(client, hidden)
    mode_file.write_text("honest")
    assert min(took) >= SLOW_S, took  # (a lower bound: the helper's timer, whatever the machine's load)
    for truth, late in zip(honest, slow, strict=True):
        torch.testing.assert_close(late, truth)
