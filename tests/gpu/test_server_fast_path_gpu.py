"""A corolla server on a real GPU (bf16 fast path) answering inference streams: a lone session's decode steps run
inline on the server's loop thread, over the same-host socket and over p2p alike, and give the same outputs as the
device thread gives them when another session is open; all of them match the model's fp32 layers. Skipped
without CUDA."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch
from hivemind.compression.serialization import deserialize_torch_tensor
from transformers import LlamaConfig, LlamaForCausalLM

from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from corolla.server.core.executor import PATH_FUSED
from helpers.swarm import (
    ClientThread,
    InferenceStream,
    chain,
    open_local_inference,
    packed_request,
    start_inprocess_server,
)

pytestmark = pytest.mark.timeout(300)

HIDDEN, LAYERS, PREFIX, STEPS = 512, 3, 8, 6


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=HIDDEN,
        intermediate_size=1024,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    path = tmp_path_factory.mktemp("models") / "llama-512"
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory: pytest.TempPathFactory):
    server = start_inprocess_server(
        model_path,
        tmp_path_factory.mktemp("cache"),
        block_indices=(0, LAYERS),
        torch_dtype="bfloat16",
        quant_type="none",
        device="cuda",
        attn_cache_tokens=4096,
    )
    assert server.service.executor.path == PATH_FUSED, "fused kernels must serve this span"
    yield server
    server.shutdown()


def _requests(server, inputs: list[torch.Tensor]):
    uid = chain(server, 0, LAYERS)
    position, session_id = 0, str(uuid.uuid4())
    for i, hidden in enumerate(inputs):
        meta = dict(session_id=session_id, step_id=str(uuid.uuid4()), start_from_position=position)
        if i == 0:
            meta["max_length"] = 64
        yield packed_request(uid, hidden, torch.empty(0), torch.empty(0, dtype=torch.int64), **meta)
        position += hidden.shape[1]


def _inputs() -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(1, PREFIX, HIDDEN, dtype=torch.bfloat16)] + [
        torch.randn(1, 1, HIDDEN, dtype=torch.bfloat16) for _ in range(STEPS)
    ]


def _over_socket(server, inputs) -> list[torch.Tensor]:
    async def go():
        queue: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (item := await queue.get()) is not None:
                yield item

        responses = await open_local_inference(server.peer_id, requests(), timeout_s=10)
        assert responses is not None
        outputs = []
        for request in _requests(server, inputs):
            await queue.put(request)
            outputs.append(deserialize_torch_tensor((await anext(responses)).tensors[0]))
        await responses.aclose()
        return outputs

    return asyncio.run(asyncio.wait_for(go(), 120))


def _reference(model_path, inputs) -> torch.Tensor:
    """The span in fp32 through corolla's own blocks (equal to the transformers layers, tests/unit)."""
    config = load_config(model_path)
    hidden = torch.cat(inputs, dim=1).float().cuda()
    with torch.no_grad():
        for i in range(LAYERS):
            block = load_pretrained_block(model_path, i, config=config, torch_dtype=torch.float32).cuda().eval()
            hidden = block(hidden)
    return hidden.cpu()


def test_lone_session_steps_run_inline_and_match_the_threaded_path(server, model_path):
    inputs = _inputs()
    runtime = server.service.runtime
    inline_before = runtime.num_inline_batches
    alone_socket = _over_socket(server, inputs)
    assert runtime.num_inline_batches - inline_before >= STEPS  # decode steps ran on the loop thread
    assert server.selector.polled_events > 0  # and the loop polled for the next ones instead of sleeping

    client = ClientThread(server.join_maddrs, server.peer_id)
    try:
        stream = InferenceStream(client).open()
        alone_p2p = [deserialize_torch_tensor(stream.step(r).tensors[0]) for r in _requests(server, inputs)]
        stream.close()

        other = InferenceStream(client).open()  # a second open session: steps go through the device thread
        other.step(next(_requests(server, inputs[:1])))
        inline_before = runtime.num_inline_batches
        threaded = _over_socket(server, inputs)
        assert runtime.num_inline_batches == inline_before
        other.close()
    finally:
        client.close()

    reference = _reference(model_path, inputs)
    served = torch.cat(alone_socket, dim=1).float()
    for outputs in (alone_p2p, threaded):
        torch.testing.assert_close(torch.cat(outputs, dim=1).float(), served, atol=2e-2, rtol=2e-2)
    rel = float((served - reference).norm() / reference.norm())
    assert rel < 3e-2, f"served outputs differ from fp32 layers by {rel:.3e}"
