"""Training work on a GPU (`server.core.training_batch`): concurrent clients' forwards and backwards (host tensors, as
requests bring them) merge into fewer block calls, launched ahead on the device (the calls without deep prompts
replayed as CUDA graphs), and each client gets what the span computes for it alone (fp32); a backward after its own
forward reuses the forward's block inputs; a block call's graph, replayed with new inputs, gives what the eager call
gives. Skipped without CUDA."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tests.helpers import reference_backend as oracle

from corolla.server.backend import SpanBackend
from corolla.server.core import training_graphs
from corolla.server.core.runtime import Runtime
from corolla.server.core.training_batch import TrainingBatcher
from corolla.server.core.training_graphs import TrainingGraphs
from helpers.training import tiny_llama_span

pytestmark = pytest.mark.timeout(300)

H, N_BLOCKS = 64, 3
SPAN = tuple(range(N_BLOCKS))


@pytest.fixture(scope="module")
def backend() -> SpanBackend:
    return tiny_llama_span(N_BLOCKS, "cuda")


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    got, want = got.cpu(), want.cpu()
    return bool(((got - want).norm() / want.norm()).item() < 1e-4)


def test_clients_merge_on_gpu_and_get_their_own_results(backend: SpanBackend) -> None:
    torch.manual_seed(3)
    # (rows, length, deep prompt rows or None): the 16-token ones merge (a merged deep prompt: eager calls); the
    # 12-token one, with no deep prompt, runs alone as CUDA graphs
    clients = [(1, 16, None), (2, 16, 1), (3, 16, 3), (2, 12, None)]
    inputs = []
    for rows, length, prompt_rows in clients:
        prompts = None if prompt_rows is None else torch.randn(N_BLOCKS, prompt_rows, 4, H) * 0.1
        inputs.append((torch.randn(rows, length, H), torch.randn(rows, length, H), prompts))

    async def merged(runtime: Runtime, calls: list) -> list:
        """`calls` (one request each) with every first work queued before the device thread starts: by arrival, a
        request queued after the first call ran would trail it, unmerged (the backwards as much as the forwards)."""
        requests = asyncio.gather(*calls)
        for _ in range(100):
            if runtime.num_pending == len(calls):
                break
            await asyncio.sleep(0)
        with runtime:
            return await requests

    async def go() -> list:
        runtime = Runtime(max_batch_size_tokens=4096, device=backend.device)
        batcher = TrainingBatcher(backend, runtime)
        forwards = await merged(
            runtime, [batcher.forward(SPAN, h, p, "", owner=f"peer{i}") for i, (h, _, p) in enumerate(inputs)]
        )
        # the backwards on a second runtime, started once they are all queued; the forwards' kept block inputs and
        # captured graphs carried over
        runtime = Runtime(max_batch_size_tokens=4096, device=backend.device)
        backward_batcher = TrainingBatcher(backend, runtime, kept=batcher.kept)
        backward_batcher.graphs = batcher.graphs
        backwards = await merged(
            runtime,
            [backward_batcher.backward(SPAN, h, g, p, "", owner=f"peer{i}") for i, (h, g, p) in enumerate(inputs)],
        )
        assert batcher.kept.hits == len(clients)  # each backward reused its own forward's block inputs
        assert batcher.num_calls + backward_batcher.num_calls < 4 * N_BLOCKS * len(clients) / 2  # merged
        assert batcher.graphs is not None and batcher.graphs.num_replays == 2 * N_BLOCKS  # the 12-token client's
        return [forwards, backwards]

    forwards, backwards = asyncio.run(asyncio.wait_for(go(), 120))
    for (hidden, grad, prompts), output, (grad_input, grad_prompts) in zip(inputs, forwards, backwards, strict=True):
        assert _close(output, backend.forward(SPAN, hidden, prompts))
        want_input, want_prompts = oracle.backward(backend, SPAN, hidden, grad, prompts)
        assert _close(grad_input, want_input)
        if prompts is None:
            assert grad_prompts is None
        else:
            assert _close(grad_prompts, want_prompts)


def test_a_block_calls_graph_gives_what_the_eager_call_gives(backend: SpanBackend) -> None:
    torch.manual_seed(5)
    graphs = TrainingGraphs(backend)
    for _ in range(2):  # captured, then replayed with other inputs
        hidden, grad = torch.randn(2, 16, H, device="cuda"), torch.randn(2, 16, H, device="cuda")
        for index in SPAN:
            output = graphs.forward(index, hidden)
            assert output is not None and _close(output, backend.block_forward(index, hidden, None))
            grad_input = graphs.backward(index, hidden, grad)
            want, _ = backend.block_backward(index, hidden, grad, None)
            assert grad_input is not None and _close(grad_input, want)
    assert (graphs.num_captured, graphs.num_replays) == (2 * N_BLOCKS, 4 * N_BLOCKS)


def test_shapes_past_the_bound_allocate_nothing(backend: SpanBackend, monkeypatch) -> None:
    """A client that sends a new length every call (a new graph shape each) cannot make the server hold static inputs
    without end: past `MAX_HELD_BYTES` a shape runs eagerly, with no graph and no input buffers kept for it."""
    one_call_bytes = 2 * 8 * H * torch.empty(0, dtype=backend.dtype).element_size()  # [2, 8, H]: one input or output
    monkeypatch.setattr(training_graphs, "MAX_HELD_BYTES", 3 * one_call_bytes)
    graphs = TrainingGraphs(backend)
    for length in range(8, 40):  # 32 shapes, each its own static inputs: room for one
        hidden = torch.randn(2, length, H, device="cuda", dtype=backend.dtype)
        output = graphs.forward(0, hidden)
        if output is not None:
            assert _close(output, backend.block_forward(0, hidden, None))
    assert graphs.num_captured == 1 and graphs.held_bytes <= training_graphs.MAX_HELD_BYTES
    assert graphs.forward(0, torch.randn(2, 30, H, device="cuda")) is None  # eager from then on
    assert graphs.held_bytes <= training_graphs.MAX_HELD_BYTES
