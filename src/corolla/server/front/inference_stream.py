"""A front's inference streams (`rpc_inference`, on every transport) without a task per step: a session's state and
pushed steps, the order of its steps (`StepOrder`), how each runs (`SessionSteps`: decoded once by `block_functions`,
sent to the core through `CoreClient.step`, its reply written from the step's completion and pushed on), the
transport's end (`StepPort`), the registry of this front's streams and the KV hand-off of a draining server
(`SessionHandoff`)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from corolla.protocol import handoff as hw
from corolla.protocol import rpc
from corolla.protocol.auth import UPSTREAM_PEER_KEY
from corolla.protocol.codecs import (
    combine_parts,
    deserialize_tensor,
    record_frame,
    serialize_tensor,
    serialize_tensor_bytes,
)
from corolla.protocol.metadata import InferenceRequestMetadata, encode_metadata
from corolla.protocol.prefix import PREFIX_KEY
from corolla.protocol.shadow import parse_shadow
from corolla.protocol.uids import make_chain
from corolla.server.core import kv_handoff as kv
from corolla.server.core.admission import SessionTicket
from corolla.server.core.executor import SessionCache, SessionOpen, SessionSpec, StepInputs
from corolla.server.core.limits import DuplicateStep, SessionEvicted, SessionTimeouts, peer_key
from corolla.server.core.push_guard import SessionPushGuard, mark_pushed_reply, screen_step
from corolla.server.core.refusals import Draining, RequestTimeout, rejection_reason
from corolla.server.core.span_core import CoreClient, DrainState
from corolla.server.front import block_functions as bf
from corolla.server.front import step_timeline
from corolla.server.front.block_functions import ServingLimits
from corolla.server.front.peer_auth import PeerAuth, gate_stream
from corolla.server.front.prefix_keys import PrefixTrust, client_keys, probe_keys, with_hit
from corolla.server.metrics import ServerMetrics
from corolla.utils.logging import get_logger
from corolla.utils.tensor_bytes import TensorBytes

logger = get_logger(__name__)


MAX_PUSH_QUEUE = 8  # pushed steps waiting per session; a session is driven one step at a time
# a session's pushes waiting for the downstream server's answer at most (an honest server answers at once: `rpc_push`
# queues the step; a session steps one at a time); beyond, a step's push is left out (`schedule_push`)
PUSH_IN_FLIGHT_MAX = 8


@dataclass
class SessionState:
    """Server-side state of one open `rpc_inference` stream."""

    session_id: str | None
    spec: SessionSpec  # its blocks, batch size and max_length (0: a probe)
    cache: SessionCache | None  # the executor's cache of this session (None: a max_length=0 probe)
    active_adapter: str
    args_structure: object
    prefix_length: int = 0
    push_guard: SessionPushGuard | None = None  # what pushed steps may do (None: none runs); push_guard.screen_step
    seen_step_ids: set[str] = field(default_factory=set)
    direct_step_ids: set[str] = field(default_factory=set)  # steps the client itself sent (not only pushed)
    ticket: SessionTicket | None = None  # idle time and eviction (None: not admitted through `admission`)
    last_step_id: str | None = None
    last_output: runtime_pb2.Tensor | memoryview | None = None  # (a record, or its serialized bytes)
    resend_pending: bool = False  # the step being yielded is the client's re-send of a step already answered
    # sees the metadata of every request of the session's own client before it runs, also one skipped because its
    # pushed copy ran first (the client's prefix keys travel only on its own requests); ValueError ends the session
    on_client_request: Callable[[InferenceRequestMetadata], None] | None = None

    def record_output(self, metadata: InferenceRequestMetadata, output: runtime_pb2.Tensor | memoryview) -> None:
        """Keeps the last step's reply (its record, or the record's serialized bytes), to answer a client that re-sends
        that step."""
        self.last_step_id, self.last_output = metadata.step_id, output

    def resend_output(self, step_id: str | None) -> runtime_pb2.Tensor:
        """The reply to a re-sent step: the cached output if it is the last step, else DuplicateStep."""
        self.resend_pending = False
        if step_id is not None and step_id == self.last_step_id and self.last_output is not None:
            logger.info(f"rpc_inference.resent_step(session_id={self.session_id!r:.40}, step_id={step_id!r:.40})")
            output = self.last_output
            return output if isinstance(output, runtime_pb2.Tensor) else runtime_pb2.Tensor.FromString(output)
        raise DuplicateStep(
            f"step_id {step_id!r:.60} was already processed by this session and is not its last step; "
            f"a step can't be re-run in place: send it with a new step_id and start_from_position"
        )


class PushInbox:
    """Where the pushed steps of one stream's session wait, behind the session's guard: the core's push table hands
    each push here (`span_core.PushSink`), and the session's `inference_stream.StepOrder` is woken (`wake`)."""

    def __init__(self, session_id: str, guard: SessionPushGuard):
        self.session_id, self.guard = session_id, guard
        self.queue: asyncio.Queue = asyncio.Queue(MAX_PUSH_QUEUE)
        self.wake: Callable[[], None] | None = None  # the session's, once its steps run

    def __call__(self, request: runtime_pb2.ExpertRequest, sender: str | None) -> bool:
        """Queues a step pushed by peer `sender`; False if `sender` is not the upstream its client named, or the
        queue is full."""
        if not self.guard.accepts_push_from(sender):
            logger.info(
                f"sessions.push_refused(session_id={self.session_id!r:.40}, sender={str(sender)[-8:]}): not upstream"
            )
            return False
        try:
            self.queue.put_nowait(request)
        except asyncio.QueueFull:
            logger.debug(f"sessions.push_dropped(session_id={self.session_id!r:.40}): queue full")
            return False
        if self.wake is not None:
            self.wake()
        return True


MAX_REMEMBERED_STEP_IDS = 4096
EARLY_FIRE_S = 1e-4  # a timer firing this close before its time counts as on time (no re-arm for less)


class StepOrder:
    """Which step one `rpc_inference` session runs next, driven by callbacks (no task and no await per step).

    Its inputs are the client's requests, handed over one at a time as the session makes room (`client`; the transport
    is told: `ready`), and the steps other servers push (its `PushInbox`). Each is screened here: metadata decoded, a
    pushed step checked against the push rules (`screen_step`), the client's own shown to `on_client_request`, a step
    already processed skipped (it came both pushed and directly) or, re-sent by the client, answered again. A step that
    passes goes to `run`, one at a time (True: over, else `done` or `fail` is called); the client's request goes first.

    The session ends (`end(None)`) at an empty request or the end of the client's stream; after `step_timeout` since its
    last step that processed a token; with `TimeoutError` past its `deadline` (`time.monotonic()`) while it waits,
    `RequestTimeout` while a step runs, and its ticket's `SessionEvicted` once evicted. One timer per session, re-armed
    lazily when it fires early (deadlines only move later)."""

    def __init__(
        self,
        session: SessionState,
        timeouts: SessionTimeouts,
        deadline: float,
        inbox: PushInbox | None,
        *,
        run: Callable[[runtime_pb2.ExpertRequest, InferenceRequestMetadata], bool],
        ready: Callable[[], None],
        end: Callable[[BaseException | None], None],
    ):
        self.session, self.timeouts, self.deadline, self.inbox = session, timeouts, deadline, inbox
        self._run, self._ready, self._end = run, ready, end
        self._loop = asyncio.get_running_loop()
        self._client: runtime_pb2.ExpertRequest | None = None  # the client's request not taken yet (at most one)
        self._client_ended = False
        self._asked = False  # `ready` was called and no client request came since
        self._busy = False  # a step runs
        self.ended = False
        self._idle_since = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0
        self._evicted: asyncio.Future | None = None
        ticket = session.ticket
        if ticket is not None:
            self._evicted = asyncio.ensure_future(ticket.evicted.wait())
            self._evicted.add_done_callback(self._on_evicted)
        if inbox is not None:
            inbox.wake = self._wake

    def client(self, request: runtime_pb2.ExpertRequest | None) -> None:
        """The client's next request (None: its stream ended)."""
        if self.ended:
            return
        self._asked = False
        if request is None or not request.tensors:  # the end of the stream, or an empty request: the session ends
            self._client_ended = True
        else:
            assert self._client is None, "a client request came before the session had room for it"
            self._client = request
        self._next()

    def done(self) -> None:
        """The step handed to `run` is over (answered or skipped)."""
        self._busy = False
        self._next()

    def fail(self, error: BaseException) -> None:
        """Ends the session with `error` (a step's or the transport's)."""
        self._finish(error)

    def close(self) -> None:
        """Stops the timer and the eviction wait (the session is over, however it ended)."""
        self.ended = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._evicted is not None and not self._evicted.done():
            self._evicted.cancel()
        if self.inbox is not None:
            self.inbox.wake = None

    # ---- internals

    def _wake(self) -> None:
        if not self._busy and not self.ended:
            self._next()

    def _next(self) -> None:
        while not self._busy and not self.ended:
            ticket = self.session.ticket
            if ticket is not None and ticket.evicted.is_set():  # (a client whose next step is always there)
                return self._finish(_eviction(self.session))
            if self._client_ended:
                return self._finish(None)
            request = self._client
            if request is not None:
                self._client = None
            elif self.inbox is not None and not self.inbox.queue.empty():
                request = self.inbox.queue.get_nowait()
            else:
                return self._wait()
            self._busy = True
            try:
                if self._take(request):
                    self._busy = False
            except Exception as e:
                return self._finish(e)
        if self._busy and not self.ended:
            self._arm(self.deadline)

    def _take(self, request: runtime_pb2.ExpertRequest) -> bool:
        """Screens one request and runs it if it is a step to run: True once it is over."""
        session = self.session
        parsed = InferenceRequestMetadata.from_bytes(request.metadata)
        step_id = parsed.step_id
        guard = session.push_guard
        metadata: InferenceRequestMetadata | None = parsed
        # A session whose client named no upstream takes no push (every one is refused), so its guard has nothing to
        # learn from a step that names neither an upstream nor a next hop: the push rules stay off such a session's
        # steps (a lone client's, a stock Petals client's) until it names one
        if parsed.pushed or (
            guard is not None
            and (guard.upstream is not None or parsed.next_servers or UPSTREAM_PEER_KEY in parsed.extra)
        ):
            metadata = screen_step(  # learns from the client's own steps; None: a pushed step breaking the rules
                guard, request, parsed, prefix_length=session.prefix_length,
                args_structure=session.args_structure, already_seen=step_id in session.seen_step_ids,
            )  # fmt: skip
        if metadata is not None and not metadata.pushed and session.on_client_request is not None:
            session.on_client_request(metadata)
        if metadata is None:
            return True
        if step_id is None or step_id not in session.seen_step_ids:
            if step_id is not None:
                if len(session.seen_step_ids) >= MAX_REMEMBERED_STEP_IDS:
                    session.seen_step_ids.clear()
                    session.direct_step_ids.clear()
                session.seen_step_ids.add(step_id)
                if not metadata.pushed:
                    session.direct_step_ids.add(step_id)
            return self._run(request, metadata)
        if metadata.pushed:  # the client's own copy came first and was answered: no second reply
            return True
        if step_id not in session.direct_step_ids:  # its pushed copy came first and was answered
            session.direct_step_ids.add(step_id)
            return True
        session.resend_pending = True  # the client sent this step twice: answer it (Petals drops it)
        return self._run(request, metadata)

    def _wait(self) -> None:
        """Nothing to run: the timer guards the wait, and the transport may hand over the client's next request."""
        self._idle_since = time.monotonic()
        self._arm(self._wait_until())
        if not self._asked and not self._client_ended:
            self._asked = True
            self._ready()  # (may hand the request over at once: `client` runs inside)

    def _wait_until(self) -> float:
        """When a wait for the next step ends: `step_timeout` after the session's last real token (zero-token
        keep-alives are not activity), and never past `deadline`."""
        ticket = self.session.ticket
        since = self._idle_since if ticket is None else ticket.last_used_at
        return min(since + self.timeouts.step_timeout_s, self.deadline)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            if self._timer_when <= when:
                return  # fires early, then re-arms for `when`
            self._timer.cancel()
        self._timer, self._timer_when = self._loop.call_at(when, self._fired), when

    def _fired(self) -> None:
        self._timer = None
        if self.ended:
            return
        now = time.monotonic()
        when = self.deadline if self._busy else self._wait_until()
        if when > now + EARLY_FIRE_S:
            self._arm(when)
            return
        session, timeouts = self.session, self.timeouts
        if self._busy:
            return self._finish(
                RequestTimeout(f"inference session exceeded session_timeout={timeouts.session_timeout_s} s")
            )
        if now >= self.deadline:
            logger.info(f"rpc_inference.session_timeout(session_id={session.session_id!r:.40})")
            return self._finish(
                TimeoutError(f"inference session exceeded session_timeout={timeouts.session_timeout_s} s")
            )
        logger.info(
            f"rpc_inference.step_timeout(session_id={session.session_id!r:.40}, "
            f"step_timeout_s={timeouts.step_timeout_s}, session_timeout_s={timeouts.session_timeout_s})"
        )
        self._finish(None)

    def _on_evicted(self, _: asyncio.Future) -> None:
        if not self._busy and not self.ended:
            self._next()  # (a step running ends first; the session ends before the next)

    def _finish(self, error: BaseException | None) -> None:
        if self.ended:
            return
        self.close()
        self._end(error)


def _eviction(session: SessionState) -> SessionEvicted:
    """The error an evicted session ends with (its ticket's, set with the `evicted` event waited for)."""
    ticket = session.ticket
    assert ticket is not None and ticket.eviction is not None
    return ticket.eviction


class SessionRegistry:
    """The streams one front serves (ended on shutdown); which session a push goes to is the core's
    (`span_core.SpanCore.push`)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    @property
    def num_open(self) -> int:
        return len(self._tasks)

    def open(self) -> None:
        """Registers the current task as serving a session."""
        if self._closed:
            raise RuntimeError("The server is shutting down; it accepts no new sessions")
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)

    def close(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.discard(task)

    async def close_all(self, timeout_s: float = 5.0) -> None:
        """Ends every open session (their KV caches are freed by their own context managers)."""
        self._closed = True
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        logger.info(f"sessions.closed_all(count={len(tasks)})")


class SessionHandoff:
    """A front's view of the drain (the core's `DrainState`) and the two hand-off operations (export, import) on its
    sessions."""

    def __init__(self, core: CoreClient, request_timeout_s: float, *, enabled: bool = True):
        self.core = core  # the sessions' caches: read and written through the one seam
        self.request_timeout_s = request_timeout_s  # an import's part messages must all arrive within this
        self.enabled = enabled  # --no_kv_handoff: neither export nor import (draining still refuses new sessions)
        self.drain: DrainState = core.drain  # the core's: started by `drain_sessions`
        self.num_exported = 0
        self.num_imported = 0
        self._exported: set[int] = set()  # id() of sessions already exported (no new sessions while draining)

    def import_header(self, metadata: InferenceRequestMetadata) -> hw.KvHeader | None:
        """The `KvHeader` of a session opened with an imported cache, None for a plain session; ValueError if bad."""
        raw = metadata.extra.get(hw.IMPORT_KEY)
        if raw is None:
            return None
        if not self.enabled:
            raise ValueError("this server does not accept KV imports (--no_kv_handoff)")
        return hw.KvHeader.from_dict(raw)

    # ---- export (draining server -> its own client, on the session's stream)

    async def export(self, session: SessionState) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The header message, then the part messages of the session's cache; one error message if it can't."""
        started = time.perf_counter()
        try:
            header, messages = await self._export_messages(session)
        except Exception as e:  # unsupported, not draining, runtime gone: the client replays instead
            logger.info(f"handoff.export_refused(session_id={session.session_id!r:.40}): {e}")
            yield runtime_pb2.ExpertResponse(metadata=encode_metadata({hw.KV_HEADER_KEY: {"error": str(e)}}))
            return
        yield runtime_pb2.ExpertResponse(metadata=encode_metadata({hw.KV_HEADER_KEY: header.to_dict()}))
        for parts in messages:
            yield runtime_pb2.ExpertResponse(tensors=parts)
        self.num_exported += 1
        logger.info(
            f"handoff.exported(session_id={session.session_id!r:.40}, position={header.position}, "
            f"bytes={header.total_bytes}, messages={header.num_messages}, "
            f"seconds={time.perf_counter() - started:.4f})"
        )

    async def _export_messages(self, session: SessionState) -> tuple[hw.KvHeader, list[list[runtime_pb2.Tensor]]]:
        if not self.enabled:
            raise kv.HandoffUnsupported("KV hand-off is disabled on this server (--no_kv_handoff)")
        if not self.drain.draining:
            raise ValueError("a session's KV cache is exported only while the server drains")
        if id(session) in self._exported:
            raise ValueError("this session's KV cache was already exported")
        position = session.prefix_length
        if position < 1 or session.cache is None:
            raise ValueError("the session holds no tokens to export")
        self.core.handoff_layout(session.cache.spec)  # HandoffUnsupported: the client replays
        self._exported.add(id(session))
        tensors = await self.core.read_kv(session.cache, position)
        messages = hw.pack_messages(serialize_tensor(t) for t in tensors)
        header = hw.KvHeader(
            position=position,
            batch_size=session.spec.batch_size,
            start_block=session.spec.block_indices[0],
            end_block=session.spec.block_indices[-1] + 1,
            num_messages=len(messages),
            total_bytes=sum(hw.message_bytes(m) for m in messages),
        )
        return header, messages

    # ---- import (client -> replacement server, first messages of a new stream)

    async def import_kv(
        self,
        session: SessionState,
        header: hw.KvHeader,
        uid: str,
        requests: AsyncIterator[runtime_pb2.ExpertRequest],
        *,
        peer: str,
    ) -> None:
        """Reads `header.num_messages` part messages from the stream, validates them against this session's own
        cache layout (exact bytes, shapes, dtypes, finite values) and writes them; the session then starts at
        `header.position`. ValueError (nothing written) on any mismatch or past `request_timeout_s`; a
        `LimitExceeded` before any part is read where `peer`'s imports in flight on the server, or all, would pass
        their bytes (`CoreClient.hold_import`: the core counts every front's)."""
        started = time.perf_counter()
        spec, blocks = session.spec, session.spec.block_indices
        if (header.batch_size, header.start_block, header.end_block) != (spec.batch_size, blocks[0], blocks[-1] + 1):
            raise ValueError(
                f"KV import is for batch {header.batch_size}, blocks {header.start_block}:{header.end_block}; "
                f"this session has batch {spec.batch_size}, blocks {blocks[0]}:{blocks[-1] + 1}"
            )
        if header.position > spec.max_length_tokens:
            raise ValueError(
                f"KV import of {header.position} tokens exceeds the session's max_length {spec.max_length_tokens}"
            )
        if session.cache is None:
            raise ValueError("a KV import needs a session with max_length > 0")
        descriptors = self.core.handoff_layout(session.cache.spec)  # HandoffUnsupported: the client replays
        expected = kv.canonical_nbytes(descriptors, header.position)
        if header.total_bytes != expected:
            raise ValueError(f"KV import announces {header.total_bytes} bytes; {header.position} tokens are {expected}")
        async with self.core.hold_import(peer, expected):  # (held in this process's memory until written)
            parts = await self._read_parts(header, uid, requests, expected)
            tensors = [deserialize_tensor(t) for t in combine_parts(parts)]
            del parts
            kv.validate_import(tensors, descriptors, header.position)
            await self.core.write_kv(session.cache, tensors, header.position)
            del tensors
        session.prefix_length = header.position
        if session.ticket is not None:  # the imported positions are real work (done on the old server)
            session.ticket.touch(header.position * spec.batch_size)
        self.num_imported += 1
        logger.info(
            f"handoff.imported(session_id={session.session_id!r:.40}, blocks={blocks[0]}:{blocks[-1] + 1}, "
            f"position={header.position}, bytes={expected}, seconds={time.perf_counter() - started:.4f})"
        )

    async def _read_parts(
        self, header: hw.KvHeader, uid: str, requests: AsyncIterator[runtime_pb2.ExpertRequest], expected: int
    ) -> list[runtime_pb2.Tensor]:
        timeout_s = self.request_timeout_s
        deadline = time.monotonic() + timeout_s
        parts: list[runtime_pb2.Tensor] = []
        received = 0
        max_parts = header.max_parts
        for _ in range(header.num_messages):
            try:
                message = await asyncio.wait_for(requests.__anext__(), max(deadline - time.monotonic(), 0.001))
            except StopAsyncIteration:
                raise ValueError(f"KV import ended after {received} of {expected} bytes") from None
            except asyncio.TimeoutError:
                raise ValueError(f"KV import not complete within request_timeout={timeout_s} s") from None
            if message.uid != uid:
                raise ValueError("KV import messages must carry the session's uid")
            buffer_bytes = hw.message_bytes(message.tensors)
            received += buffer_bytes
            if received > expected:
                raise ValueError(f"KV import sent more than the {expected} bytes it announced")
            # (held until the last message is in, past the stream budget: nothing but parts, no more than it needs)
            if len(parts) + len(message.tensors) > max_parts:
                raise ValueError(f"KV import sent more than the {max_parts} parts its header allows")
            if not hw.part_message_fits(message, buffer_bytes):
                raise ValueError("KV import part messages hold nothing but the session's uid and tensor parts")
            parts.extend(message.tensors)
        if received != expected:
            raise ValueError(f"KV import sent {received} bytes, announced {expected}")
        return parts


def _opening_tokens(first: runtime_pb2.ExpertRequest) -> int:
    """Tokens the opening request of a session brings: its hidden states' length `[B, T, H]` (0 for none)."""
    size = list(first.tensors[0].size) if first.tensors else []
    return int(size[1]) if len(size) == 3 else 0


def _advance(session: SessionState, inputs: StepInputs) -> None:
    """The session moved past a step answered: its length, and its ticket's use."""
    meta = inputs.hidden_meta
    batch_size, length, _ = meta[1] if meta is not None else inputs.tensor().shape
    session.prefix_length = inputs.prefix_length + length
    if session.ticket is not None:
        session.ticket.touch(batch_size * length)  # zero-token keep-alives are not use


class StepPort(Protocol):
    """A transport's end of one `rpc_inference` stream once its session runs steps (`InferenceStreams.serve_steps`):
    where replies go, and how the client's next request is handed to the session's `StepOrder` (`client`)."""

    timeline: step_timeline.StreamTimeline | None  # the bench's stamps of the stream's steps (None: off)

    def attach(self, order: StepOrder, requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> None:
        """The session's steps begin: the client's requests go to `order` from now on (`requests`: the stream's, as
        the session opened from it, for a transport that reads them as messages)."""
        ...

    def ready(self) -> None:
        """The session has room for the client's next request: hand it to the order's `client`, now or later."""
        ...

    def reply(self, response: runtime_pb2.ExpertResponse | bytes) -> None:
        """Writes a response (a message, or its serialized bytes) to the client."""
        ...

    def reply_joined(self, parts: tuple[bytes | memoryview, ...], nbytes: int) -> memoryview:
        """Writes the serialized response `b"".join(parts)` (`nbytes` long) to the client and returns a view of its
        bytes as written: joined once, the frame's header with them where the transport sends them as they are
        (one buffer written, no second join by the transport)."""
        ...

    async def drain(self) -> None:
        """Waits while the replies written are not taken (a KV export's many messages)."""
        ...

    def detach(self) -> None:
        """The session ended: nothing more is handed over."""
        ...


class SessionSteps:
    """How one session runs the steps its `StepOrder` hands it (`run`), without a task per step: the first step's
    prefix probe, a draining server's KV export, a re-sent step's cached reply, else the step decoded once and sent to
    the core, its reply written from the step's completion (`_stepped`) and pushed on to the next server. `ended`
    is the session's end (its error, if any)."""

    def __init__(
        self, streams: InferenceStreams, session: SessionState, namespace: str, deadline: float, port: StepPort,
        *, probing: bool,
    ):  # fmt: skip
        self.streams, self.session, self.namespace, self.deadline, self.port = (
            streams,
            session,
            namespace,
            deadline,
            port,
        )
        self.probing = probing  # the first step may ask for a prefix hit
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.order: StepOrder | None = None
        self._in_flight: asyncio.Future | None = None
        # the step in flight (one at a time: `StepOrder`), what its reply needs once its output comes (`_stepped`,
        # bound once: the core calls it with the step's future; no partial built per step)
        self._step: tuple[runtime_pb2.ExpertRequest, InferenceRequestMetadata, int | None, StepInputs] | None = None
        self._then = self._stepped
        self._task: asyncio.Task[None] | None = None  # a prefix probe's or a KV export's

    def run(self, request: runtime_pb2.ExpertRequest, metadata: InferenceRequestMetadata) -> bool:
        """`StepOrder`'s `run`: True once the step is over, else `order.done()` follows."""
        if self.probing:
            self.probing = False
            if probe_keys(request, metadata) is not None:
                self._task = asyncio.get_running_loop().create_task(self._probe_and_run(request, metadata))
                return False
        return self._run(request, metadata, None)

    async def _probe_and_run(self, request: runtime_pb2.ExpertRequest, metadata: InferenceRequestMetadata) -> None:
        assert self.order is not None
        try:
            hit = await self.streams.attach_prefix(self.session, self.namespace, request, metadata)
            if self._run(request, metadata, hit):
                self.order.done()
        except Exception as e:
            self.order.fail(e)

    def _run(self, request: runtime_pb2.ExpertRequest, metadata: InferenceRequestMetadata, hit: int | None) -> bool:
        session = self.session
        if hw.EXPORT_KEY in metadata.extra:  # draining: the client moves the cache
            self._task = asyncio.get_running_loop().create_task(self._export())
            return False
        if session.resend_pending:  # the client re-sent a step: never leave it without an answer
            self.port.reply(runtime_pb2.ExpertResponse(tensors=[session.resend_output(metadata.step_id)]))
            return True
        try:
            inputs, output = self.streams.begin_step(session, metadata, request, self.deadline, self._then)
            if isinstance(output, asyncio.Future):
                if not output.done():  # the reply leaves from the step's completion (`_stepped`, in a later callback)
                    self._in_flight, self._step = output, (request, metadata, hit, inputs)
                    if (timeline := self.port.timeline) is not None:
                        timeline.stamp(step_timeline.SENT)
                    return False
                output = output.result()  # (a lone session's step ran inline: answered at once)
            self._answer(request, metadata, inputs, output, hit)
        except ValueError as e:
            self._bad_step(metadata, e)
        return True

    def _stepped(self, output: asyncio.Future) -> None:
        step, self._in_flight, self._step = self._step, None, None
        if (timeline := self.port.timeline) is not None:
            timeline.stamp(step_timeline.BACK)
        order = self.order
        assert order is not None
        if order.ended or output.cancelled():
            return
        assert step is not None, "a step's output came with no step in flight"
        request, metadata, hit, inputs = step
        try:
            try:
                self._answer(request, metadata, inputs, output.result(), hit)
            except ValueError as e:
                self._bad_step(metadata, e)
        except Exception as e:
            order.fail(e)
            return
        order.done()

    def _bad_step(self, metadata: InferenceRequestMetadata, error: ValueError) -> None:
        """A step's ValueError ends the session, unless the step was pushed: a bad push (from another server) must not
        end this client's session."""
        if not metadata.pushed:
            raise error
        logger.info(f"rpc_inference.bad_push_ignored(session_id={self.session.session_id!r:.40}): {error}")
        self.session.seen_step_ids.discard(metadata.step_id or "")

    def _answer(
        self, request: runtime_pb2.ExpertRequest, metadata: InferenceRequestMetadata, inputs: StepInputs,
        output: torch.Tensor | TensorBytes, hit: int | None,
    ) -> None:  # fmt: skip
        session = self.session
        if hit is None and not metadata.pushed and not metadata.next_servers:  # the response goes out as it is
            plain = self.streams.plain_step_reply(session, inputs, output)
            if plain is not None:
                parts, nbytes, offset = plain
                session.record_output(metadata, self.port.reply_joined(parts, nbytes)[offset:])
                return
        response, can_push = self.streams.step_reply(session, inputs, output)
        record = response.tensors[0]
        session.record_output(metadata, record)
        # (the guard learnt from a step of the session's own client when it was screened)
        guard = session.push_guard
        if can_push and metadata.next_servers and guard is not None and guard.may_push_on(metadata):
            self.streams.schedule_push(request, record, metadata)
        if metadata.pushed:
            response = mark_pushed_reply(response, metadata.start_from_position)
        self.port.reply(response if hit is None else with_hit(response, hit))

    async def _export(self) -> None:
        assert self.order is not None
        try:
            async for response in self.streams.handoff.export(self.session):
                self.port.reply(response)
                await self.port.drain()
        except Exception as e:
            self.order.fail(e)
            return
        self.order.done()

    def end(self, error: BaseException | None) -> None:
        """`StepOrder`'s `end`: the session is over (a step in flight is dropped: the runtime skips its row)."""
        self.close()
        if not self.ended.done():
            if error is None:
                self.ended.set_result(None)
            else:
                self.ended.set_exception(error)

    def close(self) -> None:
        if self._in_flight is not None:
            self._in_flight.cancel()
            self._in_flight = None
        task = self._task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()


class InferenceStreams:
    """The stream half of the front's RPC service (`handler.TransformerConnectionHandler` sets these attributes):
    `serve_steps`, every transport's `rpc_inference` stream, its steps, the pushes on and the refusals' one count."""

    limits: ServingLimits
    core: CoreClient  # the one seam to the core: in this process (`SpanCore`) or over a socket (`RemoteCore`)
    timeouts: SessionTimeouts
    compression: int
    metrics: ServerMetrics
    peer_auth: PeerAuth | None
    sessions: SessionRegistry  # this front's streams
    handoff: SessionHandoff  # drain (the core's state): refuses new sessions, moves KV
    prefix_trust: PrefixTrust  # whose cached prefixes a session reuses (the operator may share them all)
    p2p: P2P | None
    _push_tasks: set[asyncio.Task]
    _pushes_in_flight: dict[str, int]  # pushes not answered yet, by the session they push for (`schedule_push`)

    async def serve_steps(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext, port: StepPort
    ) -> None:
        """One `rpc_inference` stream: the session opened from its first request (read from `requests`, as a KV
        import's messages are), then its steps run by callbacks (`StepOrder`, `SessionSteps`) with the client's
        requests handed over by `port`, until the session ends (raising its error)."""
        started = time.monotonic()
        deadline = started + self.timeouts.session_timeout_s
        requests = gate_stream(self.peer_auth, "rpc_inference", requests, context).__aiter__()
        try:
            first = await asyncio.wait_for(requests.__anext__(), self.timeouts.step_timeout_s)
        except (asyncio.TimeoutError, StopAsyncIteration):
            logger.info("rpc_inference.no_first_request")
            return
        try:
            self.handoff.drain.check_accepting()  # Draining: no new sessions
            block_indices = bf.resolve_chain(first.uid, self.limits)
            metadata = InferenceRequestMetadata.from_bytes(first.metadata)
            kv_import = self.handoff.import_header(metadata)  # a session moved here from a draining server
            adapter = bf.validate_adapter(metadata.active_adapter, self.limits)
            push_guard = SessionPushGuard.from_open_request(metadata)  # who may push into it (ValueError: bad id)
            declared_batch = int(first.tensors[0].size[0]) if first.tensors and len(first.tensors[0].size) > 0 else 1
            max_length, batch_size = bf.validate_session_open(metadata.max_length, declared_batch, self.limits)
            shadow = parse_shadow(metadata.extra)  # a client's mirror of another server's session: it goes last
        except (ValueError, Draining) as e:
            self._reject("rpc_inference", e)
            raise

        logger.info(
            f"rpc_inference.open(blocks={block_indices[0]}:{block_indices[-1] + 1}, batch={batch_size}, "
            f"max_length={max_length}, session_id={metadata.session_id!r:.40})"
        )
        self.sessions.open()
        inbox = PushInbox(metadata.session_id, push_guard) if metadata.session_id is not None else None
        try:
            spec = SessionSpec(tuple(block_indices), batch_size, max_length, shadow=shadow)
            tokens: int | None = kv_import.position if kv_import is not None else _opening_tokens(first)
            if tokens == 0 and probe_keys(first, metadata) is not None:
                tokens = None  # a prefix probe: its tokens follow once the cached part is known
            opening = SessionOpen(peer_key(context), spec, metadata.alloc_timeout_s, metadata.session_id, tokens)
            # per-peer caps, what yields under pressure, then the KV cache itself (none for a max_length=0 probe)
            async with self.core.open_session(opening, inbox) as (ticket, cache):
                session = SessionState(
                    session_id=metadata.session_id,
                    spec=spec,
                    cache=cache,
                    active_adapter=adapter,
                    args_structure=metadata.args_structure,
                    push_guard=push_guard,  # peer_auth: what pushed steps may do
                    ticket=ticket,
                )
                if kv_import is not None:
                    await self.handoff.import_kv(session, kv_import, first.uid, requests, peer=peer_key(context))
                namespace = self.prefix_trust.namespace(peer_key(context), adapter)  # pushed steps: the owner's
                session.on_client_request = functools.partial(self._record_prefix_keys, session, namespace)
                steps = SessionSteps(self, session, namespace, deadline, port, probing=kv_import is None)
                order = steps.order = StepOrder(
                    session, self.timeouts, deadline, inbox, run=steps.run, ready=port.ready, end=steps.end
                )
                port.attach(order, requests)
                try:
                    order.client(first)  # the session's opening request
                    await steps.ended
                finally:
                    order.close()
                    steps.close()
                    port.detach()
        except Exception as e:
            self._reject("rpc_inference", e)
            raise
        finally:
            self.sessions.close()
            logger.info(
                f"rpc_inference.close(session_id={metadata.session_id!r:.40}, seconds={time.monotonic() - started:.2f})"
            )

    async def attach_prefix(
        self, session: SessionState, namespace: str, request: runtime_pb2.ExpertRequest,
        metadata: InferenceRequestMetadata,
    ) -> int | None:  # fmt: skip
        """The positions a session's first step reuses, if it asks (`prefix_keys.probe_keys`): the session then
        starts there. None for a first step that does not ask (a Petals client's)."""
        keys = probe_keys(request, metadata)
        if keys is None:
            return None
        hit = 0 if session.cache is None else await self.core.attach_prefix(session.cache, namespace, keys)
        session.prefix_length = hit
        if hit and session.ticket is not None:  # cached positions it starts with: real work, done before
            session.ticket.touch(hit * session.spec.batch_size)
        self.metrics.prefix_probe(keyed_tokens=keys.end_position, hit_tokens=hit)
        logger.debug(f"rpc_inference.prefix_hit(session_id={session.session_id!r:.40}, tokens={hit})")
        return hit

    def begin_step(
        self,
        session: SessionState,
        metadata: InferenceRequestMetadata,
        request: runtime_pb2.ExpertRequest,
        deadline: float,
        then: Callable[[asyncio.Future], None],
    ) -> tuple[StepInputs, torch.Tensor | TensorBytes | asyncio.Future]:
        """The step decoded (the one decoder: ValueError where it is refused) and sent to the core: its inputs and
        the future of its output (a zero-token step's or a probe session's: its own input, nothing computed), which
        runs `then(future)` in a later loop callback once done (not where it comes back done: `CoreClient.step`)."""
        structure = metadata.args_structure if metadata.args_structure is not None else session.args_structure
        inputs = bf.decode_step(
            request.tensors,
            structure,
            self.limits,
            session.spec,
            current_length=session.prefix_length,
            start_from_position=metadata.start_from_position,
            adapter=session.active_adapter,
            lone_session=self.sessions.num_open == 1,  # (a handler process's: the device checks its own count)
        )  # the session changes only once the step is valid
        meta = inputs.hidden_meta  # the usual step's record of its bytes (no tensor built), else the tensor's shape
        length = meta[1][1] if meta is not None else inputs.tensor().shape[1]
        if length == 0 or session.cache is None:
            return inputs, inputs.tensor()  # zero tokens: nothing to compute, [B, 0, H] back
        if deadline - time.monotonic() <= 0:
            raise RequestTimeout(f"inference session exceeded session_timeout={self.timeouts.session_timeout_s} s")
        return inputs, self.core.step(session.cache, inputs, then)

    def step_reply(
        self, session: SessionState, inputs: StepInputs, output: torch.Tensor | TensorBytes
    ) -> tuple[runtime_pb2.ExpertResponse, bool]:
        """The step's response (its output's record built in it: `_serialize_output`'s `into`), the session moved
        past the step, and whether its output may be pushed on."""
        drain_deadline = self.core.drain.deadline  # (while draining: the session's time left)
        response = hw.step_response(None if drain_deadline is None else drain_deadline - time.monotonic())
        self._serialize_output(output, into=response.tensors)
        _advance(session, inputs)
        return response, inputs.prompts is None

    def plain_step_reply(
        self, session: SessionState, inputs: StepInputs, output: torch.Tensor | TensorBytes
    ) -> tuple[tuple[bytes | memoryview, ...], int, int] | None:
        """`step_reply`'s response as (parts, length, record offset) of its serialized bytes, built without a message
        (`codecs.record_frame`, joined by `StepPort.reply_joined`): a launched step's bytes in the span's dtype, from
        a server that does not drain; None for any other output (`step_reply` builds those)."""
        drains = self.core.drain.deadline is not None
        if drains or not isinstance(output, TensorBytes) or output.dtype != self.limits.dtype:
            return None
        frame = record_frame(output.shape, output.dtype, self.compression)
        if frame is None:
            return None
        head, tail, offset = frame
        _advance(session, inputs)
        return (head, output.data, tail), len(head) + output.data.nbytes + len(tail), offset

    def _record_prefix_keys(self, session: SessionState, namespace: str, metadata: InferenceRequestMetadata) -> None:
        """Keys on a request of the session's own client (never a pushed one): its pages are published once
        computed, for later sessions of `namespace`. A client names a block's keys once, with the step that completes
        it: most decode steps carry none and never reach the trust rule."""
        if PREFIX_KEY not in metadata.extra:
            return
        keys = client_keys(metadata)
        if keys is not None and session.cache is not None:
            self.core.add_prefix_keys(session.cache, namespace, keys)

    def _serialize_output(
        self, output: torch.Tensor | TensorBytes, compression: int | None = None, into: Any = None
    ) -> runtime_pb2.Tensor:
        """The reply's tensor in the span's dtype: a launched step's bytes as they are (`TensorBytes`: one pass, no
        torch call), else the tensor's; added to `into` (a response's `tensors`: built there in place) where given."""
        compression = self.compression if compression is None else compression
        if isinstance(output, TensorBytes):
            if output.dtype == self.limits.dtype:
                return serialize_tensor_bytes(output, compression, into)
            output = output.tensor()
        if output.dtype != self.limits.dtype:
            output = output.to(self.limits.dtype)
        return serialize_tensor(output, compression, into)

    def schedule_push(
        self, request: runtime_pb2.ExpertRequest, output: runtime_pb2.Tensor, metadata: InferenceRequestMetadata
    ) -> None:
        """Pushes the step's `output` to the first of `metadata.next_servers` in a task, unless `PUSH_IN_FLIGHT_MAX`
        earlier pushes of this session still wait for their answers (a downstream peer holding its answers would hold
        a task and a stream here per step; the client sends the next server its own copy of every step, so a push left
        out costs latency, never correctness)."""
        if not metadata.next_servers or self.p2p is None:
            return
        key = metadata.session_id or ""
        in_flight = self._pushes_in_flight.get(key, 0)
        if in_flight >= PUSH_IN_FLIGHT_MAX:
            peer_id = metadata.next_servers[0].peer_id
            logger.info(f"rpc_push.skipped(peer={peer_id:.12}): {in_flight} pushes of the session not answered yet")
            return
        self._pushes_in_flight[key] = in_flight + 1
        task = asyncio.create_task(self._push_outputs(request, output, metadata))
        self._push_tasks.add(task)
        task.add_done_callback(functools.partial(self._push_done, key))

    def _push_done(self, key: str, task: asyncio.Task) -> None:
        self._push_tasks.discard(task)
        left = self._pushes_in_flight.get(key, 0) - 1
        if left > 0:
            self._pushes_in_flight[key] = left
        else:
            self._pushes_in_flight.pop(key, None)

    async def _push_outputs(
        self, request: runtime_pb2.ExpertRequest, output: runtime_pb2.Tensor, metadata: InferenceRequestMetadata
    ) -> None:
        hop, rest = metadata.next_servers[0], metadata.next_servers[1:]
        try:
            step_metadata = metadata.to_dict()
            step_metadata.update(session_id=hop.session_id, next_servers=[h.to_list() for h in rest], pushed=True)
            if self.peer_auth is not None:
                step_metadata.update(self.peer_auth.proof_metadata(hop.peer_id))
            pushed = runtime_pb2.ExpertRequest(
                uid=make_chain(self.limits.dht_prefix, hop.start, hop.end),
                tensors=[output, *request.tensors[1:]],
                metadata=encode_metadata(step_metadata),
            )
            if self.p2p is None:  # stopped meanwhile
                return
            if hop.peer_id == self.p2p.peer_id.to_base58():  # the next span is ours too: no network hop
                self.core.push(hop.session_id, pushed, sender=hop.peer_id)
                return
            stub = rpc.TransformerConnectionHandler.get_stub(self.p2p, PeerID.from_base58(hop.peer_id))
            await stub.rpc_push(pushed, timeout=self.timeouts.request_timeout_s)
        except Exception as e:
            logger.info(f"rpc_push.failed(peer={hop.peer_id:.12}): {e!r}")

    def _reject(self, name: str, error: BaseException) -> None:
        """Logs and counts a refused request by reason (`refusals.rejection_reason`: by the error's type): the one
        place a refusal becomes a metric and a log line."""
        reason = rejection_reason(error)
        self.metrics.rejected(reason)
        logger.info(f"{name}.rejected(reason={reason}): {error}")
