"""A server (in-process, tiny Llama, blocks 0:4) called through a plain hivemind stub as a stock Petals client would:
forward, backward and multi-step inference equal the local blocks; `cache_tokens_available` accounting per session
(close, error, timeout, disconnect); `next_servers` push and `step_id` de-duplication."""

from __future__ import annotations

import asyncio
import gc
import uuid
import weakref

import pytest
import torch
from hivemind.compression.serialization import deserialize_torch_tensor
from hivemind.p2p import P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.protocol.auth import UPSTREAM_PEER_KEY
from corolla.protocol.forwarding import NEXT_STEP_KEY
from corolla.server.core.limits import PeerLimits
from helpers.engine_reference import blocks_forward
from helpers.swarm import ClientThread, InferenceStream, chain, packed_request, start_inprocess_server, wait_until
from helpers.tiny_models import HIDDEN_SIZE as HIDDEN

NUM_BLOCKS = 4
MAX_LENGTH_LIMIT = 64
MAX_BATCH_TOKENS = 256
CACHE_TOKENS_PER_BLOCK = 160
STEP_TIMEOUT_S = 1.5

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory: pytest.TempPathFactory):
    server = start_inprocess_server(
        model_path,
        tmp_path_factory.mktemp("cache"),
        block_indices=(0, NUM_BLOCKS),
        inference_max_length_tokens=MAX_LENGTH_LIMIT,
        max_batch_size_tokens=MAX_BATCH_TOKENS,
        attn_cache_tokens=CACHE_TOKENS_PER_BLOCK,
        step_timeout_s=STEP_TIMEOUT_S,
        session_timeout_s=30.0,
        request_timeout_s=20.0,
        max_alloc_timeout_s=1.0,
        metrics_port=0,
        peer_limits=PeerLimits(max_kv_fraction_per_peer=1.0),  # one test client fills the cache on purpose
    )
    yield server
    server.shutdown()


def initial_cache_tokens() -> int:
    return NUM_BLOCKS * CACHE_TOKENS_PER_BLOCK


def test_rpc_info_schemas_and_cache_tokens(server, client):
    info = client.info()
    assert set(info) == {"version", "dht_client_mode", "cache_tokens_available", "serving_path"}
    assert info["serving_path"] == "fused"  # llama: the engine's fused span (its CPU ops here)
    assert info["dht_client_mode"] is False
    assert info["cache_tokens_available"] == initial_cache_tokens()
    info = client.info(f"{server.settings.dht_prefix}.2")
    args, kwargs = info["forward_schema"]
    assert kwargs == {} and len(args) == 1 and args[0].dtype == torch.float32 and args[0].size[-1] == HIDDEN
    assert info["outputs_schema"][0].size[-1] == HIDDEN
    assert info["keyword_names"] == ()
    hidden_descr, prompts_descr, hypo_descr = info["inference_schema"][0]
    assert hypo_descr.dtype == torch.int64 and prompts_descr.dtype == torch.float32


def test_forward_backward_equal_local_blocks(server, client, blocks):
    torch.manual_seed(1)
    hidden = torch.randn(2, 7, HIDDEN)
    uid = chain(server, 1, 4)
    response = client.run(lambda stub: stub.rpc_forward(packed_request(uid, hidden, torch.empty(0)), timeout=20))
    output = deserialize_torch_tensor(response.tensors[0])
    torch.testing.assert_close(output, blocks_forward(blocks[1:4], hidden), atol=1e-4, rtol=0)

    # lossy response on request (output_compression), restored to the block dtype by the codec
    lossy = packed_request(uid, hidden, torch.empty(0), output_compression=(runtime_pb2.CompressionType.FLOAT16,))
    response = client.run(lambda stub: stub.rpc_forward(lossy, timeout=20))
    assert response.tensors[0].compression == runtime_pb2.CompressionType.FLOAT16
    torch.testing.assert_close(deserialize_torch_tensor(response.tensors[0]), output, atol=1e-2, rtol=1e-2)

    grad_outputs = torch.randn(2, 7, HIDDEN)
    response = client.run(
        lambda stub: stub.rpc_backward(packed_request(uid, hidden, grad_outputs, torch.empty(0)), timeout=20)
    )
    grad_inputs = deserialize_torch_tensor(response.tensors[0])
    leaf = hidden.clone().requires_grad_(True)
    out = leaf
    for block in blocks[1:4]:
        out = block(out)
    out.backward(grad_outputs)
    torch.testing.assert_close(grad_inputs, leaf.grad, atol=1e-4, rtol=0)


def test_deep_prompts_forward_and_backward(server, client, blocks):
    torch.manual_seed(4)
    hidden, prompts, grad_outputs = torch.randn(2, 5, HIDDEN), torch.randn(3, 1, 2, HIDDEN), torch.randn(2, 5, HIDDEN)
    uid = chain(server, 1, 4)
    leaf_hidden, leaf_prompts = hidden.clone().requires_grad_(True), prompts.clone().requires_grad_(True)
    out = leaf_hidden
    for i, block in enumerate(blocks[1:4]):
        out = block(torch.cat([out[:, :2] + leaf_prompts[i], out[:, 2:]], dim=1))
    out.backward(grad_outputs)

    response = client.run(lambda stub: stub.rpc_forward(packed_request(uid, hidden, prompts), timeout=20))
    torch.testing.assert_close(deserialize_torch_tensor(response.tensors[0]), out.detach(), atol=1e-4, rtol=0)
    response = client.run(
        lambda stub: stub.rpc_backward(packed_request(uid, hidden, grad_outputs, prompts), timeout=20)
    )
    grad_inputs, grad_prompts = (deserialize_torch_tensor(t) for t in response.tensors)
    torch.testing.assert_close(grad_inputs, leaf_hidden.grad, atol=1e-4, rtol=0)
    torch.testing.assert_close(grad_prompts, leaf_prompts.grad, atol=1e-4, rtol=0)


def test_forward_stream_for_large_tensors(server, client, blocks):
    hidden = torch.randn(1, 250, HIDDEN)  # small enough for max_batch_size, sent in 16 KiB-ish parts anyway

    async def go(stub):
        from hivemind.compression.serialization import serialize_torch_tensor
        from hivemind.proto import runtime_pb2
        from hivemind.utils.serializer import MSGPackSerializer

        from corolla.protocol.codecs import split_for_streaming
        from corolla.protocol.packing import pack_args_kwargs

        tensors, structure = pack_args_kwargs(hidden, torch.empty(0))
        metadata = MSGPackSerializer.dumps({"args_structure": structure})
        parts = [p for t in tensors for p in split_for_streaming(serialize_torch_tensor(t), 16384)]

        async def requests():
            for part in parts:
                yield runtime_pb2.ExpertRequest(uid=chain(server, 0, 2), tensors=[part], metadata=metadata)

        from corolla.protocol.codecs import combine_parts

        responses = [r async for r in await stub.rpc_forward_stream(requests())]
        return [deserialize_torch_tensor(t) for t in combine_parts([t for r in responses for t in r.tensors])]

    (output,) = client.run(go)
    torch.testing.assert_close(output, blocks_forward(blocks[0:2], hidden), atol=1e-4, rtol=0)


def test_multi_step_inference_equals_local(server, client, blocks):
    torch.manual_seed(2)
    tokens = torch.randn(1, 9, HIDDEN)
    expected = blocks_forward(blocks[0:4], tokens)
    uid = chain(server, 0, 4)
    session_id = str(uuid.uuid4())
    stream = InferenceStream(client).open()
    outputs = []
    position = 0
    for piece in (tokens[:, :4], tokens[:, 4:4], tokens[:, 4:5], tokens[:, 5:6], tokens[:, 6:9]):  # incl. 0 tokens
        metadata = {"session_id": session_id, "step_id": str(uuid.uuid4()), "start_from_position": position}
        if position == 0 and not outputs:
            metadata["max_length"] = 20
        response = stream.step(
            packed_request(uid, piece, torch.empty(0), torch.empty(0, dtype=torch.int64), **metadata)
        )
        output = deserialize_torch_tensor(response.tensors[0])
        assert output.shape == piece.shape
        outputs.append(output)
        position += piece.shape[1]
    assert client.info()["cache_tokens_available"] == initial_cache_tokens() - 4 * _page_tokens(server, 20)
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, atol=1e-3, rtol=0)

    # rollback: overwrite from position 5 with different tokens -> equals the local run on the new sequence
    new_tail = torch.randn(1, 3, HIDDEN)
    response = stream.step(
        packed_request(uid, new_tail, torch.empty(0), torch.empty(0, dtype=torch.int64), start_from_position=5)
    )
    expected_new = blocks_forward(blocks[0:4], torch.cat([tokens[:, :5], new_tail], dim=1))[:, 5:]
    torch.testing.assert_close(deserialize_torch_tensor(response.tensors[0]), expected_new, atol=1e-3, rtol=0)
    stream.close()
    assert wait_until(lambda: client.info()["cache_tokens_available"] == initial_cache_tokens(), 5)


def _page_tokens(server, max_length: int) -> int:
    """Tokens a session of `max_length` reserves per block: whole pages of the server's pool."""
    pool = server.service.executor.engine.pool
    return pool.pages_for(max_length) * pool.page_size_tokens


def test_cache_tokens_drop_per_session_and_return(server, client):
    base = client.info()["cache_tokens_available"]
    assert base == initial_cache_tokens()
    first = InferenceStream(client).open()
    first.step(packed_request(chain(server, 0, 3), torch.randn(1, 2, HIDDEN), max_length=50))
    held = _page_tokens(server, 50) * 3  # 4 pages of 16 in each of its 3 blocks only
    assert client.info()["cache_tokens_available"] == base - held
    second = InferenceStream(client).open()
    second.step(packed_request(chain(server, 2, 3), torch.randn(1, 1, HIDDEN), max_length=20))
    assert client.info()["cache_tokens_available"] == base - held - _page_tokens(server, 20)
    second.close()
    assert wait_until(lambda: client.info()["cache_tokens_available"] == base - held, 5)
    first.close()
    assert wait_until(lambda: client.info()["cache_tokens_available"] == base, 5)

    # an error inside a session frees its cache
    broken = InferenceStream(client).open()
    broken.step(packed_request(chain(server, 0, 2), torch.randn(1, 2, HIDDEN), max_length=10))
    assert client.info()["cache_tokens_available"] == base - 2 * _page_tokens(server, 10)
    with pytest.raises(P2PHandlerError, match="Maximum length exceeded"):
        broken.step(packed_request(chain(server, 0, 2), torch.randn(1, 9, HIDDEN)))
    assert wait_until(lambda: client.info()["cache_tokens_available"] == base, 5)

    # a session whose client goes silent ends after step_timeout and frees its cache
    silent = InferenceStream(client).open()
    silent.step(packed_request(chain(server, 1, 4), torch.randn(1, 1, HIDDEN), max_length=30))
    assert client.info()["cache_tokens_available"] == base - 3 * _page_tokens(server, 30)
    assert wait_until(lambda: client.info()["cache_tokens_available"] == base, STEP_TIMEOUT_S + 5)

    # max_length=0 (a probe): only zero-token steps fit, nothing is reserved
    probe = InferenceStream(client).open()
    empty = probe.step(packed_request(chain(server, 0, 4), torch.randn(1, 0, HIDDEN), max_length=0))
    assert deserialize_torch_tensor(empty.tensors[0]).shape == (1, 0, HIDDEN)
    assert client.info()["cache_tokens_available"] == base
    with pytest.raises(P2PHandlerError, match="Maximum length exceeded"):
        probe.step(packed_request(chain(server, 0, 4), torch.randn(1, 1, HIDDEN)))

    # a client that disconnects mid-session frees its cache too
    dropped = InferenceStream(client).open()
    dropped.step(packed_request(chain(server, 0, 4), torch.randn(1, 1, HIDDEN), max_length=10))
    assert client.info()["cache_tokens_available"] == base - 4 * _page_tokens(server, 10)
    dropped.abort()
    assert wait_until(lambda: client.info()["cache_tokens_available"] == base, 5)


def test_push_to_next_session_and_step_dedup(server, client, blocks):
    """Blocks 0:2 push their output to a session on blocks 2:4 (same server), driven as corolla's client drives it:
    the first step goes to both spans directly (naming no next_servers), each request announces the next step's id,
    and the session on 2:4 names its upstream. The pushed step is processed once even when the client also sends
    it directly (step_id de-duplication)."""
    torch.manual_seed(3)
    prefill, hidden, follow = torch.randn(1, 3, HIDDEN), torch.randn(1, 1, HIDDEN), torch.randn(1, 1, HIDDEN)
    downstream_id, upstream_id = str(uuid.uuid4()), str(uuid.uuid4())
    step_ids = [str(uuid.uuid4()) for _ in range(3)]
    upstream, downstream = InferenceStream(client).open(), InferenceStream(client).open()
    first_up = upstream.step(
        packed_request(
            chain(server, 0, 2), prefill, max_length=10, session_id=upstream_id, step_id=step_ids[0],
            **{NEXT_STEP_KEY: step_ids[1]},
        )
    )  # fmt: skip
    mid0 = deserialize_torch_tensor(first_up.tensors[0])
    first_down = downstream.step(
        packed_request(
            chain(server, 2, 4), mid0, max_length=10, session_id=downstream_id, step_id=step_ids[0],
            **{UPSTREAM_PEER_KEY: server.peer_id, NEXT_STEP_KEY: step_ids[1]},  # pushes only from this upstream
        )
    )  # fmt: skip
    assert deserialize_torch_tensor(first_down.tensors[0]).shape == (1, 3, HIDDEN)
    next_servers = [[server.peer_id, downstream_id, 2, 4]]
    response = upstream.step(
        packed_request(
            chain(server, 0, 2), hidden, session_id=upstream_id, step_id=step_ids[1], start_from_position=3,
            next_servers=next_servers, **{NEXT_STEP_KEY: step_ids[2]},
        )
    )  # fmt: skip
    mid = deserialize_torch_tensor(response.tensors[0])
    whole = torch.cat([prefill, hidden], dim=1)
    torch.testing.assert_close(mid, blocks_forward(blocks[0:2], whole)[:, 3:], atol=1e-4, rtol=0)

    async def next_response(_stub):
        return await asyncio.wait_for(downstream.responses.__anext__(), 10)

    pushed = client.run(next_response)  # the downstream session answered the pushed step
    torch.testing.assert_close(
        deserialize_torch_tensor(pushed.tensors[0]), blocks_forward(blocks[0:4], whole)[:, 3:], atol=1e-3, rtol=0
    )
    # the same step sent directly is skipped (no response); the next one continues at position 4
    direct = packed_request(
        chain(server, 2, 4), mid, session_id=downstream_id, step_id=step_ids[1], start_from_position=3,
        **{NEXT_STEP_KEY: step_ids[2]},
    )  # fmt: skip

    async def send_only(_stub):
        await downstream.queue.put(direct)

    client.run(send_only)
    after = downstream.step(
        packed_request(
            chain(server, 2, 4), follow, session_id=downstream_id, step_id=step_ids[2], start_from_position=4
        )
    )
    expected = blocks_forward(blocks[2:4], torch.cat([mid0, mid, follow], dim=1))[:, 4:]
    torch.testing.assert_close(deserialize_torch_tensor(after.tensors[0]), expected, atol=1e-3, rtol=0)
    upstream.close()
    downstream.close()
    assert wait_until(lambda: client.info()["cache_tokens_available"] == initial_cache_tokens(), 5)


def test_push_between_servers(server, client, blocks, model_path, tmp_path):
    """A second server (blocks 2:4) receives the output of blocks 0:2 by `rpc_push` from the first server (the
    client's first step goes to both directly, as corolla's client does; the second step is pushed)."""
    second = start_inprocess_server(
        model_path, tmp_path, new_swarm=False, initial_peers=tuple(server.join_maddrs), block_indices=(2, 4)
    )
    try:
        prefill, hidden = torch.randn(1, 2, HIDDEN), torch.randn(1, 1, HIDDEN)
        downstream_id, upstream_id = str(uuid.uuid4()), str(uuid.uuid4())
        step_ids = [str(uuid.uuid4()) for _ in range(3)]
        upstream, downstream = InferenceStream(client).open(), InferenceStream(client, second.peer_id).open()
        first_up = upstream.step(
            packed_request(
                chain(server, 0, 2), prefill, max_length=8, session_id=upstream_id, step_id=step_ids[0],
                **{NEXT_STEP_KEY: step_ids[1]},
            )
        )  # fmt: skip
        downstream.step(
            packed_request(
                chain(server, 2, 4), deserialize_torch_tensor(first_up.tensors[0]), max_length=8,
                session_id=downstream_id, step_id=step_ids[0],
                **{UPSTREAM_PEER_KEY: server.peer_id, NEXT_STEP_KEY: step_ids[1]},
            )
        )  # fmt: skip
        upstream.step(
            packed_request(
                chain(server, 0, 2), hidden, session_id=upstream_id, step_id=step_ids[1], start_from_position=2,
                next_servers=[[second.peer_id, downstream_id, 2, 4]], **{NEXT_STEP_KEY: step_ids[2]},
            )
        )  # fmt: skip

        async def next_response(_stub):
            return await asyncio.wait_for(downstream.responses.__anext__(), 15)

        pushed = client.run(next_response)
        whole = torch.cat([prefill, hidden], dim=1)
        torch.testing.assert_close(
            deserialize_torch_tensor(pushed.tensors[0]), blocks_forward(blocks[0:4], whole)[:, 2:], atol=1e-3, rtol=0
        )
        upstream.close()
        downstream.close()
    finally:
        second.shutdown()


def test_a_serving_span_is_out_of_full_collections_and_collectable_once_released(model_path, tmp_path):
    """Once online, what the server made to start (libraries, the span, the swarm) is out of the collector's full
    passes (a full collection over it paused every session's step); when the span is released (here: a restart after
    a crash) it is the collector's again, so the old span's objects in reference cycles are freed, not kept frozen."""
    server = start_inprocess_server(model_path, tmp_path, block_indices=(0, 2), mean_balance_check_period_s=60.0)
    try:
        assert gc.get_freeze_count() > 10_000
        first_service = weakref.ref(server.service)
        released = weakref.ref(server.service.runtime)
        server.service.runtime.stop()  # simulate a crash of the device thread: the span is released and loaded again
        assert wait_until(lambda: server.service is not None and server.service is not first_service(), 20)
        assert wait_until(lambda: gc.get_freeze_count() > 10_000, 20)  # the new span online, frozen again
        gc.collect()
        assert released() is None
    finally:
        server.shutdown()


def test_crashed_serving_part_is_restarted(model_path, tmp_path, capsys):
    """If the runtime thread dies, the server notices within its health check and serves again. (Also: a new
    swarm prints the address to join and a parsable ready line.)"""
    server = start_inprocess_server(model_path, tmp_path, block_indices=(0, 2), mean_balance_check_period_s=60.0)
    client = ClientThread(server.join_maddrs, server.peer_id)
    try:
        printed = capsys.readouterr().out
        assert f"others join with --initial_peers {' '.join(server.join_maddrs)}" in printed
        assert f"corolla-server: ready peer_id={server.peer_id} blocks=0:2 initial_peers=" in printed
        assert all(m.startswith("/ip4/127.0.0.1/tcp/") and m.endswith(server.peer_id) for m in server.join_maddrs)
        first_service = server.service
        stream = InferenceStream(client).open()
        stream.step(packed_request(chain(server, 0, 2), torch.randn(1, 1, HIDDEN), max_length=16))
        assert first_service.executor.bytes_left < first_service.executor.max_size_bytes
        first_service.runtime.stop()  # simulate a crash of the device thread
        assert wait_until(lambda: server.service is not None and server.service is not first_service, 20)
        assert server.num_restarts == 1
        executor = first_service.executor
        assert executor.bytes_left == executor.max_size_bytes  # the open session was ended and its cache freed
        with pytest.raises((P2PHandlerError, StopAsyncIteration, asyncio.TimeoutError, TimeoutError, ConnectionError)):
            stream.step(packed_request(chain(server, 0, 2), torch.randn(1, 1, HIDDEN)), timeout_s=5)
        hidden = torch.randn(1, 2, HIDDEN)
        response = client.run(lambda stub: stub.rpc_forward(packed_request(chain(server, 0, 2), hidden), timeout=15))
        assert deserialize_torch_tensor(response.tensors[0]).shape == hidden.shape
    finally:
        client.close()
        server.shutdown()


def scrape(server) -> dict[tuple[str, tuple], float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.metrics_exporter.url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_move_with_requests(server, client):
    before = scrape(server)
    assert before[("corolla_blocks_served", ())] == NUM_BLOCKS
    assert before[("corolla_sessions_active", ())] == 0
    stream = InferenceStream(client).open()
    stream.step(packed_request(chain(server, 0, 4), torch.randn(1, 3, HIDDEN), max_length=10))
    during = scrape(server)
    assert during[("corolla_sessions_active", ())] == 1
    assert during[("corolla_kv_cache_used_bytes", ())] > 0
    stream.close()
    with pytest.raises(P2PHandlerError):
        client.run(lambda stub: stub.rpc_forward(packed_request(chain(server, 0, 1), torch.randn(1, 2, 3)), timeout=10))
    assert wait_until(lambda: scrape(server)[("corolla_sessions_active", ())] == 0, 5)
    after = scrape(server)
    tokens = ("corolla_tokens_processed_total", (("kind", "inference"),))
    assert after[tokens] - before[tokens] == 3
    assert after[("corolla_sessions_opened_total", ())] - before[("corolla_sessions_opened_total", ())] == 1
    rejected = ("corolla_requests_rejected_total", (("reason", "bad_request"),))
    assert after[rejected] - before[rejected] == 1
    assert after[("corolla_kv_cache_used_bytes", ())] == 0
    assert after[("corolla_step_seconds_count", ())] > before[("corolla_step_seconds_count", ())]


def test_hypo_ids_reorder_the_cache(server, client, blocks):
    torch.manual_seed(5)
    prefix, new = torch.randn(2, 3, HIDDEN), torch.randn(2, 1, HIDDEN)
    uid = chain(server, 0, 4)
    stream = InferenceStream(client).open()
    stream.step(packed_request(uid, prefix, torch.empty(0), torch.empty(0, dtype=torch.int64), max_length=8))
    response = stream.step(packed_request(uid, new, torch.empty(0), torch.tensor([1, 0])))
    expected = blocks_forward(blocks[0:4], torch.cat([prefix[[1, 0]], new], dim=1))[:, 3:]
    torch.testing.assert_close(deserialize_torch_tensor(response.tensors[0]), expected, atol=1e-3, rtol=0)
    stream.close()


def test_alloc_timeout_waits_for_memory_and_is_capped(server, client):
    """A session that doesn't fit waits up to its alloc_timeout (capped by the server's max_alloc_timeout=1 s)."""
    import threading
    import time

    big = InferenceStream(client).open()  # 2 x 64 tokens x 4 blocks = 512 of 640 token-blocks
    big.step(packed_request(chain(server, 0, 4), torch.randn(2, 1, HIDDEN), max_length=MAX_LENGTH_LIMIT))
    for _ in range(4):  # generating at full pace: it keeps its whole promise (a trickle would yield it: test_hoarding)
        big.step(packed_request(chain(server, 0, 4), torch.randn(2, 1, HIDDEN)))
    started = time.monotonic()
    with pytest.raises(P2PHandlerError, match="allocate"):  # asks for 100 s, gets the 1 s cap
        InferenceStream(client).open().step(
            packed_request(
                chain(server, 0, 4), torch.randn(1, 1, HIDDEN), max_length=MAX_LENGTH_LIMIT, alloc_timeout=100.0
            )
        )
    assert 0.8 <= time.monotonic() - started < 10

    waiting = InferenceStream(client).open()
    result: dict = {}

    def step() -> None:
        try:
            result["response"] = waiting.step(
                packed_request(
                    chain(server, 0, 4), torch.randn(1, 1, HIDDEN), max_length=MAX_LENGTH_LIMIT, alloc_timeout=1.0
                )
            )
        except Exception as e:  # reported below
            result["error"] = e

    thread = threading.Thread(target=step)
    thread.start()
    assert wait_until(lambda: server.service.executor.pages.num_waiting == 1, 5)
    big.close()  # frees memory while the second session waits
    thread.join(20)
    assert "response" in result, result.get("error")
    waiting.close()
    assert wait_until(lambda: client.info()["cache_tokens_available"] == initial_cache_tokens(), 5)


def test_eager_engine_through_the_handler(server, blocks):
    """The engine running the blocks eagerly over its pool (a family without fused kernels) behind the same
    handler: a multi-step session equals the local blocks."""
    import asyncio
    import threading

    from hivemind.p2p import P2P

    from corolla.engine import EngineConfig, SpanEngine
    from corolla.server.backend import SpanBackend
    from corolla.server.core.engine_executor import EngineExecutor
    from corolla.server.core.limits import SessionTimeouts
    from corolla.server.core.runtime import Runtime
    from corolla.server.front.block_functions import ServingLimits
    from corolla.server.front.front_settings import FrontSettings
    from corolla.server.server import SpanService

    backend = SpanBackend(dict(enumerate(blocks)), config=server.model_config, dtype=torch.float32, device="cpu")
    runtime = Runtime(max_batch_size_tokens=1024)
    engine = SpanEngine.from_blocks(blocks, EngineConfig(kv_pool_bytes=8 << 20, max_seq_len_tokens=128), fused=False)
    executor = EngineExecutor(backend, engine, runtime)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    p2p = on_loop(P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False, use_relay=False))
    limits = ServingLimits(
        dht_prefix="fast", start_block=0, end_block=NUM_BLOCKS, hidden_size=HIDDEN, dtype=torch.float32,
        inference_max_length_tokens=128, max_batch_size_tokens=1024,
    )  # fmt: skip
    service = SpanService(executor, FrontSettings(limits, SessionTimeouts(10, 60, 10)))
    on_loop(service.start(p2p))
    client = ClientThread([str(m) for m in on_loop(p2p.get_visible_maddrs())], p2p.peer_id.to_base58())
    try:
        base = client.info()["cache_tokens_available"]
        assert client.info()["serving_path"] == "eager"
        tokens = torch.randn(1, 6, HIDDEN)
        uid = "fast.0 fast.1 fast.2 fast.3"
        stream = InferenceStream(client).open()
        outputs = [deserialize_torch_tensor(stream.step(packed_request(uid, tokens[:, :3], max_length=32)).tensors[0])]
        assert client.info()["cache_tokens_available"] < base
        for i in range(3, 6):
            outputs.append(deserialize_torch_tensor(stream.step(packed_request(uid, tokens[:, i : i + 1])).tensors[0]))
        torch.testing.assert_close(torch.cat(outputs, dim=1), blocks_forward(blocks[0:4], tokens), atol=1e-3, rtol=0)
        stream.close()
        assert wait_until(lambda: client.info()["cache_tokens_available"] == base, 5)
    finally:
        client.close()
        on_loop(service.stop())
        on_loop(p2p.shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
