"""The lying test server (`tests.helpers.hostile_server`) lies on every path a reply takes, or the tests that run
clients against it prove nothing: a server process whose front runs in its own loop (a CPU step's output is a tensor:
the reply is a message, `step_reply`) and one with handler processes (`--num_handlers 2`: a step's output comes back
from the device process as its bytes, `TensorBytes`, and leaves as they are, `plain_step_reply`, as a GPU's launched
step does in a server's own loop); each answers a step, a forward and a backward honestly, then with finite garbage
of the same shape, which must differ.

The GPU's launched step (`TensorBytes` in the front of the server's own loop) takes the handler processes' path
here: `plain_step_reply`, from `SessionSteps._answer`, where the helper hands a lying step on as a tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hivemind.compression.serialization import deserialize_torch_tensor
from tests.helpers.engine_reference import blocks_forward
from tests.helpers.hostile_server import start_hostile_server
from tests.helpers.swarm import ClientThread, InferenceStream, Swarm, make_request, packed_request
from tests.helpers.tiny_models import make_tiny_model

from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from corolla.protocol.uids import make_chain

pytestmark = pytest.mark.timeout(300)

PREFIX = "liar"
UID = make_chain(PREFIX, 0, 2)
HIDDEN = 64  # the tiny Llama's
# how each server process answers (its extra flags)
FRONTS = {"own_loop": (), "handler_processes": ("--num_handlers", "2")}


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
