"""InferenceSession against in-process fake servers (no network): fail-over replay rebuilds caches with no lost or
duplicated tokens (Petals bug #587), rollback, hypo_ids, zero-token steps, deep prompts, and every stream closed."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch
from hivemind.proto import runtime_pb2

from corolla.client.config import ClientConfig
from corolla.client.inference_session import InferenceSession
from corolla.client.routing import RemoteSequenceManager
from corolla.protocol.codecs import deserialize_tensor, serialize_tensor
from corolla.protocol.metadata import decode_metadata
from corolla.protocol.packing import unpack_args_kwargs
from corolla.protocol.records import RemoteModuleInfo, ServerInfo, ServerState
from corolla.utils.errors import MissingBlocksError

HIDDEN = 8


def block_fn(b: int, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
    """A toy causal block: each position adds a weighted running mean of all inputs up to it."""
    full = torch.cat([past, x], dim=1)  # [B, n, H]
    means = full.cumsum(dim=1) / torch.arange(1, full.shape[1] + 1).view(1, -1, 1)
    return x + (0.5 + 0.1 * b) * torch.tanh(means[:, past.shape[1] :])


def reference(x: torch.Tensor, num_blocks: int, prompts: torch.Tensor | None = None) -> torch.Tensor:
    for b in range(num_blocks):
        if prompts is not None:
            x = x.clone()
            x[:, : prompts.shape[2]] += prompts[b]
        x = block_fn(b, x, x[:, :0])
    return x


class FakeServer:
    """Speaks rpc_inference like a corolla/Petals server (metadata, args_structure, start_from_position)."""

    def __init__(self, start: int, end: int, inference_rps: float = 100.0):
        self.start, self.end, self.inference_rps = start, end, inference_rps
        self.dead = False
        self.hung = False  # accepts requests but never answers (its stream reports no error)
        self.first_requests: list[dict] = []  # metadata of each session's first request
        self.requests: list[tuple[dict, int]] = []  # (metadata, tokens)
        self.open_streams = 0
        self.final_lengths: list[int] = []

    async def rpc_inference(self, requests):
        return self._serve(requests)

    async def _serve(self, requests):
        self.open_streams += 1
        caches = None
        try:
            async for request in requests:
                if self.dead:
                    raise ConnectionError("server died")
                if self.hung:
                    await asyncio.sleep(3600)
                if not request.tensors:
                    break
                metadata = decode_metadata(request.metadata)
                if caches is None:
                    assert "max_length" in metadata and metadata["session_id"]
                    self.first_requests.append(metadata)
                    caches = [None] * (self.end - self.start)
                uids = request.uid.split(" ")
                assert uids == [f"m.{i}" for i in range(self.start, self.end)][: len(uids)]
                args, _ = unpack_args_kwargs(
                    [deserialize_tensor(t) for t in request.tensors], metadata["args_structure"]
                )
                hidden, prompts, hypo_ids = args
                position = metadata["start_from_position"]
                current = caches[0].shape[1] if caches[0] is not None else 0
                assert 0 <= position <= current, f"start_from_position {position} beyond cached {current}"
                assert position + hidden.shape[1] <= metadata.get("max_length", self.first_requests[-1]["max_length"])
                self.requests.append((metadata, hidden.shape[1]))
                for i, uid in enumerate(uids):
                    b = int(uid.split(".")[1])
                    past = caches[i][:, :position] if caches[i] is not None else hidden[:, :0]
                    if hypo_ids.numel():
                        past = past[hypo_ids]
                    x = hidden
                    if prompts.numel():
                        x = x.clone()
                        x[:, : prompts.shape[2]] += prompts[i]
                    out = block_fn(b, x, past)
                    caches[i] = torch.cat([past, x], dim=1)
                    hidden = out
                yield runtime_pb2.ExpertResponse(tensors=[serialize_tensor(hidden)])
        finally:
            self.open_streams -= 1
            self.final_lengths.append(caches[0].shape[1] if caches and caches[0] is not None else 0)


class FakeStream:
    """A fake server's `rpc_inference(requests)` as the client's `InferenceStream` (a queue feeds its requests)."""

    def __init__(self, server: FakeServer):
        self.server = server
        self.queue: asyncio.Queue = asyncio.Queue()
        self.responses = None
        self.closing: asyncio.Future | None = None
        self.closed = False

    async def open(self) -> FakeStream:
        async def requests():
            while (request := await self.queue.get()) is not None:
                yield request

        self.responses = (await self.server.rpc_inference(requests())).__aiter__()
        return self

    async def send(self, request) -> None:
        await self.queue.put(request)

    async def send_end(self) -> None:
        await self.queue.put(None)

    async def receive(self):
        try:
            return await anext(self.responses)
        except StopAsyncIteration:
            return None

    def close(self) -> None:
        if self.closing is None:  # ends the server's generator, as a closed connection does
            self.closed = True
            self.closing = asyncio.ensure_future(self.responses.aclose())


class FakeManager(RemoteSequenceManager):
    def __init__(self, servers: dict[str, FakeServer], num_blocks: int, **config):
        config.setdefault("min_backoff_s", 0.01)
        super().__init__(ClientConfig(**config), [f"m.{i}" for i in range(num_blocks)], start_updates=False)
        self.servers = servers
        self.update()

    def fetch_module_infos(self):
        infos = []
        for i, uid in enumerate(self.block_uids):
            held = {
                peer: ServerInfo(
                    ServerState.ONLINE, 1.0, start_block=s.start, end_block=s.end, inference_rps=s.inference_rps
                )
                for peer, s in self.servers.items()
                if s.start <= i < s.end
            }
            infos.append(RemoteModuleInfo(uid, held))
        return infos

    def measure_rtts_s(self, peer_ids):
        return {p: 0.001 for p in peer_ids}

    async def ping_s(self, peer_id):
        return math.inf if self.servers[peer_id].hung else 0.001

    async def get_stub(self, peer_id):
        return self.servers[peer_id]

    async def open_inference_stream(self, peer_id):
        return await FakeStream(self.servers[peer_id]).open()


def test_failover_replays_history_without_lost_or_duplicated_tokens():
    torch.manual_seed(0)
    servers = {"A": FakeServer(0, 2), "B": FakeServer(2, 4, inference_rps=1000.0), "C": FakeServer(2, 4)}
    manager = FakeManager(servers, 4)
    tokens = torch.randn(1, 12, HIDDEN)
    outputs = []
    with InferenceSession(manager, max_length=12) as session:
        outputs.append(session.step(tokens[:, :4]))  # prefill through A -> B
        for t in range(4, 12):
            if t == 7:
                servers["B"].dead = True
            outputs.append(session.step(tokens[:, t : t + 1]))
        assert session.position == 12
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    replay = servers["C"].requests[0]
    assert replay[0]["start_from_position"] == 0 and replay[1] == 8  # 7 old tokens + the new one, once each
    assert servers["C"].final_lengths == [12] and servers["A"].final_lengths == [12]
    assert servers["A"].open_streams == servers["C"].open_streams == 0
    assert manager.bans.is_banned("B")


def test_history_grows_in_place_and_holds_every_input():
    torch.manual_seed(2)
    manager = FakeManager({"A": FakeServer(0, 4)}, 4)
    tokens = torch.randn(1, 200, HIDDEN)
    buffers = set()
    with InferenceSession(manager, max_length=200) as session:
        session.step(tokens[:, :32])
        after_prompt = session._spans[0]._history_buf.data_ptr()
        for t in range(32, 200):
            session.step(tokens[:, t : t + 1])
            buffers.add(session._spans[0]._history_buf.data_ptr())
            if t < 64:  # the prompt's buffer has room for as many tokens again: no copy at the first tokens
                assert session._spans[0]._history_buf.data_ptr() == after_prompt
        span = session._spans[0]
        torch.testing.assert_close(span.history, tokens, atol=0, rtol=0)
        assert span.position == 200
    assert len(buffers) <= 5  # doubling: a handful of reallocations, not one whole-history copy per token


def test_rollback_hypo_ids_zero_token_steps_and_deep_prompts():
    torch.manual_seed(1)
    servers = {"A": FakeServer(0, 3), "B": FakeServer(3, 5)}
    manager = FakeManager(servers, 5)
    x = torch.randn(2, 6, HIDDEN)
    prompts = torch.randn(5, 1, 2, HIDDEN)
    with InferenceSession(manager, max_length=8) as session:
        out = session.step(x[:, :4], prompts=prompts)
        torch.testing.assert_close(out, reference(x[:, :4], 5, prompts), atol=1e-5, rtol=0)
        empty = session.step(x[:, :0])
        assert empty.shape == (2, 0, HIDDEN) and session.position == 4
        session.position = 2  # roll back: positions 2.. are overwritten
        out = session.step(x[:, 4:6])
        expected = reference(torch.cat([x[:, :2], x[:, 4:6]], dim=1), 5, prompts)[:, 2:]
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
        # beam-search style reordering: both rows continue row 1's history
        hypo_ids = torch.tensor([1, 1])
        new = torch.randn(2, 1, HIDDEN)
        out = session.step(new, hypo_ids=hypo_ids)
        history = torch.cat([x[:, :2], x[:, 4:6]], dim=1)[hypo_ids]
        expected = reference(torch.cat([history, new], dim=1), 5, prompts)[:, -1:]
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="max_length"):
            session.step(torch.randn(2, 4, HIDDEN))
        with pytest.raises(ValueError, match="batch size is 2"):
            session.step(torch.randn(3, 1, HIDDEN))
        with pytest.raises(ValueError, match="deep prompts"):
            session.step(new, prompts=torch.randn(3, 1, 1, HIDDEN))
    assert servers["A"].open_streams == servers["B"].open_streams == 0


def test_failover_during_replay_with_deep_prompts_and_new_chain_shape():
    """The replacement chain has a different shape (two servers for one span) and gets the position-0 prompts."""
    torch.manual_seed(2)
    servers = {"AB": FakeServer(0, 4, inference_rps=1000.0), "A": FakeServer(0, 2), "B": FakeServer(2, 4)}
    manager = FakeManager(servers, 4)
    x = torch.randn(1, 7, HIDDEN)
    prompts = torch.randn(4, 1, 3, HIDDEN)
    with InferenceSession(manager, max_length=7) as session:
        outs = [session.step(x[:, :3], prompts=prompts), session.step(x[:, 3:5])]
        servers["AB"].dead = True
        outs += [session.step(x[:, 5:6]), session.step(x[:, 6:7])]
    torch.testing.assert_close(torch.cat(outs, dim=1), reference(x, 4, prompts), atol=1e-5, rtol=0)
    assert servers["A"].requests[0][1] == 6 and servers["B"].requests[0][1] == 6
    assert servers["A"].final_lengths == servers["B"].final_lengths == [7]


def test_missing_span_fails_after_max_retries():
    servers = {"A": FakeServer(0, 2)}
    manager = FakeManager(servers, 4, max_retries=1)
    with InferenceSession(manager, max_length=4) as session:
        with pytest.raises(MissingBlocksError) as info:
            session.step(torch.randn(1, 1, HIDDEN))
    assert info.value.missing == [2, 3]


def test_hung_server_is_detected_by_liveness_pings():
    torch.manual_seed(3)
    servers = {"A": FakeServer(0, 2), "B": FakeServer(2, 4, inference_rps=1000.0), "C": FakeServer(2, 4)}
    manager = FakeManager(servers, 4, liveness_check_period_s=0.2, request_timeout_s=60.0)
    x = torch.randn(1, 5, HIDDEN)
    with InferenceSession(manager, max_length=5) as session:
        outs = [session.step(x[:, :3])]
        servers["B"].hung = True
        started = time.monotonic()
        outs.append(session.step(x[:, 3:5]))
        assert time.monotonic() - started < 3  # liveness pings, not request_timeout_s
    torch.testing.assert_close(torch.cat(outs, dim=1), reference(x, 4), atol=1e-5, rtol=0)
    assert servers["C"].requests[0][1] == 5


def test_busy_poll_only_for_the_process_s_only_step_in_flight(monkeypatch):
    from corolla.client import span_session as module

    config = ClientConfig(busy_poll_ms=20)
    monkeypatch.setattr(module, "_steps_in_flight", 1)
    assert module._poll_s(config) == 0.02
    monkeypatch.setattr(module, "_steps_in_flight", 2)  # another session steps too: its thread needs the GIL
    assert module._poll_s(config) == 0.0
    monkeypatch.setattr(module, "_steps_in_flight", 1)
    assert module._poll_s(ClientConfig()) == 0.0
    with pytest.raises(ValueError, match="busy_poll_ms"):
        ClientConfig(busy_poll_ms=-1)
