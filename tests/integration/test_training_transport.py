"""A training call's stream (`rpc_forward_stream` / `rpc_backward_stream`) goes over the server's unix socket where the
server runs on this machine, else over its direct port, and only then through p2pd: each transport gives the same
outputs and gradients (deep prompts too) as p2p and as local autograd, and a refusal comes back as the server's error
(the same `P2PHandlerError` as over p2p), not as a broken connection that a client would retry elsewhere."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hivemind.p2p import P2PHandlerError
from transformers import AutoModelForCausalLM

from corolla.client.calls.remote_forward_backward import run_remote_backward, run_remote_forward
from corolla.client.config import ClientConfig
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.protocol.records import RemoteSpanInfo, ServerInfo, ServerState
from corolla.protocol.uids import make_uid
from helpers.swarm import ClientThread, served_with_client
from helpers.tiny_models import capture_hf_layer, hf_layers, make_tiny_model

HIDDEN, NUM_BLOCKS = 64, 3
# (local_transport, direct_transport) of the client's config, by the transport the calls must take
CONFIGS = {"local": (True, True), "direct": (False, True), "p2p": (False, False)}

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"), num_layers=NUM_BLOCKS)


@pytest.fixture(scope="module")
def served(model_path, tmp_path_factory: pytest.TempPathFactory):
    with served_with_client(
        model_path, tmp_path_factory.mktemp("cache"), block_indices=(0, NUM_BLOCKS), direct_port=0
    ) as pair:
        yield pair


def _manager(server: Any, client: ClientThread, transport: str) -> tuple[RemoteSequenceManager, RemoteSpanInfo]:
    local, direct = CONFIGS[transport]
    config = ClientConfig(
        max_retries=0, liveness_check_period_s=0, local_transport=local, direct_transport=direct, request_timeout_s=30
    )
    uids = [make_uid(server.settings.dht_prefix, i) for i in range(NUM_BLOCKS)]
    manager = RemoteSequenceManager(config, uids, start_updates=False, p2p=client.p2p)
    info = ServerInfo(ServerState.ONLINE, 1.0, start_block=0, end_block=NUM_BLOCKS)
    return manager, RemoteSpanInfo(server.peer_id, 0, NUM_BLOCKS, info)


def _opened(server: Any) -> tuple[int, int]:
    service = server.service
    return service.local_endpoint.streams_opened, service.direct_endpoint.streams_opened


def _local_autograd(model_path, hidden: torch.Tensor, grad: torch.Tensor, prompts: torch.Tensor):
    """The span's outputs over transformers' layers, and the gradients of (outputs . grad) w.r.t. `hidden` and the
    deep prompts (added to each block's input at its first positions, as servers do)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    _, _, kwargs = capture_hf_layer(model, 0, torch.arange(1, hidden.shape[1] + 1)[None])  # masks, rotary embeddings
    hidden, prompts = hidden.clone().requires_grad_(True), prompts.clone().requires_grad_(True)
    x, length = hidden, prompts.shape[2]
    for i, layer in enumerate(hf_layers(model)):
        x = torch.cat([x[:, :length] + prompts[i], x[:, length:]], dim=1)
        x = layer(x, **kwargs)
        x = x[0] if isinstance(x, tuple) else x
    x.backward(grad)
    return x.detach(), hidden.grad, prompts.grad


def test_each_transport_gives_autograds_results_and_the_calls_take_it(served, model_path):
    server, client = served
    torch.manual_seed(0)
    hidden, grad = torch.randn(2, 6, HIDDEN), torch.randn(2, 6, HIDDEN)
    prompts = torch.randn(NUM_BLOCKS, 1, 2, HIDDEN) * 0.1
    want_output, want_grad, want_prompts = _local_autograd(model_path, hidden, grad, prompts)
    results = {}
    for transport in CONFIGS:
        manager, span = _manager(server, client, transport)
        before = _opened(server)

        async def go(manager=manager, span=span):
            output = await run_remote_forward(manager, span, hidden, prompts)
            grads = await run_remote_backward(manager, span, hidden, grad, prompts)
            return output, *grads

        results[transport] = client.call(go())
        local_opened, direct_opened = (after - was for after, was in zip(_opened(server), before, strict=True))
        assert (local_opened, direct_opened) == {"local": (2, 0), "direct": (0, 2), "p2p": (0, 0)}[transport]
    for transport, (output, grad_input, grad_prompts) in results.items():
        for got, want in ((output, want_output), (grad_input, want_grad), (grad_prompts, want_prompts)):
            assert ((got - want).norm() / want.norm()).item() < 1e-4, transport
        for got, same in zip((output, grad_input, grad_prompts), results["p2p"], strict=True):
            assert torch.equal(got, same), transport


@pytest.mark.parametrize("transport", ["local", "direct"])
def test_a_refusal_over_a_socket_is_the_servers_error(served, transport):
    server, client = served
    manager, span = _manager(server, client, transport)
    hidden, grad = torch.randn(1, 4, HIDDEN), torch.randn(1, 4, HIDDEN)
    grad[0, 1, 2] = float("nan")
    with pytest.raises(P2PHandlerError, match="NaN|finite"):
        client.call(run_remote_backward(manager, span, hidden, grad, torch.empty(0)))


@pytest.mark.parametrize("transport", ["p2p", "direct"])
def test_a_payload_over_the_unary_limit_streams_and_a_refusal_is_the_servers_error(served, model_path, transport):
    """Past 1 MiB a p2p call is a stream, read by the client's own p2pd stream reader (each message bounded at its
    header); the same results as local autograd, and a server's refusal comes back as its error."""
    server, client = served
    manager, span = _manager(server, client, transport)
    torch.manual_seed(1)
    hidden, grad = torch.randn(48, 100, HIDDEN), torch.randn(48, 100, HIDDEN)  # 1.2 MB of fp32 each
    prompts = torch.randn(NUM_BLOCKS, 1, 2, HIDDEN) * 0.1
    want_output, want_grad, want_prompts = _local_autograd(model_path, hidden, grad, prompts)

    async def go():
        output = await run_remote_forward(manager, span, hidden, prompts)
        return output, *await run_remote_backward(manager, span, hidden, grad, prompts)

    for got, want in zip(client.call(go()), (want_output, want_grad, want_prompts), strict=True):
        assert ((got - want).norm() / want.norm()).item() < 1e-4
    grad[0, 1, 2] = float("nan")
    with pytest.raises(P2PHandlerError, match="NaN|finite"):
        client.call(run_remote_backward(manager, span, hidden, grad, torch.empty(0)))
