"""`--num_handlers 2` through the real p2p path (in-process server on a tiny Llama, blocks 0:4, plain path on CPU):
sessions opened by several client peers land on both handler processes and give bitwise identical outputs there
(equal to the local blocks); a forward is served; a push crosses from the process that holds the upstream session
to the one that holds the downstream session; a killed handler process is detected and replaced, and sessions
keep working (no leaked KV cache), and so is one that stops reading its channel (no sender of the core waits for it; however few of its frames wait); each handler process serves its own same-host socket, and a replaced process
serves it again; both processes listen on the one direct port and accept tickets either issued."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
import uuid

import pytest
import torch
from hivemind.compression.serialization import deserialize_torch_tensor

from corolla.client.transport.local_transport import LocalInferenceStream
from corolla.protocol import local_stream as ls
from corolla.protocol.auth import UPSTREAM_PEER_KEY
from corolla.protocol.forwarding import NEXT_STEP_KEY
from corolla.server.core.limits import PeerLimits
from corolla.server.front.front_service import loop_selector
from helpers.engine_reference import blocks_forward
from helpers.swarm import (
    ClientThread,
    InferenceStream,
    chain,
    connected_clients,
    packed_request,
    start_inprocess_server,
    wait_until,
)
from helpers.tiny_models import HIDDEN_SIZE as HIDDEN

NUM_BLOCKS = 4

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory: pytest.TempPathFactory):
    server = start_inprocess_server(
        model_path,
        tmp_path_factory.mktemp("cache"),
        block_indices=(0, NUM_BLOCKS),
        num_handlers=2,
        direct_port=0,  # both processes listen on one port the device process picked (SO_REUSEPORT)
        inference_max_length_tokens=64,
        session_timeout_s=60.0,
        request_timeout_s=30.0,
        peer_limits=PeerLimits(max_kv_fraction_per_peer=1.0),
    )
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def clients(server):
    with connected_clients(server, 2) as clients:  # two peers, two p2pd daemons
        yield clients


def _opened_per_process(server) -> list[int]:
    return [channel.num_sessions_opened for channel in server.service.pool.channels]


def _two_steps(streams, server, prefill, token):
    outputs = []
    for stream in streams:
        first = stream.step(packed_request(chain(server, 0, 4), prefill, max_length=16))
        second = stream.step(packed_request(chain(server, 0, 4), token, start_from_position=prefill.shape[1]))
        outputs.append((deserialize_torch_tensor(first.tensors[0]), deserialize_torch_tensor(second.tensors[0])))
    return outputs


def test_sessions_spread_over_processes_with_identical_outputs(server, clients, blocks):
    torch.manual_seed(0)
    prefill, token = torch.randn(1, 3, HIDDEN), torch.randn(1, 1, HIDDEN)
    before = _opened_per_process(server)
    streams = [InferenceStream(clients[i % 2]).open() for i in range(6)]  # all open at once
    outputs = _two_steps(streams, server, prefill, token)
    for stream in streams:
        stream.close()
    opened = [after - b for after, b in zip(_opened_per_process(server), before, strict=True)]
    assert sum(opened) == 6 and min(opened) >= 1, f"sessions per handler process: {opened}"
    for first, second in outputs[1:]:  # the same bytes whichever process served the stream
        assert torch.equal(first, outputs[0][0]) and torch.equal(second, outputs[0][1])
    whole = blocks_forward(blocks[0:4], torch.cat([prefill, token], dim=1))
    torch.testing.assert_close(outputs[0][0], whole[:, :3], atol=1e-4, rtol=0)
    torch.testing.assert_close(outputs[0][1], whole[:, 3:], atol=1e-4, rtol=0)
    executor = server.service.executor
    assert wait_until(lambda: executor.bytes_left == executor.max_size_bytes, 10)  # every session's cache freed
    info = clients[0].info(chain(server, 0, 4))
    assert info["cache_tokens_available"] > 0 and info["serving_path"] == "fused"
    # the handler processes' session counts reach the server's one set of metrics
    assert wait_until(lambda: _metric(server, "corolla_sessions_opened_total") >= 6, 10)
    assert wait_until(lambda: _metric(server, "corolla_sessions_active") == 0, 10)
    # one thread reads both processes' channels (device_channel.ChannelIntake): the runtime thread has one GIL competitor there
    readers = [t.name for t in threading.enumerate() if t.name.startswith("corolla-channel-")]
    assert readers == ["corolla-channel-intake"], readers
    assert server.service.pool.intake.num_frames > 0


def test_petals_steps_give_the_outputs_of_the_general_path(server, clients):
    """Steps as a Petals client sends them (hidden states, dummy prompts and beam ids: a handler process takes them
    as bytes, the one decoder's bytes case) give the bytes that one-record steps (the general path) give; a NaN among them is refused
    as the general path refuses it."""
    torch.manual_seed(1)
    prefill, token = torch.randn(1, 3, HIDDEN), torch.randn(1, 1, HIDDEN)
    dummies = (torch.empty(0), torch.empty(0, dtype=torch.int64))
    streams = [InferenceStream(clients[i % 2]).open() for i in range(4)]
    general = _two_steps(streams[:2], server, prefill, token)
    petals = []
    for stream in streams[2:]:
        first = stream.step(packed_request(chain(server, 0, 4), prefill, *dummies, max_length=16))
        second = stream.step(packed_request(chain(server, 0, 4), token, *dummies, start_from_position=3))
        petals.append((deserialize_torch_tensor(first.tensors[0]), deserialize_torch_tensor(second.tensors[0])))
    for stream in streams:
        stream.close()
    for first, second in petals:
        assert torch.equal(first, general[0][0]) and torch.equal(second, general[0][1])
    poisoned = token.clone()
    poisoned[0, 0, 5] = float("nan")
    stream = InferenceStream(clients[0]).open()
    stream.step(packed_request(chain(server, 0, 4), prefill, *dummies, max_length=16))
    with pytest.raises(Exception, match="hidden_states contains NaN or infinite values"):
        stream.step(packed_request(chain(server, 0, 4), poisoned, *dummies, start_from_position=3))


def _metric(server, name: str) -> float:
    for line in server.metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} not exported")


def test_forward_is_served_by_a_handler_process(server, clients, blocks):
    from helpers.swarm import make_request

    hidden = torch.randn(2, 5, HIDDEN)

    async def go(stub):
        return await stub.rpc_forward(make_request(chain(server, 1, 3), [hidden]), timeout=30)

    for client in clients:
        response = client.run(go)
        torch.testing.assert_close(
            deserialize_torch_tensor(response.tensors[0]), blocks_forward(blocks[1:3], hidden), atol=1e-4, rtol=0
        )


def test_push_crosses_to_the_process_holding_the_session(server, clients, blocks):
    """Blocks 0:2 push to a session on blocks 2:4 of the same server whose stream another handler process holds:
    the push goes through the device process to that process, which answers it on the downstream stream."""
    client = clients[0]
    sinks = server.service.core.pushes.sinks  # session id -> its channel's `_push_out` (a partial of its bound method)
    for _attempt in range(4):  # p2pd deals streams round-robin: two sessions opened in a row land apart
        torch.manual_seed(3)
        prefill, hidden = torch.randn(1, 3, HIDDEN), torch.randn(1, 1, HIDDEN)
        upstream_id, downstream_id = str(uuid.uuid4()), str(uuid.uuid4())
        step_ids = [str(uuid.uuid4()) for _ in range(2)]
        upstream, downstream = InferenceStream(client).open(), InferenceStream(client).open()
        first_up = upstream.step(
            packed_request(
                chain(server, 0, 2), prefill, max_length=10, session_id=upstream_id, step_id=step_ids[0],
                **{NEXT_STEP_KEY: step_ids[1]},
            )
        )  # fmt: skip
        mid0 = deserialize_torch_tensor(first_up.tensors[0])
        downstream.step(
            packed_request(
                chain(server, 2, 4), mid0, max_length=10, session_id=downstream_id, step_id=step_ids[0],
                **{UPSTREAM_PEER_KEY: server.peer_id, NEXT_STEP_KEY: step_ids[1]},
            )
        )  # fmt: skip
        if sinks[upstream_id].func.__self__ is sinks[downstream_id].func.__self__:  # one handler process holds both
            upstream.close()
            downstream.close()
            continue
        upstream.step(
            packed_request(
                chain(server, 0, 2), hidden, session_id=upstream_id, step_id=step_ids[1], start_from_position=3,
                next_servers=[[server.peer_id, downstream_id, 2, 4]],
            )
        )  # fmt: skip

        async def next_response(_stub, stream=downstream):
            return await asyncio.wait_for(stream.responses.__anext__(), 15)

        pushed = client.run(next_response)
        whole = torch.cat([prefill, hidden], dim=1)
        torch.testing.assert_close(
            deserialize_torch_tensor(pushed.tensors[0]), blocks_forward(blocks[0:4], whole)[:, 3:], atol=1e-3, rtol=0
        )
        upstream.close()
        downstream.close()
        return
    pytest.fail("four upstream/downstream pairs all landed on one handler process")


async def _socket_sessions(server, n: int, prefill: torch.Tensor, token: torch.Tensor):
    """`n` sessions over the same-host sockets, opened all at once: (socket name, first output, second output)."""
    streams = [await LocalInferenceStream.open(server.peer_id, timeout_s=10) for _ in range(n)]
    results = []
    for stream in streams:
        assert stream is not None and stream.path is not None, "no same-host socket accepted"
        await stream.send(packed_request(chain(server, 0, 4), prefill, max_length=16))
        first = await asyncio.wait_for(stream.receive(), 30)
        await stream.send(packed_request(chain(server, 0, 4), token, start_from_position=prefill.shape[1]))
        second = await asyncio.wait_for(stream.receive(), 30)
        assert first is not None and second is not None
        outputs = (deserialize_torch_tensor(first.tensors[0]), deserialize_torch_tensor(second.tensors[0]))
        results.append((stream.path.name, *outputs))
    for stream in streams:
        await stream.send_end()
        stream.close()
    return results


def test_same_host_sockets_are_served_by_the_handler_processes(server, blocks):
    """Each handler process listens on its own same-host socket (the device process on none): sessions opened over
    them land on both processes (as p2p streams do) and give the local blocks' outputs."""
    names = sorted(path.name for path in ls.usable_sockets(server.peer_id))
    assert names == [f"{server.peer_id}.0.sock", f"{server.peer_id}.1.sock"]
    assert server.service.local_endpoint is None
    torch.manual_seed(2)
    prefill, token = torch.randn(1, 3, HIDDEN), torch.randn(1, 1, HIDDEN)
    before = _opened_per_process(server)
    results = asyncio.run(_socket_sessions(server, 12, prefill, token))
    assert {name for name, _, _ in results} == set(names), "12 sessions all chose one socket"
    opened = [after - b for after, b in zip(_opened_per_process(server), before, strict=True)]
    assert opened == [6, 6], f"sessions per handler process: {opened}"  # one process's sessions: in turn
    whole = blocks_forward(blocks[0:4], torch.cat([prefill, token], dim=1))
    for _, first, second in results:
        torch.testing.assert_close(first, whole[:, :3], atol=1e-4, rtol=0)
        torch.testing.assert_close(second, whole[:, 3:], atol=1e-4, rtol=0)
    executor = server.service.executor
    assert wait_until(lambda: executor.bytes_left == executor.max_size_bytes, 10)


def test_direct_streams_spread_over_the_processes_on_one_port(server, clients, blocks):
    """The ticket comes from whichever process p2pd deals the RPC to; connections to the one direct port are placed
    by load over both processes (the kernel's hash alone splits 16 connections evenly one time in five: a process
    that accepts one while the other serves fewer hands it over unread), and each gives the local blocks' outputs."""
    from hivemind.proto import runtime_pb2
    from hivemind.utils import MSGPackSerializer

    from corolla.client.transport.direct_transport import DirectInferenceStream
    from corolla.protocol import direct_stream as ds
    from corolla.protocol.rpc import handle_name

    async def ticket():
        call = clients[0].p2p.call_protobuf_handler(
            clients[0].peer_id, handle_name("rpc_direct_ticket"), runtime_pb2.ExpertUID(uid=""), runtime_pb2.ExpertInfo
        )
        return ds.DirectOffer.from_dict(MSGPackSerializer.loads((await asyncio.wait_for(call, 10)).serialized_info))

    offer = clients[0].call(ticket())
    torch.manual_seed(3)
    prefill, token = torch.randn(1, 3, HIDDEN), torch.randn(1, 1, HIDDEN)

    async def sessions(n: int):
        streams = [await DirectInferenceStream.open(offer, server.peer_id, timeout_s=10) for _ in range(n)]
        results = []
        for stream in streams:
            assert stream is not None, "the direct port refused the ticket"
            await stream.send(packed_request(chain(server, 0, 4), prefill, max_length=16))
            first = await asyncio.wait_for(stream.receive(), 30)
            await stream.send(packed_request(chain(server, 0, 4), token, start_from_position=3))
            second = await asyncio.wait_for(stream.receive(), 30)
            results.append((deserialize_torch_tensor(first.tensors[0]), deserialize_torch_tensor(second.tensors[0])))
        for stream in streams:
            await stream.send_end()
            stream.close()
        return results

    before = _opened_per_process(server)
    results = asyncio.run(sessions(16))
    opened = [after - b for after, b in zip(_opened_per_process(server), before, strict=True)]
    assert sorted(opened) == [8, 8], f"direct sessions per handler process: {opened}"
    whole = blocks_forward(blocks[0:4], torch.cat([prefill, token], dim=1))
    for first, second in results:
        torch.testing.assert_close(first, whole[:, :3], atol=1e-4, rtol=0)
        torch.testing.assert_close(second, whole[:, 3:], atol=1e-4, rtol=0)
    executor = server.service.executor
    assert wait_until(lambda: executor.bytes_left == executor.max_size_bytes, 10)


def test_killed_handler_process_is_replaced(server, clients):
    pool = server.service.pool
    victim = pool.processes[0]
    assert victim is not None and victim.pid is not None
    restarts = pool.num_restarts
    os.kill(victim.pid, signal.SIGKILL)
    assert wait_until(lambda: pool.num_restarts == restarts + 1, 60), "the dead handler process was not replaced"
    replacement = pool.processes[0]
    assert replacement is not None and replacement.pid != victim.pid
    assert wait_until(lambda: pool.channels[0] is not None and pool.channels[0].ready.is_set(), 60)
    assert server.service.healthy
    prefill, token = torch.randn(1, 2, HIDDEN), torch.randn(1, 1, HIDDEN)
    streams = [InferenceStream(clients[i % 2]).open() for i in range(4)]
    outputs = _two_steps(streams, server, prefill, token)  # no stream is sent to the dead process's handlers
    for stream in streams:
        stream.close()
    assert all(torch.equal(o[1], outputs[0][1]) for o in outputs)
    # the replacement listens on the dead process's socket again: sessions over both sockets work
    results = asyncio.run(_socket_sessions(server, 12, prefill, token))
    assert {name for name, _, _ in results} == {f"{server.peer_id}.0.sock", f"{server.peer_id}.1.sock"}
    assert all(torch.equal(second, outputs[0][1]) for _, _, second in results)
    executor = server.service.executor
    assert wait_until(lambda: executor.bytes_left == executor.max_size_bytes, 10)


def test_a_handler_process_that_stops_reading_blocks_no_sender_and_is_replaced_once(server, clients):
    """A handler process stopped for good (SIGSTOP) reads nothing more: the core's sends to it (20000 state frames
    from one thread, as the runtime thread's replies go) return at once, its channel is declared dead after the stall
    bound (2 s here, `device_channel.WRITE_STALL_S` in a server), the process is killed and replaced once (decision
    0258), and sessions keep working on both processes."""
    flooded = threading.Event()
    senders: list[threading.Thread] = []

    def flood(channel) -> None:  # 20000 state frames from one thread, as the runtime thread's replies go
        def send() -> None:
            for _ in range(20000):
                channel.send_state()
            flooded.set()

        senders.append(threading.Thread(target=send, daemon=True))
        senders[0].start()
        assert flooded.wait(10), "the sender is blocked on the process that stopped reading"

    try:
        _stopped_and_replaced_once(server, 1, flood, replaced_within_s=60)
    finally:
        for sender in senders:
            sender.join(10)  # (main: the process reads again and the sender goes on)
    prefill, token = torch.randn(1, 2, HIDDEN), torch.randn(1, 1, HIDDEN)
    results = asyncio.run(_socket_sessions(server, 12, prefill, token))
    assert {name for name, _, _ in results} == {f"{server.peer_id}.0.sock", f"{server.peer_id}.1.sock"}
    assert all(torch.equal(second, results[0][2]) for _, _, second in results)
    executor = server.service.executor
    assert wait_until(lambda: executor.bytes_left == executor.max_size_bytes, 10)


def test_a_stopped_handler_process_the_core_sent_little_is_replaced_too(server, clients):
    """A handler process stopped (SIGSTOP) with only a state frame of the core unread (its socket takes it: no backlog
    forms) is declared dead after the stall bound all the same (its ping unanswered, decision 0261), killed and
    replaced once (main: it never is: the stall clock ran only with a backlog, ~280 small frames away)."""
    _stopped_and_replaced_once(server, 0, lambda channel: channel.send_state(), replaced_within_s=40)


def _stopped_and_replaced_once(server, index: int, send, *, replaced_within_s: float) -> None:
    """Stops handler process `index` for good (SIGSTOP; its stall bound 2 s, from the watch's next tick), calls
    `send(its channel)`, and checks that the process is killed and replaced once: the channel closed, its sessions
    gone, the new process's channel ready, the server healthy (SIGCONT where it was not killed)."""
    pool = server.service.pool
    victim, channel = pool.processes[index], pool.channels[index]
    assert victim is not None and victim.pid is not None and channel is not None
    restarts = pool.num_restarts
    channel.io.stall_s = 2.0
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        send(channel)
        replaced = wait_until(lambda: pool.num_restarts == restarts + 1, replaced_within_s)
        assert replaced, "the stopped process was not replaced"
    finally:
        if victim.is_alive():
            os.kill(victim.pid, signal.SIGCONT)
    assert not victim.is_alive() and victim.exitcode == -signal.SIGKILL
    assert pool.processes[index] is not victim and channel.io.closed and channel.sessions == {}
    assert wait_until(lambda: pool.channels[index] is not None and pool.channels[index].ready.is_set(), 60)
    assert server.service.healthy and pool.num_restarts == restarts + 1  # replaced once


def test_direct_port_serves_without_placement_where_no_private_directory_can_be_made(
    model_path, blocks, tmp_path, monkeypatch
):
    """A server whose temporary directory cannot be made (a read-only /tmp, say) still starts with handler processes
    and a direct port: connections stay where the kernel puts them, and a session over the port gets the blocks'
    outputs."""
    from hivemind.proto import runtime_pb2
    from hivemind.utils import MSGPackSerializer

    from corolla.client.transport.direct_transport import DirectInferenceStream
    from corolla.protocol import direct_stream as ds
    from corolla.protocol.rpc import handle_name
    from corolla.server import span_service

    def unavailable(num_processes: int):
        raise PermissionError(f"no private directory for {num_processes} processes")

    monkeypatch.setattr(span_service, "BalanceDirectory", unavailable)
    server = start_inprocess_server(
        model_path, tmp_path, block_indices=(0, NUM_BLOCKS), num_handlers=2, direct_port=0,
        inference_max_length_tokens=64, peer_limits=PeerLimits(max_kv_fraction_per_peer=1.0),
    )  # fmt: skip
    client = ClientThread(server.join_maddrs, server.peer_id)
    try:
        assert server.service.pool is not None and server.service._balance is None

        async def ticket():
            call = client.p2p.call_protobuf_handler(
                client.peer_id, handle_name("rpc_direct_ticket"), runtime_pb2.ExpertUID(uid=""),
                runtime_pb2.ExpertInfo,
            )  # fmt: skip
            return ds.DirectOffer.from_dict(MSGPackSerializer.loads((await asyncio.wait_for(call, 10)).serialized_info))

        offer = client.call(ticket())
        torch.manual_seed(5)
        prefill, token = torch.randn(1, 3, HIDDEN), torch.randn(1, 1, HIDDEN)

        async def session():
            stream = await DirectInferenceStream.open(offer, server.peer_id, timeout_s=10)
            assert stream is not None, "the direct port refused the ticket"
            await stream.send(packed_request(chain(server, 0, 4), prefill, max_length=16))
            first = deserialize_torch_tensor((await asyncio.wait_for(stream.receive(), 30)).tensors[0])
            await stream.send(packed_request(chain(server, 0, 4), token, start_from_position=3))
            second = deserialize_torch_tensor((await asyncio.wait_for(stream.receive(), 30)).tensors[0])
            await stream.send_end()
            stream.close()
            return first, second

        first, second = asyncio.run(session())
        whole = blocks_forward(blocks[0:4], torch.cat([prefill, token], dim=1))
        torch.testing.assert_close(first, whole[:, :3], atol=1e-4, rtol=0)
        torch.testing.assert_close(second, whole[:, 3:], atol=1e-4, rtol=0)
    finally:
        client.close()
        server.shutdown()


def test_a_cpu_servers_handler_processes_sleep_and_a_gpu_servers_poll_after_each_message(server):
    """Polling would take the cores a CPU span computes on: only a GPU server's handler processes linger
    (`--busy_poll_ms`), on a selector that stays hot after each message."""
    settings = server.service.pool.settings
    assert settings.poll_linger_s == 0.0 and loop_selector(settings) is None
    selector = loop_selector(dataclasses.replace(settings, poll_linger_s=0.005))
    assert selector is not None and selector.linger_s == 0.005
    selector.close()
