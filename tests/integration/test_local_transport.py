"""The same-host inference stream (unix socket instead of two p2pd daemons): a corolla client on the server's machine
uses it by default and gets exactly what the p2p stream gives; hostile or broken connections are refused without
harming the server; a dropped connection frees its KV cache; a server without a socket, or a stale socket file,
means p2p; stopping the server removes the socket."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator

import pytest
import torch
from hivemind.compression.serialization import deserialize_torch_tensor
from hivemind.p2p import P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.protocol import local_stream as ls
from helpers.swarm import (
    ClientThread,
    InferenceStream,
    cache_used_bytes,
    chain,
    open_local_inference,
    packed_request,
    start_inprocess_server,
    wait_until,
)
from helpers.tiny_models import HIDDEN_SIZE as HIDDEN

NUM_BLOCKS = 4
PROMPT = torch.tensor([[1, 17, 42, 99, 7, 250, 31]])

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory: pytest.TempPathFactory):
    server = start_inprocess_server(
        model_path, tmp_path_factory.mktemp("cache"), block_indices=(0, NUM_BLOCKS), step_timeout_s=5.0
    )
    yield server
    server.shutdown()


def first_request(server, hidden: torch.Tensor, session_id: str, **metadata) -> runtime_pb2.ExpertRequest:
    meta = dict(session_id=session_id, step_id=str(uuid.uuid4()), max_length=32, start_from_position=0)
    meta.update(metadata)
    return packed_request(
        chain(server, 0, NUM_BLOCKS), hidden, torch.empty(0), torch.empty(0, dtype=torch.int64), **meta
    )


async def _hello(path, payload: bytes, kind: int = ls.HELLO):
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.writelines(ls.frame(kind, payload))
    reply = await asyncio.wait_for(ls.read_frame(reader, 1 << 20), 10)
    return reader, writer, reply


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_socket_is_private_and_found_by_peer_id(server):
    path = server.service.local_endpoint.path
    assert path == ls.socket_path(server.peer_id)
    assert ls.usable_sockets(server.peer_id) == [path]
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize(
    "payload, kind, expected",
    [
        (ls.LocalHello("rpc_inference", "QmSomeOtherPeer").to_bytes(), ls.HELLO, "another peer id"),
        (None, ls.HELLO, "not served here"),  # rpc_forward
        (b"{not json", ls.HELLO, "not JSON"),
        (b"", ls.MESSAGE, "expected a hello frame"),
        (b'{"version": 99, "rpc": "rpc_inference", "peer_id": "x"}', ls.HELLO, "version 99"),
    ],
)
def test_bad_hellos_are_refused_with_a_reason(server, payload, kind, expected):
    if payload is None:
        payload = ls.LocalHello("rpc_forward", server.peer_id).to_bytes()

    async def go():
        reader, writer, (reply_kind, reply) = await _hello(server.service.local_endpoint.path, payload, kind)
        eof = await asyncio.wait_for(reader.read(), 10)  # then the server hangs up
        writer.close()
        return reply_kind, reply.decode(), eof

    reply_kind, message, eof = _run(go())
    assert reply_kind == ls.ERROR and expected in message and eof == b""


def test_stream_over_socket_equals_p2p_and_frees_the_cache_when_dropped(server):
    torch.manual_seed(0)
    prefix, token = torch.randn(1, 5, HIDDEN), torch.randn(1, 1, HIDDEN)

    client = ClientThread(server.join_maddrs, server.peer_id)
    try:
        stream = InferenceStream(client).open()
        p2p_outputs = [
            deserialize_torch_tensor(stream.step(first_request(server, prefix, str(uuid.uuid4()))).tensors[0]),
            deserialize_torch_tensor(
                stream.step(
                    packed_request(chain(server, 0, NUM_BLOCKS), token, step_id="b", start_from_position=5)
                ).tensors[0]
            ),
        ]
        stream.close()
    finally:
        client.close()
    assert wait_until(lambda: cache_used_bytes(server) == 0, 5)

    async def go():
        queue: asyncio.Queue = asyncio.Queue()

        async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            while (item := await queue.get()) is not None:
                yield item

        responses = await open_local_inference(server.peer_id, requests(), timeout_s=5)
        assert responses is not None
        await queue.put(first_request(server, prefix, str(uuid.uuid4())))
        outputs = [deserialize_torch_tensor((await anext(responses)).tensors[0])]
        await queue.put(packed_request(chain(server, 0, NUM_BLOCKS), token, step_id="b", start_from_position=5))
        outputs.append(deserialize_torch_tensor((await anext(responses)).tensors[0]))
        used = cache_used_bytes(server)
        await responses.aclose()  # drop the connection mid-session, like a crashed client
        return outputs, used

    local_outputs, used_while_open = _run(go())
    assert used_while_open > 0
    for over_socket, over_p2p in zip(local_outputs, p2p_outputs, strict=True):
        torch.testing.assert_close(over_socket, over_p2p, atol=1e-6, rtol=0)
    assert wait_until(lambda: cache_used_bytes(server) == 0 and server.service.local_endpoint.num_open == 0, 5)


@pytest.mark.parametrize(
    "header",
    [
        bytes([77]) + (0).to_bytes(4, "big"),  # unknown frame kind
        bytes([ls.MESSAGE]) + (1 << 31).to_bytes(4, "big"),  # a frame far over the size limit
        bytes([ls.MESSAGE, 0, 0, 0, 3]) + b"\xff\xff\xff",  # not an ExpertRequest
    ],
)
def test_garbage_after_accept_ends_only_that_stream(server, header):
    async def go():
        path = server.service.local_endpoint.path
        reader, writer, (kind, _) = await _hello(path, ls.LocalHello("rpc_inference", server.peer_id).to_bytes())
        assert kind == ls.ACCEPT
        writer.write(header)
        reply = await asyncio.wait_for(ls.read_frame(reader, 1 << 20), 10)
        writer.close()
        return reply

    kind, message = _run(go())
    assert kind == ls.ERROR and message
    assert wait_until(lambda: server.service.local_endpoint.num_open == 0, 5)

    async def healthy():  # the server still serves a correct session
        async def requests():
            yield first_request(server, torch.randn(1, 3, HIDDEN), str(uuid.uuid4()))

        responses = await open_local_inference(server.peer_id, requests(), timeout_s=5)
        return [deserialize_torch_tensor(r.tensors[0]).shape async for r in responses]

    assert _run(healthy()) == [torch.Size([1, 3, HIDDEN])]
    assert wait_until(lambda: cache_used_bytes(server) == 0, 5)


def test_handler_errors_reach_the_client_like_p2p_errors(server):
    async def go():
        async def requests():
            yield first_request(server, torch.randn(1, 3, HIDDEN), str(uuid.uuid4()), max_length=None)

        responses = await open_local_inference(server.peer_id, requests(), timeout_s=5)
        return [r async for r in responses]

    with pytest.raises(P2PHandlerError, match="max_length"):
        _run(go())


@pytest.mark.parametrize("local_transport, busy_poll_ms", [(True, 0.0), (False, 0.0), (True, 200.0)])
def test_client_generates_the_same_tokens_over_socket_and_p2p(server, model_path, local, local_transport, busy_poll_ms):
    config = ClientConfig(local_transport=local_transport, max_retries=2, busy_poll_ms=busy_poll_ms)
    with AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=server.join_maddrs, client_config=config
    ) as model:
        with model.inference_session(max_length=32) as session:
            output = model.generate(PROMPT, max_new_tokens=12, do_sample=False, session=session)
            transports = {span.transport for span in session._spans}
            steps_here = session.num_steps_here
            polled = sum(span.local.polled_responses for span in session._spans if span.local is not None)
    with torch.no_grad():
        expected = local.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert output.tolist() == expected.tolist()
    assert transports == {"local" if local_transport else "p2p"}
    # every step after the prompt runs in this thread (no hop to the client loop): over the socket, and over p2p
    # since the chain is one span (no server pushes to another)
    assert steps_here == 11
    assert (polled > 0) == (busy_poll_ms > 0)  # with busy_poll_ms, responses are picked up by polling
    # the CPU server (default --busy_poll_ms 5) never polled for the next request: its cores are the span's (0177)
    assert server.service.runtime.after_inline is None and server.selector.polled_events == 0


def test_no_socket_or_a_stale_one_means_p2p_and_stop_removes_the_socket(server, model_path, local, tmp_path):
    quiet = start_inprocess_server(
        model_path,
        tmp_path / "cache",
        new_swarm=False,
        initial_peers=tuple(server.join_maddrs),
        block_indices=(0, NUM_BLOCKS),
        local_socket=False,
    )
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert quiet.service.local_endpoint is None and ls.usable_sockets(quiet.peer_id) == []
        stale.bind(str(ls.socket_path(quiet.peer_id)))  # bound, never listening: connections are refused
        assert ls.usable_sockets(quiet.peer_id) != []
        config = ClientConfig(allowed_servers=[quiet.peer_id], max_retries=2)
        with AutoDistributedModelForCausalLM.from_pretrained(
            model_path, initial_peers=server.join_maddrs, client_config=config
        ) as model:
            with model.inference_session(max_length=32) as session:
                output = model.generate(PROMPT, max_new_tokens=6, do_sample=False, session=session)
                assert {span.transport for span in session._spans} == {"p2p"}
                assert {span.span.peer_id for span in session._spans} == {quiet.peer_id}
        with torch.no_grad():
            assert output.tolist() == local.generate(PROMPT, max_new_tokens=6, do_sample=False).tolist()
    finally:
        stale.close()
        ls.socket_path(quiet.peer_id).unlink(missing_ok=True)
        quiet.shutdown()

    second = start_inprocess_server(
        model_path, tmp_path / "cache2", new_swarm=False, initial_peers=tuple(server.join_maddrs), block_indices=(0, 2)
    )
    path = second.service.local_endpoint.path
    assert path.exists()
    second.shutdown()
    assert not path.exists()
