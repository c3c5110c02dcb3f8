"""The one front's host CPU per decode step at many sessions, without a GPU (issue 31: one front at 64 sessions is
bound by its serving loop's Python, docs/decisions/0049): `python -m benchmarks.users.front_cpu`.

The server's own one-front path runs in this process as in a one-process server: the same-host socket
(`front.local_endpoint.LocalEndpoint`, `front.stream_endpoint`), the RPC handler (`front.handler`'s
`serve_steps`: the stream's session, its steps' order, the one decoder, the reply), the core (`core.span_core.SpanCore`)
and the device path of `benchmarks.users.device_cpu` (the server's `Runtime` and `EngineExecutor` over one
Llama-3-8B-wide layer whose CUDA-graph forward is a timed no-op on a simulated device, `--forward_ms` each).

The clients are one forked process driving `--sessions` unix-socket streams as corolla's socket client does (the
hello, an opening step of `--prompt` tokens with `max_length`, then one decode step each as soon as the last reply
came: Petals' args structure, `session_id`, a fresh `step_id`, `start_from_position`); its requests are built with
protobuf per step, its replies read and dropped. It is not the server's CPU and is not counted. `--transport p2p`:
the same sessions over hivemind's p2pd instead (a daemon of the server's, with the handler's rpcs registered as a
server registers them, `add_p2p_handlers`, and a spawned client process with a daemon of its own writing each stream
as a stock Petals stub does, hivemind's framing); the daemons' CPU is not counted either, but they share the machine.

The process runs with a GPU server's GIL switch interval (`engine_executor.shorten_gil_switch_interval`). Timed
over the decode phase (from all sessions' prefill done to the last reply), `--repeats` runs after one untimed
warm-up, each run a fresh server and client process: the serving loop thread's and the runtime thread's own CPU clocks,
per step (and the runtime's per merged forward), forwards per step, the wall time per step; medians over runs.
`--profile FILE`: cProfile of the serving loop thread (thread CPU clock) over the last run, its top functions
printed. `--split`: one more run whose loop CPU is split by what the loop ran (each handle's callback timed with the
thread's CPU clock: a task woken by its step's output, another wake-up of a task, a socket's read (with callback-driven
steps: the step's intake), the runtime's delivery of a batch's outputs (`settle`: the steps' replies written in
it), the rest)
and timed in a few functions on a step's way (`SPLIT_FUNCTIONS`); the timers add ~1 us a call, so that run is
reported apart. Compare two trees by running this file from each (`PYTHONPATH=<tree>/src`), alternated.
The gather rule's state over the decode phase (decision 0125): each run reports the share of its forwards whose launch
was held, the rows a forward, the learned return and the last forward at its end, and a trace of them every TRACE_S;
`--seed_return_ms` sets the learned return at the decode phase's start (low: held; high: at once) and
`--forward_row_ms` makes a forward longer by its rows, as a card's (H200, 32 layers: ~3.3 + 0.08 ms a row).
The garbage collector's pauses over the decode phase (`gc.callbacks`, any thread): their count, the full (generation
2) ones, the longest and their sum per step. What the process made before its sessions come is frozen out of the
full passes as a server does once online (`utils.long_lived.freeze_long_lived`, decision 0141; thawed after the run);
`--no_freeze` leaves it in them (a server before 169c41a6)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import cProfile
import functools
import gc
import importlib
import io
import json
import math
import multiprocessing
import os
import pstats
import selectors
import socket
import statistics
import tempfile
import time
import traceback
import uuid
from multiprocessing.connection import Connection
from pathlib import Path
from unittest import mock

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from benchmarks.common.measure import cpu_timed, thread_cpu_s
from benchmarks.field.verify_cost import standin_backend
from benchmarks.users.device_cpu import SPEC, simulated_engine
from corolla.protocol import local_stream as ls
from corolla.protocol.codecs import serialize_tensor
from corolla.protocol.metadata import encode_metadata
from corolla.protocol.stream_frames import END_OF_STREAM_FRAME, FRAME_HEADER_BYTES, MESSAGE_MARKER, frame_header
from corolla.server.core.engine_executor import EngineExecutor, shorten_gil_switch_interval
from corolla.server.core.limits import PeerLimits, SessionTimeouts
from corolla.server.core.runtime import Runtime
from corolla.server.core.span_core import SpanCore
from corolla.server.front.block_functions import PETALS_STEP_STRUCTURE, ServingLimits
from corolla.server.front.handler import TransformerConnectionHandler
from corolla.server.front.local_endpoint import LocalEndpoint
from corolla.server.metrics import ServerMetrics
from corolla.utils.long_lived import freeze_long_lived, thaw_long_lived
from corolla.utils.tensor_bytes import TensorBytes

# (module, owner attribute or "", function): timed by `--split` where the tree has them
SPLIT_FUNCTIONS = (
    ("corolla.server.front.block_functions", "", "decode_step"),
    ("corolla.server.front.block_functions", "", "bytes_finite"),
    ("corolla.protocol.metadata", "InferenceRequestMetadata", "from_bytes"),
    ("corolla.server.front.inference_stream", "InferenceStreams", "_serialize_output"),
    ("corolla.protocol.handoff", "", "step_response"),
    ("corolla.server.core.engine_executor", "EngineExecutor", "prepare_step"),
    ("corolla.server.core.engine_executor", "EngineExecutor", "step_task"),
    ("corolla.server.core.runtime", "Runtime", "queue"),
    ("corolla.server.front.stream_endpoint", "FrameConnection", "take_frame"),
    ("corolla.server.core.peer_bytes", "StreamLease", "charge"),
    ("corolla.server.front.stream_endpoint", "SocketPort", "_request"),
    ("corolla.server.front.stream_endpoint", "SocketPort", "reply"),
    ("corolla.server.front.stream_endpoint", "SocketPort", "reply_joined"),  # the usual step's reply (decision 0146)
    ("corolla.server.front.inference_stream", "StepOrder", "_wait"),
)
TRACE_S = 0.2  # the gather rule's state is sampled this often over the decode phase (`_trace_rule`)
PEER = PeerID(b"\x12\x20" + bytes(range(32)))
DHT_PREFIX = "bench"
MAX_REPLY_BYTES = 1 << 24
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
P2P_FLAGS = dict(nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)


def _request(record: runtime_pb2.Tensor, empty: runtime_pb2.Tensor, metadata: dict) -> bytes:
    return runtime_pb2.ExpertRequest(
        uid=f"{DHT_PREFIX}.0", tensors=[record, empty, empty], metadata=encode_metadata(metadata)
    ).SerializeToString()


def _step_parts(hidden: bytes, prompt: int) -> tuple[runtime_pb2.Tensor, runtime_pb2.Tensor, runtime_pb2.Tensor, dict]:
    """A client's request parts, as a Petals stub sends them (both transports): the opening step's hidden states
    [1, prompt, H] and a decode step's [1, 1, H] (bf16, from `hidden`), the empty tensor of the prompts and hypo ids,
    and the metadata every step carries."""
    row = SPEC.hidden_size * 2
    prefill = runtime_pb2.Tensor(
        compression=0, buffer=hidden[: prompt * row], size=(1, prompt, SPEC.hidden_size), dtype="bfloat16"
    )
    decode = runtime_pb2.Tensor(compression=0, buffer=hidden[:row], size=(1, 1, SPEC.hidden_size), dtype="bfloat16")
    common = {"points": 0.0, "active_adapter": "", "args_structure": PETALS_STEP_STRUCTURE}
    return prefill, decode, serialize_tensor(torch.empty(0)), common


class _Session:
    """One client stream: its socket, what it has read, its position and the steps it has left."""

    def __init__(self, sock: socket.socket, session_id: str, steps: int, position: int):
        self.sock, self.session_id, self.left, self.position = sock, session_id, steps, position
        self.buf = bytearray()

    def reply(self) -> int | None:
        """The kind of the next whole frame read (None: not whole yet)."""
        if len(self.buf) < ls.HEADER_BYTES:
            return None
        kind, length = ls.parse_header(bytes(self.buf[: ls.HEADER_BYTES]), MAX_REPLY_BYTES)
        if len(self.buf) < ls.HEADER_BYTES + length:
            return None
        if kind == ls.ERROR:
            raise RuntimeError(f"the server refused: {bytes(self.buf[ls.HEADER_BYTES : ls.HEADER_BYTES + length])!r}")
        del self.buf[: ls.HEADER_BYTES + length]
        return kind


def _send(sock: socket.socket, kind: int, payload: bytes) -> None:
    sock.setblocking(True)
    sock.sendall(b"".join(ls.frame(kind, payload)))
    sock.setblocking(False)


def _run_until_replied(sel: selectors.BaseSelector, sessions: list[_Session], on_reply) -> None:
    """Reads every session's replies, calling `on_reply(session)` for each, until no session waits for one."""
    waiting = len(sessions)
    while waiting:
        for key, _ in sel.select():
            s: _Session = key.data
            chunk = s.sock.recv(1 << 20)
            if not chunk:
                raise RuntimeError("the server closed a stream")
            s.buf += chunk
            while s.reply() is not None:
                if not on_reply(s):
                    waiting -= 1


def client(path: str, sessions: int, prompt: int, steps: int, hidden: bytes, control: int) -> None:
    """The forked client process (the module docstring); writes b"S" to `control` when every session has prefilled
    and b"E" after the last decode reply."""
    prefill, decode, empty, common = _step_parts(hidden, prompt)
    sel = selectors.DefaultSelector()
    streams = []
    for _ in range(sessions):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        s = _Session(sock, str(uuid.uuid4()), steps, prompt)
        _send(sock, ls.HELLO, ls.LocalHello(rpc="rpc_inference", peer_id=PEER.to_base58()).to_bytes())
        streams.append(s)
        sel.register(sock, selectors.EVENT_READ, s)
    _run_until_replied(sel, streams, lambda s: False)  # every ACCEPT
    for s in streams:
        md = {"session_id": s.session_id, "step_id": str(uuid.uuid4()), "start_from_position": 0,
              "max_length": prompt + steps + 1, **common}  # fmt: skip
        _send(s.sock, ls.MESSAGE, _request(prefill, empty, md))
    _run_until_replied(sel, streams, lambda s: False)  # every prefill's reply
    os.write(control, b"S")

    def step(s: _Session) -> None:
        md = {"session_id": s.session_id, "step_id": str(uuid.uuid4()), "start_from_position": s.position, **common}
        _send(s.sock, ls.MESSAGE, _request(decode, empty, md))
        s.position += 1
        s.left -= 1

    def replied(s: _Session) -> bool:
        if s.left == 0:
            return False
        step(s)
        return True

    for s in streams:
        step(s)
    _run_until_replied(sel, streams, replied)
    os.write(control, b"E")
    for s in streams:
        _send(s.sock, ls.END, b"")
        s.sock.close()


class Split:
    """`--split`'s timers (the module docstring): thread CPU nanoseconds by handle kind and by function, counted
    while `on`. Installed by patching `asyncio.events.Handle._run` and the functions; `remove` puts them back."""

    def __init__(self) -> None:
        self.on = False
        self.handles: collections.Counter[str] = collections.Counter()
        self.functions: collections.Counter[str] = collections.Counter()
        self._undo: list[tuple[object, str, object]] = []
        run = asyncio.events.Handle._run
        split = self

        def timed_run(handle: asyncio.Handle) -> None:
            if not split.on:
                return run(handle)
            began = time.thread_time_ns()
            try:
                return run(handle)
            finally:
                split.handles[_handle_kind(handle)] += time.thread_time_ns() - began

        self._patch(asyncio.events.Handle, "_run", timed_run)
        for module_name, owner_name, name in SPLIT_FUNCTIONS:
            owner = importlib.import_module(module_name)
            owner = getattr(owner, owner_name) if owner_name else owner
            if name in vars(owner):
                label = f"{owner_name or module_name}.{name}"
                self._patch(owner, name, cpu_timed(vars(owner)[name], label, lambda: self.functions, lambda: self.on))

    def _patch(self, owner: object, name: str, value: object) -> None:
        self._undo.append((owner, name, vars(owner)[name]))
        setattr(owner, name, value)

    def remove(self) -> None:
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)

    def enable(self) -> None:
        self.on = True

    def disable(self) -> None:
        self.on = False

    def report(self, steps: int) -> dict:
        def per_step(counter: collections.Counter[str]) -> dict[str, float]:
            return {k: round(v / steps / 1e3, 2) for k, v in counter.most_common()}

        return {"handles_us_per_step": per_step(self.handles), "functions_us_per_step": per_step(self.functions)}


def _handle_kind(handle: asyncio.Handle) -> str:
    """What a loop callback is, for `Split`: a task's wake-up by a step's output, another task wake-up, a socket read,
    else the callback's own name."""
    callback = handle._callback  # type: ignore[attr-defined]
    if isinstance(callback, functools.partial):  # (a done callback's, e.g. a remote core's `SessionSteps._stepped`)
        callback = callback.func
    name = getattr(callback, "__qualname__", type(callback).__name__)
    if "wakeup" not in name:
        return "socket read" if name.endswith("_read_ready") else name
    args = handle._args
    future = args[0] if args else None
    if isinstance(future, asyncio.Future) and future.done() and not future.cancelled() and not future.exception():
        if isinstance(future.result(), (TensorBytes, torch.Tensor)):
            return "task woken by its step's output"
    return "task woken otherwise (a frame, ...)"


class _SocketTransport:
    """The same-host socket (`LocalEndpoint`) and its forked client process (`client`)."""

    def __init__(self, endpoint: LocalEndpoint, pid: int, control_fd: int):
        self.endpoint, self.pid, self.control_fd = endpoint, pid, control_fd

    @classmethod
    async def start(
        cls, handler: TransformerConnectionHandler, args: argparse.Namespace, hidden: bytes, directory: Path
    ) -> _SocketTransport:
        endpoint = LocalEndpoint(handler, PEER, directory=directory)
        assert await endpoint.start() and endpoint.path is not None
        control_r, control_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the client process
            os.close(control_r)
            try:
                client(str(endpoint.path), args.sessions, args.prompt, args.steps, hidden, control_w)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(0)
        os.close(control_w)
        return cls(endpoint, pid, control_r)

    def read_mark(self) -> bytes:
        return os.read(self.control_fd, 1)

    async def stop(self) -> None:
        os.close(self.control_fd)
        await self.endpoint.stop()
        await asyncio.get_running_loop().run_in_executor(None, os.waitpid, self.pid, 0)


class _P2PTransport:
    """hivemind's p2pd (a daemon of the server's and one of the client's) and the spawned client process
    (`p2p_client`): the server's `rpc_inference` streams as registered for p2p (`add_p2p_handlers`)."""

    def __init__(self, p2p: P2P, process: multiprocessing.process.BaseProcess, control: Connection):
        self.p2p, self.process, self.control = p2p, process, control
        self.control_fd = control.fileno()

    @classmethod
    async def start(
        cls, handler: TransformerConnectionHandler, args: argparse.Namespace, hidden: bytes
    ) -> _P2PTransport:
        p2p = await P2P.create(host_maddrs=LOOPBACK, **P2P_FLAGS)
        await handler.add_p2p_handlers(p2p)
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        context = multiprocessing.get_context("spawn")  # (a fresh interpreter: no inherited loop or daemon)
        control_r, control_w = context.Pipe(duplex=False)
        process = context.Process(
            target=p2p_client,
            args=(maddrs, p2p.peer_id.to_base58(), f"{type(handler).__name__}.rpc_inference", args.sessions,
                  args.prompt, args.steps, hidden, control_w),
        )  # fmt: skip
        process.start()
        control_w.close()
        return cls(p2p, process, control_r)

    def read_mark(self) -> bytes:
        try:
            return self.control.recv_bytes()
        except EOFError:
            return b""

    async def stop(self) -> None:
        self.control.close()
        await asyncio.get_running_loop().run_in_executor(None, self.process.join)
        await self.p2p.shutdown()


def p2p_client(
    maddrs: list[str], server: str, handle: str, sessions: int, prompt: int, steps: int, hidden: bytes,
    control: Connection,
) -> None:  # fmt: skip
    """The spawned p2p client process: `client`'s sessions over p2pd streams (hivemind's framing, as a stock Petals
    client's stub writes it); sends b"S" to `control` when every session has prefilled and b"E" after the last
    decode reply."""
    try:
        asyncio.run(_p2p_sessions(maddrs, server, handle, sessions, prompt, steps, hidden, control))
    finally:
        control.close()


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
    writer.write(frame_header(MESSAGE_MARKER, len(body)) + body)
    header = await reader.readexactly(FRAME_HEADER_BYTES)
    payload = await reader.readexactly(int.from_bytes(header[1:], "big"))
    if header[0] != MESSAGE_MARKER:
        raise RuntimeError(f"the server refused: {RPCError.FromString(payload).message}")


async def _p2p_sessions(
    maddrs: list[str], server: str, handle: str, sessions: int, prompt: int, steps: int, hidden: bytes,
    control: Connection,
) -> None:  # fmt: skip
    prefill, decode, empty, common = _step_parts(hidden, prompt)
    p2p = await P2P.create(initial_peers=maddrs, host_maddrs=LOOPBACK, **P2P_FLAGS)
    try:
        peer = PeerID.from_base58(server)
        streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        for _ in range(sessions):
            _, reader, writer = await p2p.call_binary_stream_handler(peer, handle)
            streams.append((reader, writer))
        ids = [str(uuid.uuid4()) for _ in range(sessions)]

        async def opening(i: int) -> None:
            md = {"session_id": ids[i], "step_id": str(uuid.uuid4()), "start_from_position": 0,
                  "max_length": prompt + steps + 1, **common}  # fmt: skip
            await _exchange(streams[i][0], streams[i][1], _request(prefill, empty, md))

        async def decoding(i: int) -> None:
            for position in range(prompt, prompt + steps):
                md = {"session_id": ids[i], "step_id": str(uuid.uuid4()), "start_from_position": position, **common}
                await _exchange(streams[i][0], streams[i][1], _request(decode, empty, md))

        await asyncio.gather(*(opening(i) for i in range(sessions)))
        control.send_bytes(b"S")
        await asyncio.gather(*(decoding(i) for i in range(sessions)))
        control.send_bytes(b"E")
        for _, writer in streams:
            writer.write(END_OF_STREAM_FRAME)
            await writer.drain()
            writer.close()
    finally:
        await p2p.shutdown()


def _ms(seconds: float | None) -> float:
    return math.nan if seconds is None else 1e3 * seconds


async def _trace_rule(runtime: Runtime, trace: list[dict]) -> None:
    """Samples the gather rule every TRACE_S until cancelled: the share of the forwards since the last sample whose
    launch was held, their rows, the learned return and the last forward (ms)."""

    def counts() -> tuple[int, int, int]:
        stats = runtime.stats().values()
        return runtime.num_held_launches, sum(s.batches for s in stats), sum(s.tasks for s in stats)

    before = counts()
    while True:
        await asyncio.sleep(TRACE_S)
        now = counts()
        held, forwards, rows = (b - a for a, b in zip(before, now, strict=True))
        before = now
        trace.append({"held": round(held / max(1, forwards), 2), "rows": round(rows / max(1, forwards), 1),
                      "return_ms": round(_ms(runtime.gather.return_s), 2),
                      "forward_ms": round(_ms(runtime.gather.forward_s), 2)})  # fmt: skip


class GcPauses:
    """The collector's pauses while `on` (`gc.callbacks`: each collection's generation and wall seconds)."""

    def __init__(self) -> None:
        self.on = False
        self.pauses: list[tuple[int, float]] = []
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self.on:
            self.pauses.append((info["generation"], time.perf_counter() - self._started))

    def remove(self) -> None:
        gc.callbacks.remove(self._callback)

    def report(self, steps: int) -> dict:
        seconds = [s for _, s in self.pauses]
        return {"gc_pauses": len(seconds), "gc_full": sum(g == 2 for g, _ in self.pauses),
                "gc_max_ms": 1e3 * max(seconds, default=0.0), "gc_us_per_step": 1e6 * sum(seconds) / steps}  # fmt: skip


def run_once(args: argparse.Namespace, profile: cProfile.Profile | Split | None) -> dict:
    """One fresh server and client process; the decode phase's figures (the module docstring)."""
    engine = simulated_engine(
        args.sessions, args.prompt + args.steps + 1, args.forward_ms / 1e3, args.forward_row_ms / 1e3
    )
    backend = standin_backend(SPEC, 1, torch.device("cpu"))
    hidden = (torch.randn(args.prompt, SPEC.hidden_size, generator=torch.Generator().manual_seed(1)) / 4).to(
        torch.bfloat16
    )
    hidden_bytes = hidden.view(torch.int16).numpy().tobytes()
    limits = ServingLimits(DHT_PREFIX, 0, 1, SPEC.hidden_size, torch.bfloat16, 4096, 4096)
    timeouts = SessionTimeouts(step_timeout_s=300.0, session_timeout_s=3600.0, request_timeout_s=300.0)
    stream = engine.graphs.stream  # type: ignore[union-attr]
    with (
        tempfile.TemporaryDirectory(prefix="front-cpu-") as directory,
        contextlib.ExitStack() as stack,
    ):
        os.chmod(directory, 0o700)
        # (as device_cpu: the simulated stream stands in for CUDA's)
        stack.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda device=None: stream))
        runtime = stack.enter_context(Runtime(max_batch_size_tokens=4096, device="cpu"))
        executor = EngineExecutor(backend, engine, runtime)  # type: ignore[arg-type]
        # every session comes from one peer here (the same host's): no per-peer share of sessions or KV
        core = SpanCore(executor, PeerLimits(max_sessions_per_peer=0, max_kv_fraction_per_peer=1.0))
        handler = TransformerConnectionHandler(limits=limits, core=core, timeouts=timeouts, metrics=ServerMetrics())

        async def main() -> dict:
            loop = asyncio.get_running_loop()
            transport: _SocketTransport | _P2PTransport
            if args.transport == "p2p":
                transport = await _P2PTransport.start(handler, args, hidden_bytes)
            else:
                transport = await _SocketTransport.start(handler, args, hidden_bytes, Path(directory))
            marks: dict[bytes, tuple[float, float, float, int, int]] = {}
            ended = loop.create_future()
            gather = runtime.gather
            trace: list[dict] = []  # the gather rule's state every TRACE_S of the decode phase
            held_at_go = 0
            if not args.no_freeze:
                freeze_long_lived()  # as a server once online (its sessions come after)

            def on_control() -> None:
                nonlocal held_at_go
                mark = transport.read_mark()
                if mark == b"S":  # the decode phase starts from the seeded state (a float set: atomic under the GIL)
                    if args.seed_return_ms is not None:
                        gather.return_s = args.seed_return_ms / 1e3
                    held_at_go = runtime.num_held_launches
                    trace_task.append(loop.create_task(_trace_rule(runtime, trace)))
                pauses.on = mark == b"S"
                if mark == b"S" and profile is not None:
                    profile.enable()
                if mark == b"E" and profile is not None:
                    profile.disable()
                batches = sum(s.batches for s in runtime.stats().values())
                marks[mark] = (time.thread_time(), thread_cpu_s(runtime.thread), time.perf_counter(),
                               batches, executor.inference_tokens)  # fmt: skip
                if mark in (b"E", b"") and not ended.done():
                    ended.set_result(None)

            trace_task: list[asyncio.Task] = []
            pauses = GcPauses()
            try:
                loop.add_reader(transport.control_fd, on_control)
                await ended
            finally:
                pauses.remove()
                thaw_long_lived()
            loop.remove_reader(transport.control_fd)
            for task in trace_task:
                task.cancel()
            held = runtime.num_held_launches - held_at_go
            await asyncio.sleep(0.2)  # the client's END frames
            await transport.stop()
            if b"S" not in marks or b"E" not in marks:
                raise RuntimeError("the client process ended before its decode phase did")
            (l0, r0, w0, b0, t0), (l1, r1, w1, b1, t1) = marks[b"S"], marks[b"E"]
            steps = args.sessions * args.steps
            if t1 - t0 != steps:
                raise RuntimeError(f"{t1 - t0} decode rows ran, {steps} expected")
            forwards = b1 - b0
            return {
                "loop_us_per_step": 1e6 * (l1 - l0) / steps, "runtime_us_per_step": 1e6 * (r1 - r0) / steps,
                "runtime_us_per_forward": 1e6 * (r1 - r0) / max(1, forwards), "forwards_per_step": forwards / args.steps,
                "wall_ms_per_step": 1e3 * (w1 - w0) / args.steps, "rows_per_forward": (t1 - t0) / max(1, forwards),
                "held_share": held / max(1, forwards), "return_ms": _ms(gather.return_s),
                "rule_forward_ms": _ms(gather.forward_s), **pauses.report(steps), "trace": trace,
            }  # fmt: skip

        return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--forward_ms", type=float, default=6.0, help="the simulated device's time per forward")
    p.add_argument(
        "--forward_row_ms", type=float, default=0.0, help="the simulated forward's time a row beyond --forward_ms (an "
        "H200 at 32 Llama-3-8B layers: ~0.08, 3.3 + 0.08 x rows: 5.0 ms at 21 rows, 5.9 at 32)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", type=Path, default=None, help="cProfile of the serving loop (last run) to FILE")
    p.add_argument("--split", action="store_true", help="one more run, its loop CPU split (the module docstring)")
    p.add_argument(
        "--transport",
        choices=("socket", "p2p"),
        default="socket",
        help="the same-host socket, or p2p through hivemind's p2pd (a daemon each side)",
    )
    p.add_argument(
        "--seed_return_ms", type=float, default=None, help="the gather rule's learned return set to this at the decode "
        "phase's start (below the forward: launches held; above: at once), to see whether the state it settles in "
        "depends on where it started",
    )  # fmt: skip
    p.add_argument(
        "--no_freeze", action="store_true", help="leave what the process made to start in the collector's full "
        "passes (a server before 169c41a6: decision 0141)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    shorten_gil_switch_interval()  # as a GPU server's process does: the serving loop and the device thread share it
    run_once(args, None)  # warm-up
    profile = None if args.profile is None else cProfile.Profile(time.thread_time)
    runs = [run_once(args, profile if i == args.repeats - 1 else None) for i in range(args.repeats)]
    if profile is not None:
        profile.dump_stats(str(args.profile))
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue())
    split = None
    if args.split:
        timers = Split()
        try:
            split = {"loop_us_per_step": round(run_once(args, timers)["loop_us_per_step"], 2),
                     **timers.report(args.sessions * args.steps)}  # fmt: skip
        finally:
            timers.remove()
    result = {"transport": args.transport, "sessions": args.sessions, "forward_ms": args.forward_ms, "steps": args.steps,
              **{k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0] if k != "trace"},
              "runs": {k: [round(r[k], 2) for r in runs] for k in ("loop_us_per_step", "runtime_us_per_step",
                       "wall_ms_per_step", "rows_per_forward", "held_share", "return_ms", "gc_full",
                       "gc_max_ms")},
              "seed_return_ms": args.seed_return_ms, "traces": [r["trace"] for r in runs],
              "split": split}  # fmt: skip
    print(json.dumps(result), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "front_cpu.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
