"""In-process fake servers for client tests (no network): `FakeServer` speaks rpc_inference like a corolla/Petals
server over toy causal blocks (`block_fn`, `reference`), `FakeManager` routes to them, `FakeStream` is the stream."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable

import torch
from hivemind.proto import runtime_pb2

from corolla.client.config import ClientConfig
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.protocol.codecs import deserialize_tensor, serialize_tensor
from corolla.protocol.metadata import decode_metadata, encode_metadata
from corolla.protocol.packing import unpack_args_kwargs
from corolla.protocol.prefix import PREFIX_BLOCK_TOKENS, PREFIX_HIT_KEY, parse_prefix_keys
from corolla.protocol.records import DECODE_MAX_TOKENS, RemoteModuleInfo, ServerInfo, ServerState

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


def info_of(server) -> ServerInfo:
    """What a fake announces: its own `server_info()` where it has one, else a stock record of its blocks."""
    if hasattr(server, "server_info"):
        return server.server_info()
    return record_of(server.start, server.end, server.inference_rps)


def implied_throughput(start: int, end: int, inference_rps: float) -> float:
    """The throughput a server of blocks [start, end) announces for its per-block `inference_rps` (Petals' model: a
    token uses (n + 1) / 2 of its n blocks), as a real server's record does: corolla's routing costs a server by both,
    so a fake's two figures must agree."""
    return inference_rps * 2 / (end - start + 1)


def record_of(start: int, end: int, inference_rps: float) -> ServerInfo:
    """An online record of blocks [start, end) serving `inference_rps` per block."""
    throughput = implied_throughput(start, end, inference_rps)
    return ServerInfo(ServerState.ONLINE, throughput, start_block=start, end_block=end, inference_rps=inference_rps)


class FakeServer:
    """Speaks rpc_inference like a corolla/Petals server (metadata, args_structure, start_from_position)."""

    def __init__(self, start: int, end: int, inference_rps: float = 100.0):
        self.start, self.end, self.inference_rps = start, end, inference_rps
        self.dead = False
        self.hung = False  # accepts requests but never answers (its stream reports no error)
        self.delay_s = 0.0  # each answer comes this late (it still answers pings: a slow or overloaded server)
        # the answer to a step of more than DECODE_MAX_TOKENS tokens comes this late instead (a loris that answers
        # decode steps and races' trials at once, and holds prompts and replays)
        self.long_delay_s: float | None = None
        # the answer to a step of at most DECODE_MAX_TOKENS tokens comes this late instead (a loris that answers
        # prompts and whole replays at once, and holds decode steps and races' trials)
        self.short_delay_s: float | None = None
        self.first_requests: list[dict] = []  # metadata of each session's first request
        self.requests: list[tuple[dict, int]] = []  # (metadata, tokens)
        self.open_streams = 0
        self.final_lengths: list[int] = []

    def server_info(self) -> ServerInfo:
        return record_of(self.start, self.end, self.inference_rps)

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
                # any run of its blocks, as a real server serves one (a route may take blocks 2:4 of its 0:4)
                first = int(uids[0].split(".")[1])
                assert self.start <= first and first + len(uids) <= self.end, (uids, self.start, self.end)
                assert uids == [f"m.{i}" for i in range(first, first + len(uids))], uids
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
                delay_s = self.delay_s
                if self.long_delay_s is not None and hidden.shape[1] > DECODE_MAX_TOKENS:
                    delay_s = self.long_delay_s
                if self.short_delay_s is not None and hidden.shape[1] <= DECODE_MAX_TOKENS:
                    delay_s = self.short_delay_s
                if delay_s:
                    await asyncio.sleep(delay_s)
                yield runtime_pb2.ExpertResponse(tensors=[serialize_tensor(hidden)])
        finally:
            self.open_streams -= 1
            self.final_lengths.append(caches[0].shape[1] if caches and caches[0] is not None else 0)


class Referee(FakeServer):
    """`FakeServer` that answers `rpc_forward` too, honestly (a referee or replica recomputing a span's step
    statelessly: `verification.step_verifier`, `verification.stretches`); counts the calls."""

    forward_calls = 0

    async def rpc_forward(self, request, timeout=None):
        self.forward_calls += 1
        metadata = decode_metadata(request.metadata)
        args, _ = unpack_args_kwargs([deserialize_tensor(t) for t in request.tensors], metadata["args_structure"])
        x = args[0]  # [B, T, H]
        for uid in request.uid.split(" "):
            x = block_fn(int(uid.split(".")[1]), x, x[:, :0])
        return runtime_pb2.ExpertResponse(tensors=[serialize_tensor(x)])


class Judgements:
    """What `manager`'s client made of servers' answers from now on (made at a test's turn): a server's answer is judged
    once the client took it (a step answered, a race won: `on_request_success`) or found it unusable (a race's trial
    that disagreed: `unprove`). `of(*peers)`: an event set at the first judgement of any of them. A racer that must
    lose a race to another answers only once the other's answer was judged (the race over, or that answer lost): the
    race's order is the test's, not its fake servers' delays, which a pause of the client's loop reorders (a GC or
    CPU-starved pause of 0.58 s made a trial answered 20 ms late beat one answered at once)."""

    def __init__(self, manager: RemoteSequenceManager) -> None:
        self._events: list[tuple[frozenset[str], asyncio.Event]] = []
        for name in ("on_request_success", "unprove"):
            setattr(manager, name, self._judging(getattr(manager, name)))

    def _judging(self, method: Callable[[str], None]) -> Callable[[str], None]:
        def judged(peer_id: str) -> None:
            method(peer_id)
            for peers, event in self._events:  # (called on the client's loop, as the events' waiters are)
                if peer_id in peers:
                    event.set()

        return judged

    def of(self, *peers: str) -> asyncio.Event:
        event = asyncio.Event()
        self._events.append((frozenset(peers), event))
        return event


class AnswersAfter(FakeServer):
    """Honest; once `after` is given (at a test's turn), a session's first step (a race's trial, or a replay) is
    answered only once `after` is set (`Judgements`: another racer's answer judged), its later ones as usual."""

    after: asyncio.Event | None = None

    async def _serve(self, requests):
        first = True
        async for response in super()._serve(requests):
            if first and self.after is not None:
                await self.after.wait()
            first = False
            yield response


class RefereeAnswersAfter(AnswersAfter, Referee):
    """`AnswersAfter` that answers `rpc_forward` too (a referee), at once."""


class FakeStream:
    """A fake server's `rpc_inference(requests)` (or another streaming rpc's) as the client's `InferenceStream` (a
    queue feeds its requests)."""

    def __init__(self, server: FakeServer, rpc: str = "rpc_inference"):
        self.server, self.rpc = server, rpc
        self.queue: asyncio.Queue = asyncio.Queue()
        self.responses = None
        self.calling: asyncio.Future
        self.closing: asyncio.Future | None = None
        self.closed = False

    async def open(self) -> FakeStream:
        async def requests():
            while (request := await self.queue.get()) is not None:
                yield request

        # a task: a training rpc's fake reads its whole request before it returns its replies
        self.calling = asyncio.ensure_future(getattr(self.server, self.rpc)(requests()))
        return self

    async def send(self, request) -> None:
        await self.queue.put(request)

    async def send_end(self) -> None:
        await self.queue.put(None)

    async def receive(self, max_bytes=None):  # (a fake's responses are objects: no bytes to bound)
        if self.responses is None:
            self.responses = (await self.calling).__aiter__()
        try:
            return await anext(self.responses)
        except StopAsyncIteration:
            return None

    def close(self) -> None:
        if self.closing is None:  # ends the server's generator, as a closed connection does
            self.closed = True
            if self.responses is None:
                self.calling.cancel()
                self.closing = self.calling
            else:
                self.closing = asyncio.ensure_future(self.responses.aclose())


def vouch(manager: RemoteSequenceManager, *peers: str) -> None:
    """Gives each of `peers` a witness's standing with `manager`'s client (decision 0190), as a client that verified
    them before has: `witness_standing_steps` verified outputs in a row that agreed with another server."""
    for _ in range(manager.config.witness_standing_steps):
        for peer in peers:
            manager.bans.record_verified(peer, agreed=True)


class FakeManager(RemoteSequenceManager):
    def __init__(self, servers: dict[str, FakeServer], num_blocks: int, **config):
        config.setdefault("min_backoff_s", 0.01)
        super().__init__(ClientConfig(**config), [f"m.{i}" for i in range(num_blocks)], start_updates=False)
        # seeded: a route's jitter (sigma 0.25) could otherwise pick a server announcing half another's speed (~2.5%)
        self.rng = random.Random(0)
        self.servers = servers
        self.update()

    def fetch_module_infos(self):
        infos = []
        for i, uid in enumerate(self.block_uids):
            held = {peer: info_of(s) for peer, s in self.servers.items() if s.start <= i < s.end}
            infos.append(RemoteModuleInfo(uid, held))
        return infos

    def measure_rtts_s(self, peer_ids):
        return {p: 0.001 for p in peer_ids}

    async def ping_s(self, peer_id):
        return math.inf if self.servers[peer_id].hung else 0.001

    async def get_stub(self, peer_id):
        return self.servers[peer_id]

    async def open_inference_stream(self, peer_id, rpc="rpc_inference"):
        return await FakeStream(self.servers[peer_id], rpc).open()


class PrefixFakeServer(FakeServer):
    """A corolla server with a prefix cache (announces `tokens_served`): `store` maps a block's chain hash to that
    block's 16 cached inputs of each of its blocks; a session's zero-token first step with `corolla.prefix` keys gets
    the longest stored prefix (`corolla.prefix_hit`); every step stores the blocks its keys name. `store.clear()`
    evicts everything."""

    def __init__(self, start: int, end: int, inference_rps: float = 100.0, busy_fraction: float | None = None):
        super().__init__(start, end, inference_rps)
        self.store: dict[bytes, list[torch.Tensor]] = {}
        self.busy_fraction = busy_fraction
        self.hits: list[int] = []

    def server_info(self) -> ServerInfo:
        info = super().server_info()
        info.tokens_served, info.busy_fraction = 0, self.busy_fraction
        return info

    async def _serve(self, requests):
        self.open_streams += 1
        caches = None
        try:
            async for request in requests:
                if self.dead:
                    raise ConnectionError("server died")
                if not request.tensors:
                    break
                metadata = decode_metadata(request.metadata)
                keys = parse_prefix_keys(metadata)
                args, _ = unpack_args_kwargs(
                    [deserialize_tensor(t) for t in request.tensors], metadata["args_structure"]
                )
                hidden, prompts, hypo_ids = args
                reply = {}
                if caches is None:
                    self.first_requests.append(metadata)
                    caches = [hidden[:, :0]] * (self.end - self.start)
                    hit = 0
                    if keys is not None and keys.first_block == 0 and hidden.shape[1] == 0:
                        for h in keys.hashes:
                            if h not in self.store:
                                break
                            caches = [
                                torch.cat([c, part], dim=1) for c, part in zip(caches, self.store[h], strict=True)
                            ]
                            hit += PREFIX_BLOCK_TOKENS
                        self.hits.append(hit)
                        reply[PREFIX_HIT_KEY] = hit
                position = metadata.get("start_from_position", caches[0].shape[1])
                assert 0 <= position <= caches[0].shape[1], f"start {position} beyond cached {caches[0].shape[1]}"
                self.requests.append((metadata, hidden.shape[1]))
                for i, b in enumerate(range(self.start, self.end)):
                    past = caches[i][:, :position]
                    x = hidden
                    if prompts.numel():
                        x = x.clone()
                        x[:, : prompts.shape[2]] += prompts[i]
                    out = block_fn(b, x, past)
                    caches[i] = torch.cat([past, x], dim=1)
                    hidden = out
                if keys is not None and hidden.shape[1] > 0:
                    for j, h in enumerate(keys.hashes):
                        block = keys.first_block + j
                        end = (block + 1) * PREFIX_BLOCK_TOKENS
                        assert end <= caches[0].shape[1], "a key names a block this step completed"
                        self.store[h] = [c[:, end - PREFIX_BLOCK_TOKENS : end].clone() for c in caches]
                yield runtime_pb2.ExpertResponse(
                    tensors=[serialize_tensor(hidden)], metadata=encode_metadata(reply) if reply else b""
                )
        finally:
            self.open_streams -= 1
            self.final_lengths.append(caches[0].shape[1] if caches else 0)
