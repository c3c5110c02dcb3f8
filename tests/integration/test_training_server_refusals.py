"""A backward is an attack surface too: `rpc_backward` (unary and stream) refuses NaN/Inf gradients, NaN prompts,
prompts longer than the inputs, gradients that overflow the block dtype and more tokens than the server's limit, each
with an error naming the problem; afterwards the server still answers a correct backward with local autograd's
gradients (inputs and deep prompts)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hivemind.compression.serialization import deserialize_torch_tensor
from hivemind.p2p import P2PHandlerError
from transformers import AutoModelForCausalLM

from helpers.swarm import ClientThread, packed_request, served_with_client
from helpers.tiny_models import capture_hf_layer, hf_layers, make_tiny_model

HIDDEN, NUM_BLOCKS, MAX_BATCH_TOKENS = 64, 2, 64

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"), num_layers=NUM_BLOCKS)


@pytest.fixture(scope="module")
def served(model_path, tmp_path_factory: pytest.TempPathFactory):
    with served_with_client(
        model_path, tmp_path_factory.mktemp("cache"), block_indices=(0, NUM_BLOCKS),
        max_batch_size_tokens=MAX_BATCH_TOKENS, request_timeout_s=10.0,
    ) as pair:  # fmt: skip
        yield pair


def chain(server: Any) -> str:
    return " ".join(f"{server.settings.dht_prefix}.{i}" for i in range(NUM_BLOCKS))


def with_nan(t: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[3] = value
    return t


def backward(client: ClientThread, request) -> list[torch.Tensor]:
    response = client.run(lambda stub: stub.rpc_backward(request, timeout=15))
    return [deserialize_torch_tensor(t) for t in response.tensors]


def backward_stream(client: ClientThread, request) -> list[torch.Tensor]:
    async def go(stub: Any) -> list:
        async def messages():
            yield request

        return [t async for r in await stub.rpc_backward_stream(messages()) for t in r.tensors]

    return [deserialize_torch_tensor(t) for t in client.run(go)]


def x(batch: int = 1, length: int = 4) -> torch.Tensor:
    return torch.randn(batch, length, HIDDEN)


def prompts(length: int = 2) -> torch.Tensor:
    return 0.1 * torch.randn(NUM_BLOCKS, 1, length, HIDDEN)


CASES: list[tuple[str, Callable[[], tuple], str]] = [
    ("nan_grads", lambda: (x(), with_nan(x())), "grad_outputs contains NaN"),
    ("inf_grads", lambda: (x(), with_nan(x(), float("inf"))), "grad_outputs contains NaN"),
    ("nan_inputs", lambda: (with_nan(x()), x()), "NaN"),
    ("nan_prompts", lambda: (x(), x(), with_nan(prompts())), "prompts contain NaN"),
    ("prompts_longer_than_inputs", lambda: (x(length=2), x(length=2), prompts(length=3)), "prompts"),
    ("prompts_wrong_blocks", lambda: (x(), x(), 0.1 * torch.randn(NUM_BLOCKS + 1, 1, 2, HIDDEN)), "prompts"),
    ("grads_overflow_block_dtype", lambda: (x(), x().double() * 1e300), "grad_outputs"),
    ("too_many_tokens", lambda: (x(2, MAX_BATCH_TOKENS), x(2, MAX_BATCH_TOKENS)), f"{MAX_BATCH_TOKENS} tokens"),
]


@pytest.mark.parametrize("send", [backward, backward_stream], ids=["unary", "stream"])
@pytest.mark.parametrize("make_args,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_backward_is_refused(served, send, make_args, expected):
    server, client = served
    with pytest.raises((P2PHandlerError, asyncio.TimeoutError, TimeoutError)) as info:
        send(client, packed_request(chain(server), *make_args()))
    assert expected in str(info.value), f"error message lacks {expected!r}: {info.value}"


def test_server_still_answers_backward_with_local_gradients(served, model_path):
    """After every refusal: a correct backward with deep prompts equals local autograd over transformers' layers."""
    server, client = served
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 200, 33]])
    _, _, kwargs = capture_hf_layer(model, 0, ids)  # masks and rotary embeddings for 5 positions
    torch.manual_seed(0)
    inputs, grad_outputs, deep = x(length=5), x(length=5), prompts(2)
    grad_inputs, grad_prompts = backward(client, packed_request(chain(server), inputs, grad_outputs, deep))

    hidden = inputs.clone().requires_grad_(True)
    local_prompts = deep.clone().requires_grad_(True)
    out = hidden
    for i, layer in enumerate(hf_layers(model)):
        out = torch.cat([out[:, :2] + local_prompts[i], out[:, 2:]], dim=1)
        out = layer(out, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
    out.backward(grad_outputs)
    torch.testing.assert_close(grad_inputs, hidden.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grad_prompts, local_prompts.grad, atol=1e-5, rtol=1e-4)
