"""`python -m benchmarks.field.hoarding [--identities 2,8,32] [--users 5]` (inside `../shared/tools/loopback-only`):
KV hoarding with cheap identities against one CPU server on the demo model (one process, loopback). Each of N
identities (a peer id costs nothing: random bytes, no daemon each) keeps opening sessions of `max_length` (half of
the cache, the per-peer cap) and holds them with zero-token steps, opening again at once whatever the server ends or
refuses; meanwhile an honest long session generates throughout, and a real user (a p2p client of its own) opens a
session of `max_length` with an 8-token prompt, decodes 4 tokens and closes, `users` times. Prints one JSON line per N:
the user's time to admission (first reply), refusals, the honest session's failures, what the hoarders got.
`--tokens_per_step 1 --keepalive_s 2` makes them trickle hoarders: one real token per step, a step every 2 s, so
their sessions are working ones (they hold real pages and are never idle); `--tokens_per_step 1 --reopen_s 1.5`
makes them reopen a session with a one-token prefill every 1.5 s (fresh sessions, whose pace is never read). A `--max_length` beyond the demo model's
1024 positions raises its `max_position_embeddings` in a copy (rotary: any length; the inputs are random hidden
states): 32 sessions' pages of 16 tokens are a realistic share of a 4096-token cache, not of a 1024-token one.
`--block_delay_s D` emulates a busy server (the test-only `COROLLA_TEST_BLOCK_DELAY_S`: each batch of n steps holds
the runtime n * 4 * D seconds), so that prefills wait in its queue as they do on a loaded machine, reproducibly.

`HoardingAttack` is the attacker of the suite's test too (`tests/integration/test_hoarding.py`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hivemind.compression.serialization import serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from corolla.demo.checkpoint import ensure_demo_checkpoint
from corolla.protocol import local_stream as ls
from corolla.protocol.packing import pack_args_kwargs
from corolla.protocol.rpc import TransformerConnectionHandler
from corolla.protocol.uids import make_chain
from corolla.server.front.stream_endpoint import FrameConnection, PlainFrames, serve_inference
from corolla.server.slowdown import BLOCK_DELAY_ENV

RETRY_S = 0.02  # a refused or ended hoarder opens again this soon
MAX_FRAME_OVERHEAD_BYTES = 1 << 20  # a frame's bound over the handler's largest message (as `LocalEndpoint`'s)
MAX_REPLY_BYTES = 1 << 30


def step_request(uid: str, hidden: torch.Tensor, **metadata: Any) -> runtime_pb2.ExpertRequest:
    """One `rpc_inference` message as a Petals client packs it."""
    flat, structure = pack_args_kwargs(hidden)
    return runtime_pb2.ExpertRequest(
        uid=uid,
        tensors=[serialize_torch_tensor(t) for t in flat],
        metadata=MSGPackSerializer.dumps({**metadata, "args_structure": structure}),
    )


@dataclass
class HoardStats:
    opened: int = 0  # sessions the server admitted
    refused: int = 0  # opens the server refused
    ended: int = 0  # admitted sessions the server ended later (evicted, or a step refused)


class HoardingAttack:
    """`identities` peer ids, each running `sessions_per_identity` loops that open a session of `max_length` and hold
    it with a step of `tokens_per_step` tokens (0: zero-token keep-alives) every `keepalive_s`, opening again at once
    when the server refuses or ends it; with `reopen_s`, it sends no step after the opening one (its prefill of
    `tokens_per_step` tokens) and closes and opens the session again every `reopen_s`. Runs in the server's event loop
    against its handler, each session a `HandlerStream`."""

    def __init__(
        self,
        handler: Any,
        uid: str,
        server_peer: PeerID,
        *,
        identities: int,
        max_length: int,
        hidden_size: int,
        keepalive_s: float = 0.5,
        tokens_per_step: int = 0,
        sessions_per_identity: int = 1,
        alloc_timeout_s: float = 0.0,
        reopen_s: float | None = None,
    ):
        self.handler, self.uid, self.server_peer = handler, uid, server_peer
        self.peers = [PeerID(os.urandom(34)) for _ in range(identities)]
        self.max_length, self.hidden_size = max_length, hidden_size
        self.keepalive_s, self.tokens_per_step = keepalive_s, tokens_per_step
        self.sessions_per_identity, self.alloc_timeout_s = sessions_per_identity, alloc_timeout_s
        self.reopen_s = reopen_s
        self.stats = HoardStats()

    async def run(self, stop: asyncio.Event) -> None:
        loops = [self._hold(peer, stop) for peer in self.peers for _ in range(self.sessions_per_identity)]
        await asyncio.gather(*loops)

    def _request(self, **metadata: Any) -> runtime_pb2.ExpertRequest:
        hidden = torch.randn(1, self.tokens_per_step, self.hidden_size)  # [B, T, H]
        return step_request(self.uid, hidden, **metadata)

    async def _hold(self, peer: PeerID, stop: asyncio.Event) -> None:
        context = P2PContext(handle_name="rpc_inference", local_id=self.server_peer, remote_id=peer)
        while not stop.is_set():
            stream = await HandlerStream.open(self.handler, context)
            opened = False
            try:
                stream.send(self._request(max_length=self.max_length, alloc_timeout=self.alloc_timeout_s))
                await stream.reply()
                opened = True
                self.stats.opened += 1
                if self.reopen_s is not None:  # closed and opened again before its pace is read: always fresh
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.reopen_s)
                    continue
                while not stop.is_set():
                    await asyncio.sleep(self.keepalive_s)
                    stream.send(self._request())
                    await stream.reply()
            except Exception:  # refused, ended by the server, or the stream closed
                if opened:
                    self.stats.ended += 1
                else:
                    self.stats.refused += 1
                await asyncio.sleep(RETRY_S)
            finally:
                await stream.close()


class HandlerStream:
    """One `rpc_inference` stream of the peer `context.remote_id` against a handler in this process, served as the
    server serves its sockets' streams (`stream_endpoint.serve_inference`: the handler's `serve_steps`, the one
    session code of every transport) over a socket pair: an identity costs no daemon."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: FrameConnection, serving: asyncio.Task
    ):
        self.reader, self.writer, self.conn, self.serving = reader, writer, conn, serving

    @classmethod
    async def open(cls, handler: Any, context: P2PContext) -> HandlerStream:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        _, conn = await loop.connect_accepted_socket(FrameConnection, ours)
        reader, writer = await asyncio.open_unix_connection(sock=theirs)
        max_frame_bytes = int(handler.max_stream_bytes) + MAX_FRAME_OVERHEAD_BYTES
        serving = loop.create_task(serve_inference(handler, conn, context, PlainFrames(), max_frame_bytes))
        return cls(reader, writer, conn, serving)

    def send(self, request: runtime_pb2.ExpertRequest) -> None:
        self.writer.writelines(ls.frame(ls.MESSAGE, request.SerializeToString()))

    async def reply(self, timeout_s: float = 30.0) -> runtime_pb2.ExpertResponse:
        """The next reply; raises the server's error (RuntimeError with its text), EOFError at the stream's end."""
        kind, payload = await asyncio.wait_for(ls.read_frame(self.reader, MAX_REPLY_BYTES), timeout_s)
        if kind == ls.MESSAGE:
            return runtime_pb2.ExpertResponse.FromString(payload)
        if kind == ls.ERROR:
            raise RuntimeError(payload.decode(errors="replace"))
        raise EOFError("the server ended the stream")

    async def close(self) -> None:
        """Ends the input (the session ends with it) and waits for the server's side of the stream to end."""
        with contextlib.suppress(Exception):
            self.writer.writelines(ls.frame(ls.END))
            self.writer.write_eof()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(self.serving, 5)
        self.writer.close()
        self.conn.close()


async def _drain(queue: asyncio.Queue[runtime_pb2.ExpertRequest | None]) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    """A stream's requests: what is put in `queue`, until None."""
    while (item := await queue.get()) is not None:
        yield item


class Client:
    """One p2p client (its own daemon and identity) driving `rpc_inference` streams step by step."""

    def __init__(self, p2p: P2P, server: PeerID, uid: str, hidden_size: int):
        self.p2p, self.uid, self.hidden_size = p2p, uid, hidden_size
        self.stub = TransformerConnectionHandler.get_stub(p2p, server)

    async def session(self, prompt_tokens: int, max_length: int) -> tuple[Stream, float]:
        """Opens a session with a prompt; returns it and the seconds to its first reply (admission + prefill)."""
        stream = Stream(self)
        started = time.perf_counter()
        await stream.open(prompt_tokens, max_length)
        return stream, time.perf_counter() - started


class Stream:
    def __init__(self, client: Client):
        self.client = client
        self.queue: asyncio.Queue[runtime_pb2.ExpertRequest | None] = asyncio.Queue()
        self.position = 0

    async def open(self, tokens: int, max_length: int) -> None:
        self.responses = (await self.client.stub.rpc_inference(_drain(self.queue))).__aiter__()
        await self.step(tokens, max_length=max_length)

    async def step(self, tokens: int, timeout_s: float = 30.0, **metadata: Any) -> None:
        hidden = torch.randn(1, tokens, self.client.hidden_size)  # [B, T, H]
        await self.queue.put(step_request(self.client.uid, hidden, **metadata))
        await asyncio.wait_for(self.responses.__anext__(), timeout_s)
        self.position += tokens

    async def close(self) -> None:
        await self.queue.put(runtime_pb2.ExpertRequest())
        await self.queue.put(None)


async def honest_long_session(client: Client, max_length: int, stop: asyncio.Event, record: dict) -> None:
    """Generates (one real token every 50 ms) until `stop` or its length; failures are counted, never expected."""
    try:
        stream, _ = await client.session(16, max_length)
        while not stop.is_set() and stream.position < max_length:
            await stream.step(1)
            record["tokens"] = stream.position
            await asyncio.sleep(0.05)
        await stream.close()
    except Exception as e:
        record["failed"] = f"{type(e).__name__}: {str(e)[-200:]}"


async def new_client(server: Any, uid: str) -> Client:
    """A p2p client of its own (daemon and identity) of the in-process `server`."""
    p2p = await P2P.create(initial_peers=server.join_maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                           nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)  # fmt: skip
    return Client(p2p, PeerID.from_base58(server.peer_id), uid, server.settings.hidden_size)


async def measure(
    server: Any, identities: int, users: int, max_length: int, honest_length: int, *, tokens_per_step: int = 0,
    keepalive_s: float = 0.5, settle_s: float = 2.0, reopen_s: float | None = None,
) -> dict:  # fmt: skip
    """One scenario in the server's loop: an honest session generates, the attack settles for 2 s, then the real user
    comes `users` times asking for `max_length` (half of the cache: what one peer may hold)."""
    uid = make_chain(server.settings.dht_prefix, 0, server.settings.num_blocks)
    honest_client, user = await new_client(server, uid), await new_client(server, uid)
    stop, honest_stop = asyncio.Event(), asyncio.Event()
    honest: dict = {}
    honest_task = asyncio.create_task(honest_long_session(honest_client, honest_length, honest_stop, honest))
    await asyncio.sleep(0.5)
    attack = HoardingAttack(server.service.handler, uid, PeerID.from_base58(server.peer_id), identities=identities,
                            max_length=max_length, hidden_size=server.settings.hidden_size,
                            tokens_per_step=tokens_per_step, keepalive_s=keepalive_s, reopen_s=reopen_s)  # fmt: skip
    attack_task = asyncio.create_task(attack.run(stop))
    await asyncio.sleep(settle_s)
    free_before = server.service.executor.bytes_left
    admit_s: list[float] = []
    refusals: list[str] = []
    for _ in range(users):
        try:
            stream, seconds = await user.session(8, max_length)
            admit_s.append(seconds)
            for _ in range(4):
                await stream.step(1)
            await stream.close()
        except Exception as e:
            refusals.append(str(e)[-160:])
        await asyncio.sleep(0.5)
    stop.set()
    honest_stop.set()
    await asyncio.wait([attack_task, honest_task], timeout=30)
    for client in (honest_client, user):
        await client.p2p.shutdown()
    return {
        "identities": identities,
        "hoarder_tokens_per_step": tokens_per_step,
        "hoarder_step_every_s": keepalive_s,
        "hoarder_reopen_s": reopen_s,
        "user_admit_s_median": round(statistics.median(admit_s), 3) if admit_s else None,
        "user_admit_s_max": round(max(admit_s), 3) if admit_s else None,
        "users_admitted": len(admit_s),
        "users_refused": len(refusals),
        "first_refusal": refusals[0] if refusals else None,
        "honest_long_session": honest.get("failed", f"ok, {honest.get('tokens', 0)} tokens"),
        "cache_free_when_user_came_bytes": free_before,
        "cache_bytes": server.service.executor.max_size_bytes,
        "hoarder_opens": attack.stats.opened,
        "hoarder_refused": attack.stats.refused,
        "hoarder_ended_by_server": attack.stats.ended,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--identities", default="2,8,32")
    parser.add_argument("--users", type=int, default=5)
    parser.add_argument("--max_length", type=int, default=512, help="each hoarder's session: half of the cache")

    parser.add_argument("--tokens_per_step", type=int, default=0, help="0: zero-token holds; 1: trickle hoarders")
    parser.add_argument("--keepalive_s", type=float, default=0.5, help="between two steps of a hoarder")
    parser.add_argument("--settle_s", type=float, default=2.0, help="the attack runs this long before the user comes")
    parser.add_argument("--reopen_s", type=float, default=None,
                        help="hoarders send only a prefill and open again this often (fresh sessions)")  # fmt: skip
    parser.add_argument("--block_delay_s", type=float, default=None,
                        help="emulated device time per step per block: a busy server, prefills queued")  # fmt: skip
    args = parser.parse_args()
    if args.block_delay_s is not None:  # read by the server at start (test-only knob)
        os.environ[BLOCK_DELAY_ENV] = str(args.block_delay_s)
    from corolla.server.config import ServerConfig
    from corolla.server.server import Server

    honest_length = args.max_length // 4
    with tempfile.TemporaryDirectory() as cache_dir:
        model_path = Path(cache_dir) / "model"
        shutil.copytree(ensure_demo_checkpoint(), model_path)
        model_config = json.loads((model_path / "config.json").read_text())
        model_config["max_position_embeddings"] = max(model_config["max_position_embeddings"], args.max_length)
        (model_path / "config.json").write_text(json.dumps(model_config))
        config = ServerConfig(
            model_name_or_path=str(model_path), new_swarm=True, throughput=10.0,
            torch_dtype="float32", update_period_s=30.0, cache_dir=cache_dir, num_blocks=4,
            inference_max_length_tokens=args.max_length, attn_cache_tokens=2 * args.max_length,
            step_timeout_s=60.0, session_timeout_s=600.0,
        )  # fmt: skip
        server = Server(config).start(timeout_s=120)
        loop = server._loop
        assert loop is not None  # (set by the serving loop before `start` returns)
        try:
            for n in (int(x) for x in args.identities.split(",")):
                scenario = measure(
                    server, n, args.users, args.max_length, honest_length, tokens_per_step=args.tokens_per_step,
                    keepalive_s=args.keepalive_s, settle_s=args.settle_s, reopen_s=args.reopen_s,
                )  # fmt: skip
                future = asyncio.run_coroutine_threadsafe(scenario, loop)
                print(json.dumps(future.result(600)), flush=True)
        finally:
            server.shutdown()


if __name__ == "__main__":
    main()
