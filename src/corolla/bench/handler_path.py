"""CPU of the handler's own per-step path in one process, without p2pd, a device or a model: framed
`rpc_inference` messages of Petals-style sessions are fed into `stream_guard`'s handler, which runs the real
`TransformerConnectionHandler` (metadata, tensor records, validation, session steps, output records, framed
replies) against an executor that returns its input after one loop iteration. Reports the process's CPU and the
wall time per decode step over the decode window (prefills excluded).

    python -m corolla.bench.handler_path --sessions 16 --steps 200 [--proxy] [--hidden_size 8192]

The bench's own part per step is one `feed_data` and one event wait per step (no timer or task per step); it is
counted in the CPU figure.

`--proxy`: the handler process's executor (`proxy_executor.ProxyExecutor`, as with `--num_handlers` > 1) over a
socketpair to an echo device in a child process (`proxy_wire` frames: a STEP_BATCH in, its hidden states back as
one REPLY_BATCH); only this process's CPU is counted.

`--sockets` (with `--proxy`): as a handler process meets its streams. Each session's stream is a unix socketpair
whose client end a child process drives (a step sent only once the previous reply is read, as a client does), and
the echo device answers the steps of each `--forward_ms` period together (one REPLY_BATCH, as after one merged
forward): the arrivals one at a time, the socket reads and writes and the loop's wake-ups of the real handler
process are counted, the clients' and the device's work is not.

`--framing socket|direct` (with `--sockets`): the streams framed as the same-host socket's, or sealed as the direct
port's, and served by `stream_endpoint.serve_inference` instead of `stream_guard` (`bench.stream_framings`).

What it leaves out: the p2pd socket and the device's work (and without `--proxy` the device channel); the
many-users bench (`multi_user`) measures those through the real server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from corolla.bench.stream_framings import FRAMINGS, ClientFraming, ServeStream, server_streams
from corolla.protocol.codecs import serialize_tensor
from corolla.protocol.metadata import encode_metadata
from corolla.protocol.packing import pack_args_kwargs
from corolla.server import proxy_wire as wire
from corolla.server.block_functions import ServingLimits
from corolla.server.executor import (
    PATH_PLAIN,
    BackwardInputs,
    ForwardInputs,
    HandoffUnsupported,
    SessionCache,
    SessionSpec,
    SpanExecutor,
    StepInputs,
)
from corolla.server.handler import TransformerConnectionHandler
from corolla.server.memory_cache import TensorDescriptorLike
from corolla.server.metrics import ServerMetrics
from corolla.server.proxy_executor import DeviceInfo, DeviceLink, ProxyExecutor
from corolla.server.raw_steps import RawStepper
from corolla.server.sessions import SessionTimeouts
from corolla.server.stream_guard import guarded_stream_handler
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

HIDDEN_SIZE = 64
PREFIX_TOKENS = 16


@dataclass(frozen=True)
class HandlerPathResult:
    sessions: int
    steps: int  # decode steps per session
    cpu_us_per_step: float  # this process's CPU (all threads) over the decode window, per step
    wall_us_per_step: float


class EchoExecutor:
    """A `SpanExecutor` that returns a step's hidden states after one loop iteration (as a reply would take)."""

    path = PATH_PLAIN
    max_size_bytes = 1 << 40
    bytes_left = 1 << 40
    bytes_waiting = 0

    def session_bytes(self, spec: SessionSpec) -> int:
        return 0

    def cache_bytes_per_token(self, block_indices: tuple[int, ...]) -> int:
        return 1

    @contextlib.asynccontextmanager
    async def open_session(self, spec: SessionSpec, alloc_timeout_s: float | None) -> AsyncIterator[SessionCache]:
        yield SessionCache(spec)

    async def step(self, cache: SessionCache, inputs: StepInputs) -> torch.Tensor:
        await asyncio.sleep(0)
        return inputs.tensor()  # [B, T, H]

    async def forward(
        self, block_indices: tuple[int, ...], inputs: ForwardInputs, *, chunk_tokens: int
    ) -> torch.Tensor:
        raise NotImplementedError("the handler path bench runs inference steps only")

    async def backward(self, block_indices: tuple[int, ...], inputs: BackwardInputs) -> list[torch.Tensor]:
        raise NotImplementedError("the handler path bench runs inference steps only")

    def handoff_layout(self, spec: SessionSpec) -> list[list[TensorDescriptorLike]]:
        raise HandoffUnsupported("the handler path bench keeps no KV cache")

    async def read_kv(self, cache: SessionCache, position: int) -> list[torch.Tensor]:
        raise HandoffUnsupported("the handler path bench keeps no KV cache")

    async def write_kv(self, cache: SessionCache, tensors: list[torch.Tensor], position: int) -> None:
        raise HandoffUnsupported("the handler path bench keeps no KV cache")


_ECHO_MAX_FRAME_BYTES = 64 << 20


def _echo_device(sock: socket.socket, forward_s: float = 0.0, inherited: tuple[socket.socket, ...] = ()) -> None:
    """The child process of `--proxy`: a device that answers OPEN/CLOSE and returns every step's hidden states,
    the steps of one STEP_BATCH in one REPLY_BATCH (as the device process answers one merged forward); with
    `forward_s` > 0, the steps that came during each period of that length, together. `inherited`: the parent's
    sockets, closed here (the parent's end of the channel kept open here would hide its close)."""
    for other in inherited:
        other.close()
    asyncio.run(_echo_device_loop(sock, forward_s))


async def _echo_device_loop(sock: socket.socket, forward_s: float = 0.0) -> None:
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    info = DeviceInfo(PATH_PLAIN, 0, _ECHO_MAX_FRAME_BYTES, {0: 1, 1: 1}, 1, 0)
    state = wire.Writer().u64(1 << 40).u64(0).u64(1 << 40)
    writer.write(_frame(wire.HELLO, 0, info.to_json()))
    writer.write(state.frame(wire.STATE, 0))
    handles = 0
    waiting: list[tuple[int, int, wire.Writer]] = []  # steps answered at the end of the current period

    def answer() -> None:
        for frame in wire.batch_frames(waiting, wire.REPLY_BATCH, _ECHO_MAX_FRAME_BYTES, head=state):
            writer.write(frame)
        waiting.clear()

    async def forwards() -> None:
        while True:
            await asyncio.sleep(forward_s)
            if waiting:
                answer()

    ticking = asyncio.create_task(forwards()) if forward_s > 0 else None
    while True:
        try:
            kind, request_id, payload = await wire.read_frame(reader, _ECHO_MAX_FRAME_BYTES)
        except wire.ChannelClosed:
            if ticking is not None:
                ticking.cancel()
            return
        if kind == wire.OPEN:
            handles += 1
            reply = wire.Writer()
            reply.parts = [*state.parts]
            writer.write(reply.u32(handles).u8(1).frame(wire.REPLY_OPEN, request_id))
        elif kind == wire.CLOSE:
            writer.write(state.frame(wire.REPLY_CLOSED, request_id))
        elif kind in (wire.STEP, wire.STEP_BATCH):
            items = (
                [(kind, request_id, memoryview(payload))]
                if kind == wire.STEP
                else wire.split_batch(wire.Reader(payload), wire.STEP_BATCH)
            )
            for _, item_id, item in items:
                fields = wire.Reader(item)
                fields.u32(), fields.u32(), fields.u8(), fields.text()
                hidden = fields.tensor()
                fields.tensor(), fields.tensor()
                fields.done()
                waiting.append((wire.REPLY_TENSORS, item_id, wire.Writer().u8(1).tensor(hidden)))
            if ticking is None:
                answer()
        await writer.drain()


def _frame(kind: int, request_id: int, payload: bytes) -> bytes:
    return wire.HEADER.pack(len(payload), kind, request_id) + payload


class _ReplyCounter:
    """The stream writer: counts replies (a reply is complete when the handler awaits `drain`) and error replies
    (they start with the error marker)."""

    def __init__(self) -> None:
        self.replied = asyncio.Event()
        self.replies = 0
        self.errors = 0

    def write(self, data: bytes) -> None:
        if data == P2P.ERROR_MARKER:
            self.errors += 1

    async def drain(self) -> None:
        self.replies += 1
        self.replied.set()

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False


@dataclass(frozen=True)
class _Origin:
    peer_id: None = None  # a local caller: counted as the same-host peer


def _framed(request: runtime_pb2.ExpertRequest) -> bytes:
    body = request.SerializeToString()
    return P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


def session_messages(steps: int, seed: int, hidden_size: int = HIDDEN_SIZE) -> list[bytes]:
    """A prefill of `PREFIX_TOKENS` then `steps` one-token steps, framed, as a Petals client sends them."""
    generator = torch.Generator().manual_seed(seed)
    session_id = str(uuid.UUID(int=seed))
    messages = []
    for step in range(steps + 1):
        tokens = PREFIX_TOKENS if step == 0 else 1
        hidden = torch.randn(1, tokens, hidden_size, generator=generator)  # [1, T, H]
        tensors, structure = pack_args_kwargs(hidden, torch.empty(0), torch.empty(0, dtype=torch.int64))
        position = 0 if step == 0 else PREFIX_TOKENS + step - 1
        metadata = {"session_id": session_id, "step_id": f"{seed}-{step}", "start_from_position": position}
        metadata["args_structure"] = structure
        if step == 0:
            metadata["max_length"] = PREFIX_TOKENS + steps + 8
        request = runtime_pb2.ExpertRequest(
            uid="p.0 p.1", tensors=[serialize_tensor(t) for t in tensors], metadata=encode_metadata(metadata)
        )
        messages.append(_framed(request))
    return messages


async def run_handler_path(
    sessions: int,
    steps: int,
    *,
    proxy: bool = False,
    hidden_size: int = HIDDEN_SIZE,
    sockets: bool = False,
    forward_ms: float = 0.0,
    framing: str = "p2p",
) -> HandlerPathResult:
    """`sessions` concurrent sessions of `steps` decode steps each through one handler; CPU and wall per step.
    `proxy`: through a `ProxyExecutor` to an echo device process that answers every `forward_ms` (0: at once);
    `sockets`: each stream over a socket from a client process (see the module docstring)."""
    if sessions < 1 or steps < 1 or forward_ms < 0:
        raise ValueError(f"sessions and steps must be >= 1 and forward_ms >= 0, got {sessions}, {steps}, {forward_ms}")
    if not proxy:
        return await _run(sessions, steps, hidden_size, EchoExecutor(), sockets=sockets, framing=framing)
    ours, theirs = socket.socketpair()
    device = multiprocessing.get_context("fork").Process(
        target=_echo_device, args=(theirs, forward_ms / 1000, (ours,)), daemon=True
    )
    device.start()
    theirs.close()
    link = await DeviceLink.open(ours)  # as a handler process opens it
    try:
        executor = ProxyExecutor(link)
        return await _run(
            sessions,
            steps,
            hidden_size,
            executor,
            raw_steps=executor,
            sockets=sockets,
            inherited=(ours,),
            framing=framing,
        )
    finally:
        await link.close()
        await asyncio.to_thread(device.join, 10)  # (the loop runs meanwhile: it closes the channel's socket)
        if device.is_alive():
            device.kill()


async def _run(
    sessions: int,
    steps: int,
    hidden_size: int,
    executor: SpanExecutor,
    *,
    raw_steps: RawStepper | None = None,
    sockets: bool = False,
    inherited: tuple[socket.socket, ...] = (),
    framing: str = "p2p",
) -> HandlerPathResult:
    limits = ServingLimits(
        dht_prefix="p", start_block=0, end_block=2, hidden_size=hidden_size, dtype=torch.float32,
        inference_max_length_tokens=PREFIX_TOKENS + steps + 8, max_batch_size_tokens=8192,
    )  # fmt: skip
    handler = TransformerConnectionHandler(
        limits=limits,
        executor=executor,
        timeouts=SessionTimeouts(30, 3600, 30),
        metrics=ServerMetrics(),
        raw_steps=raw_steps,
    )
    refused: list[BaseException] = []
    handle = guarded_stream_handler(
        _Origin(),  # only its peer_id is read
        "rpc_inference",
        handler.rpc_inference,
        handler.stream_budget,
        per_message=True,
        on_reject=lambda name, error: refused.append(error),
    )
    if sockets:
        serve = server_streams(framing, handler, handle, _Origin())
        return await _run_sockets(sessions, steps, hidden_size, serve, refused, inherited, framing)
    if framing != "p2p":
        raise ValueError(f"framing {framing!r} needs sockets (the streams' own connections)")
    prefilled = 0
    all_prefilled, go = asyncio.Event(), asyncio.Event()

    async def one_session(messages: list[bytes]) -> None:
        nonlocal prefilled
        reader, writer = asyncio.StreamReader(), _ReplyCounter()
        serving = asyncio.create_task(handle(_Origin(), reader, writer))
        for index, message in enumerate(messages):
            reader.feed_data(message)
            await writer.replied.wait()  # (bounded for all sessions at once: no timer or task of its own per step)
            writer.replied.clear()
            if index == 0:
                prefilled += 1
                if prefilled == sessions:
                    all_prefilled.set()
                await go.wait()
        reader.feed_data(P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        reader.feed_eof()
        await asyncio.wait_for(serving, 30)
        if writer.replies != len(messages) or writer.errors:
            raise RuntimeError(
                f"a session got {writer.replies} replies ({writer.errors} errors) for {len(messages)} requests"
            )

    tasks = [asyncio.create_task(one_session(session_messages(steps, seed, hidden_size))) for seed in range(sessions)]
    try:
        await asyncio.wait_for(all_prefilled.wait(), 60)
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        go.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60 + 0.01 * sessions * steps)
        cpu_s, wall_s = time.process_time() - cpu_start, time.perf_counter() - wall_start
    finally:
        for task in tasks:
            task.cancel()
    if refused:
        raise RuntimeError(f"the handler refused a step: {refused[0]!r}")
    total = sessions * steps
    return HandlerPathResult(sessions, steps, cpu_s / total * 1e6, wall_s / total * 1e6)


async def _run_sockets(
    sessions: int,
    steps: int,
    hidden_size: int,
    serve: ServeStream,
    refused: list[BaseException],
    inherited: tuple[socket.socket, ...],
    framing: str,
) -> HandlerPathResult:
    """`_run` with each stream over a socketpair from a client process; this process's CPU over the decode window
    (between the client process's 'prefilled' and 'done'). `inherited`: other sockets the client process closes."""
    messages = [session_messages(steps, seed, hidden_size) for seed in range(sessions)]
    pairs = [socket.socketpair() for _ in range(sessions)]
    control, control_theirs = socket.socketpair()
    ours = [pair[0] for pair in pairs] + [control]  # the last one: the control socket
    clients = multiprocessing.get_context("fork").Process(
        target=_clients,
        args=([pair[1] for pair in pairs], control_theirs, messages, [*ours, *inherited], framing),
        daemon=True,
    )
    clients.start()
    for sock in [pair[1] for pair in pairs] + [control_theirs]:
        sock.close()
    serving = []
    for sock in ours[:-1]:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        serving.append(asyncio.create_task(serve(reader, writer)))
    control_reader, control_writer = await asyncio.open_unix_connection(sock=control)
    try:
        await asyncio.wait_for(control_reader.readexactly(1), 60)  # every session prefilled
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        control_writer.write(b"g")
        answered = int.from_bytes(await asyncio.wait_for(control_reader.readexactly(8), 60 + 0.01 * sessions * steps))
        cpu_s, wall_s = time.process_time() - cpu_start, time.perf_counter() - wall_start
        await asyncio.wait_for(asyncio.gather(*serving), 30)
    finally:
        for task in serving:
            task.cancel()
        control_writer.close()
        await asyncio.to_thread(clients.join, 10)
        if clients.is_alive():
            clients.kill()
    if refused:
        raise RuntimeError(f"the handler refused a step: {refused[0]!r}")
    total = sessions * steps
    if answered != total:
        raise RuntimeError(f"the clients got {answered} decode replies (errors excluded) for {total} steps")
    return HandlerPathResult(sessions, steps, cpu_s / total * 1e6, wall_s / total * 1e6)


def _clients(
    socks: list[socket.socket],
    control: socket.socket,
    messages: list[list[bytes]],
    inherited: list[socket.socket],
    framing: str,
) -> None:
    """The client process of `--sockets`: every session's prefill, 'prefilled', wait for 'go', then its decode
    steps one reply at a time and its end; 'done' with the count of decode replies that were not errors."""
    for sock in inherited:
        sock.close()
    asyncio.run(_clients_loop(socks, control, messages, framing))


async def _clients_loop(
    socks: list[socket.socket], control: socket.socket, messages: list[list[bytes]], framing: str
) -> None:
    control_reader, control_writer = await asyncio.open_unix_connection(sock=control)
    streams = [await asyncio.open_unix_connection(sock=sock) for sock in socks]
    framings = [ClientFraming(framing) for _ in socks]

    async def exchange(index: int, message: bytes) -> bool:
        reader, writer = streams[index]
        writer.write(framings[index].request(message))
        return await framings[index].reply(reader)

    async def decode(index: int) -> int:
        answered = 0
        for message in messages[index][1:]:
            answered += await exchange(index, message)
        streams[index][1].write(framings[index].end())
        await streams[index][1].drain()
        return answered

    await asyncio.gather(*(exchange(index, messages[index][0]) for index in range(len(streams))))
    control_writer.write(b"p")
    await control_reader.readexactly(1)
    answered = await asyncio.gather(*(decode(index) for index in range(len(streams))))
    control_writer.write(sum(answered).to_bytes(8, "big"))
    await control_writer.drain()
    await control_reader.read()  # the bench closes the control socket once its handlers are done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200, help="decode steps per session")
    parser.add_argument("--hidden_size", type=int, default=HIDDEN_SIZE, help="hidden states' width (float32)")
    parser.add_argument("--proxy", action="store_true", help="through a ProxyExecutor to an echo device process")
    parser.add_argument("--sockets", action="store_true", help="each stream over a socket from a client process")
    parser.add_argument("--forward_ms", type=float, default=0.0, help="the echo device answers every this many ms")
    parser.add_argument("--framing", choices=FRAMINGS, default="p2p", help="with --sockets: the streams' framing")
    args = parser.parse_args()
    logging.getLogger("corolla.server").setLevel(logging.WARNING)  # a line per session open and close otherwise
    torch.set_num_threads(1)
    result = asyncio.run(
        run_handler_path(
            args.sessions,
            args.steps,
            proxy=args.proxy,
            hidden_size=args.hidden_size,
            sockets=args.sockets,
            forward_ms=args.forward_ms,
            framing=args.framing,
        )  # fmt: skip
    )
    mode = " (proxy)" if args.proxy else ""
    mode += f" (sockets, {args.framing} framing)" if args.sockets else ""
    mode += f" (forward {args.forward_ms} ms)" if args.forward_ms else ""
    print(
        f"handler path{mode}: {result.sessions} sessions x {result.steps} steps: {result.cpu_us_per_step:.1f} us CPU, "
        f"{result.wall_us_per_step:.1f} us wall per step"
    )


if __name__ == "__main__":
    main()
