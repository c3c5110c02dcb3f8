"""The processes that use the server (forked from the users bench's forkserver, each with its own P2P: its own peer,
so the per-peer caps hold as for real users): a training client runs forward+backward steps through corolla's client
calls (`run_remote_forward` / `run_remote_backward`, `RemoteSequenceManager` without a DHT: the `rpc_forward` and
`rpc_backward` a `RemoteSequential` sends), one step at a time, when told to, over the transport it is told
(`TRANSPORTS`: the server's direct port by default, as a remote corolla client reaches a server that offers one); the inference client decodes one token
at a time in one session until told to stop, recording every step's wall-clock window."""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.synchronize
import time
from dataclasses import dataclass

import torch

_P2P_FLAGS = dict(nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
_LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
INFERENCE_PREFIX_TOKENS = 16
INFERENCE_POSITIONS = 256  # decode positions cycle through [prefix, prefix + this): rollback rewrites them
REQUEST_TIMEOUT_S = 300.0
WINDOWS_EVERY_S = 0.5  # the inference client sends its steps' windows this often
WINDOWS_DONE = "done"
# a training call's transport: the client config's (local_transport, direct_transport). "direct": the server's direct
# TCP port (a remote corolla client's way; each client its own peer); "local": the same-host unix socket (every client
# the one peer "local": its per-peer forward slots shared); "p2p": through both p2pd daemons
TRANSPORTS = {"direct": (False, True), "local": (True, False), "p2p": (False, False)}
CONNECTION_RETRIES = 1  # a call whose stream closed without a reply runs again once (counted in the report)


@dataclass(frozen=True)
class ServerAddress:
    maddrs: list[str]
    peer_id_b58: str
    prefix: str  # block uids are prefix.0 ... prefix.{num_layers - 1}
    num_layers: int
    hidden_size: int
    dtype_name: str


def _manager(p2p, server: ServerAddress, transport: str):
    from corolla.client.config import ClientConfig
    from corolla.client.routing.sequence_manager import RemoteSequenceManager
    from corolla.protocol.records import RemoteSpanInfo, ServerInfo, ServerState
    from corolla.protocol.uids import make_uid

    local, direct = TRANSPORTS[transport]
    config = ClientConfig(max_retries=0, request_timeout_s=REQUEST_TIMEOUT_S, liveness_check_period_s=0,
                          local_transport=local, direct_transport=direct)  # fmt: skip
    uids = [make_uid(server.prefix, i) for i in range(server.num_layers)]
    manager = RemoteSequenceManager(config, uids, start_updates=False, p2p=p2p)
    info = ServerInfo(ServerState.ONLINE, 1.0, start_block=0, end_block=server.num_layers)
    return manager, RemoteSpanInfo(server.peer_id_b58, 0, server.num_layers, info)


def training_client(
    server: ServerAddress, rows: int, length: int, seed: int, commands: multiprocessing.Queue,
    results: multiprocessing.Queue,
) -> None:  # fmt: skip
    """Waits for commands: (n, transport) runs n forward+backward steps over `transport` (`TRANSPORTS`) and answers
    their (start, forward's end, end) `time.time()` windows and calls retried after a connection closed without a
    reply; None ends it. Answers "ready" after one warm-up step (over the direct port) first."""
    try:
        asyncio.run(_training(server, rows, length, seed, commands, results))
    except BaseException as e:
        results.put(f"training client failed: {e!r}"[:500])


async def _training(
    server: ServerAddress, rows: int, length: int, seed: int, commands: multiprocessing.Queue,
    results: multiprocessing.Queue,
) -> None:  # fmt: skip
    from hivemind.p2p import P2P

    from corolla.client.calls.remote_forward_backward import run_remote_backward, run_remote_forward

    torch.manual_seed(seed)
    dtype = getattr(torch, server.dtype_name)
    inputs = torch.randn(rows, length, server.hidden_size).to(dtype)  # [B, T, H]
    grad_outputs = (torch.randn(rows, length, server.hidden_size) * 1e-3).to(dtype)
    no_prompts = torch.empty(0, dtype=dtype)
    p2p = await P2P.create(initial_peers=server.maddrs, host_maddrs=_LOOPBACK, **_P2P_FLAGS)
    managers = {transport: _manager(p2p, server, transport) for transport in TRANSPORTS}

    retried = 0

    async def once_more(call, *args):
        """`call(*args)`, and again where the stream closed without a reply (`ConnectionError`), as a
        `RemoteSequential` retries a failed call; each retry counted."""
        nonlocal retried
        for attempt in range(CONNECTION_RETRIES + 1):
            try:
                return await call(*args)
            except ConnectionError:
                if attempt == CONNECTION_RETRIES:
                    raise
                retried += 1

    async def step(transport: str = "direct") -> tuple[float, float, float, int]:
        nonlocal retried
        manager, span = managers[transport]
        retried, started = 0, time.time()
        await once_more(run_remote_forward, manager, span, inputs, no_prompts)
        forwarded = time.time()
        # the calls check their outputs' shape and finiteness (`check_outputs`); no second check here (torch's
        # isfinite on bf16 host tensors took ~90 ms per 4 MiB on the dev VM, in every step's time)
        await once_more(run_remote_backward, manager, span, inputs, grad_outputs, no_prompts)
        return started, forwarded, time.time(), retried

    try:
        await step()
        results.put("ready")
        loop = asyncio.get_running_loop()
        while (command := await loop.run_in_executor(None, commands.get)) is not None:
            count, transport = command
            results.put([await step(transport) for _ in range(count)])
    finally:
        await p2p.shutdown()


def inference_client(
    server: ServerAddress, stop: multiprocessing.synchronize.Event, results: multiprocessing.Queue
) -> None:
    """One session: a prefill, then one-token steps until `stop` is set; answers "ready" after the prefill, then the
    (start, end) `time.time()` windows of its steps as lists, each at most `WINDOWS_EVERY_S` after its steps ended (so
    that the bench has a phase's steps at the phase's end), then `WINDOWS_DONE` once stopped."""
    try:
        asyncio.run(_inference(server, stop, results))
    except BaseException as e:
        results.put(f"inference client failed: {e!r}"[:500])


async def _inference(
    server: ServerAddress, stop: multiprocessing.synchronize.Event, results: multiprocessing.Queue
) -> None:
    from hivemind.p2p import P2P

    from benchmarks.users.clients import CorollaStream

    torch.manual_seed(1)
    dtype = getattr(torch, server.dtype_name)
    p2p = await P2P.create(initial_peers=server.maddrs, host_maddrs=_LOOPBACK, **_P2P_FLAGS)
    max_length = INFERENCE_PREFIX_TOKENS + INFERENCE_POSITIONS
    stream = CorollaStream(p2p, server.peer_id_b58, server.num_layers, max_length, "p2p", server.prefix,
                           REQUEST_TIMEOUT_S)  # fmt: skip
    try:
        await stream.open()
        await stream.step(torch.randn(1, INFERENCE_PREFIX_TOKENS, server.hidden_size).to(dtype), 0)
        token = torch.randn(1, 1, server.hidden_size).to(dtype)
        results.put("ready")
        windows: list[tuple[float, float]] = []
        position = INFERENCE_PREFIX_TOKENS
        sent = time.time()
        while not stop.is_set():
            started = time.time()
            await stream.step(token, position)
            windows.append((started, time.time()))
            position = INFERENCE_PREFIX_TOKENS + (position + 1 - INFERENCE_PREFIX_TOKENS) % INFERENCE_POSITIONS
            if windows[-1][1] - sent >= WINDOWS_EVERY_S:
                results.put(windows)
                windows, sent = [], time.time()
        results.put(windows)
        results.put(WINDOWS_DONE)
        await stream.close()
    finally:
        await p2p.shutdown()
