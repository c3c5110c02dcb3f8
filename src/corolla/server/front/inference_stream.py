"""A front's inference streams (`rpc_inference`, on every transport): the session a stream opens through the core
(`SessionState`: its cache, ticket, pushes and last reply), the inbox of its pushed steps, the registry of this front's
streams (ended on shutdown), the step iterator that merges client steps with pushed ones (de-duplicated by `step_id`)
under `step_timeout` (counted from the last step that processed a token) and `session_timeout`, the KV hand-off of a draining server's sessions (`SessionHandoff`), and each step decoded
once (`block_functions`), sent to the core through the one seam (`CoreClient.step`), answered and pushed on to the next
server. `InferenceStreams` is the stream half of `handler.TransformerConnectionHandler`."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from corolla.protocol import handoff as hw
from corolla.protocol import rpc
from corolla.protocol.auth import UPSTREAM_PEER_KEY
from corolla.protocol.codecs import combine_parts, deserialize_tensor, serialize_tensor, serialize_tensor_bytes
from corolla.protocol.metadata import InferenceRequestMetadata, encode_metadata
from corolla.protocol.prefix import PREFIX_KEY
from corolla.protocol.shadow import parse_shadow
from corolla.protocol.uids import make_chain
from corolla.server.core import kv_handoff as kv
from corolla.server.core.admission import SessionTicket
from corolla.server.core.executor import SessionCache, SessionSpec
from corolla.server.core.limits import DuplicateStep, SessionEvicted, SessionTimeouts, peer_key
from corolla.server.core.push_guard import SessionPushGuard, mark_pushed_reply, screen_step
from corolla.server.core.refusals import Draining, RequestTimeout, rejection_reason
from corolla.server.core.span_core import CoreClient, DrainState
from corolla.server.front import block_functions as bf
from corolla.server.front.block_functions import ServingLimits
from corolla.server.front.peer_auth import PeerAuth, gate_stream
from corolla.server.front.prefix_keys import PrefixTrust, client_keys, probe_keys, with_hit
from corolla.server.metrics import ServerMetrics
from corolla.utils.deadlines import TASK_DEADLINES, TaskDeadline
from corolla.utils.logging import get_logger
from corolla.utils.tensor_bytes import TensorBytes

logger = get_logger(__name__)

_T = TypeVar("_T")

MAX_PUSH_QUEUE = 8  # pushed steps waiting per session; a session is driven one step at a time
MAX_REMEMBERED_STEP_IDS = 4096


@dataclass
class SessionState:
    """Server-side state of one open `rpc_inference` stream."""

    session_id: str | None
    block_indices: list[int]
    batch_size: int
    max_length: int
    cache: SessionCache | None  # the executor's cache of this session (None: a max_length=0 probe)
    active_adapter: str
    args_structure: object
    prefix_length: int = 0
    started_at: float = field(default_factory=time.monotonic)
    push_queue: asyncio.Queue | None = None
    push_guard: SessionPushGuard | None = None  # what pushed steps may do (None: none runs); push_guard.screen_step
    seen_step_ids: set[str] = field(default_factory=set)
    direct_step_ids: set[str] = field(default_factory=set)  # steps the client itself sent (not only pushed)
    ticket: SessionTicket | None = None  # idle time and eviction (None: not admitted through `admission`)
    last_step_id: str | None = None
    last_output: runtime_pb2.Tensor | None = None
    resend_pending: bool = False  # the step being yielded is the client's re-send of a step already answered
    # the session's per-step waits (next request, step compute) in its stream's task: one lazily moved timer
    deadlines: TaskDeadline | None = None
    # sees the metadata of every request of the session's own client before it runs, also one skipped because its
    # pushed copy ran first (the client's prefix keys travel only on its own requests); ValueError ends the session
    on_client_request: Callable[[InferenceRequestMetadata], None] | None = None

    def record_output(self, metadata: InferenceRequestMetadata, output: runtime_pb2.Tensor) -> None:
        """Keeps the last step's reply, to answer a client that re-sends that step."""
        self.last_step_id, self.last_output = metadata.step_id, output

    def resend_output(self, step_id: str | None) -> runtime_pb2.Tensor:
        """The reply to a re-sent step: the cached output if it is the last step, else DuplicateStep."""
        self.resend_pending = False
        if step_id is not None and step_id == self.last_step_id and self.last_output is not None:
            logger.info(f"rpc_inference.resent_step(session_id={self.session_id!r:.40}, step_id={step_id!r:.40})")
            return self.last_output
        raise DuplicateStep(
            f"step_id {step_id!r:.60} was already processed by this session and is not its last step; "
            f"a step can't be re-run in place: send it with a new step_id and start_from_position"
        )


class PushInbox:
    """Where the pushed steps of one stream's session wait (its `SessionState.push_queue`), behind the session's
    guard: the core's push table hands each push here (`span_core.PushSink`)."""

    def __init__(self, session_id: str, guard: SessionPushGuard):
        self.session_id, self.guard = session_id, guard
        self.queue: asyncio.Queue = asyncio.Queue(MAX_PUSH_QUEUE)

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
        return True


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


async def _next_client_request(requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> runtime_pb2.ExpertRequest | None:
    try:
        return await requests.__anext__()
    except StopAsyncIteration:
        return None


def _may_get_pushes(session: SessionState) -> bool:
    """False while no pushed step can reach this session: it has no push queue, or its guard names no upstream
    (every push is refused before it is queued) and nothing is queued."""
    if session.push_queue is None:
        return False
    guard = session.push_guard
    return guard is None or guard.upstream is not None or not session.push_queue.empty()


async def _next_client_or_end(
    requests: AsyncIterator[runtime_pb2.ExpertRequest],
    session: SessionState,
    timeouts: SessionTimeouts,
    deadline: float,
    evicted: asyncio.Future | None,
) -> runtime_pb2.ExpertRequest | None:
    """The client's next request (None at the end of its stream or after `step_timeout`); raises at the session's
    `deadline` and on eviction, like `iterate_steps`'s general wait (every outcome but a request ends the session,
    so the read may be cancelled midway)."""
    assert TASK_DEADLINES
    wait_s = _step_wait_s(session, timeouts, deadline)
    deadlines = session.deadlines
    if deadlines is None:
        deadlines = session.deadlines = TaskDeadline(asyncio.get_running_loop())
    loop = deadlines.loop  # (the session's loop: no get_running_loop, a getpid() syscall, per step)
    waiting = True

    def evict_now(_: asyncio.Future) -> None:
        if waiting:  # the callback may run after the wait ended (done callbacks are scheduled, not called)
            deadlines.expire_now()

    if evicted is not None:
        evicted.add_done_callback(evict_now)
    try:
        with deadlines.scope(loop.time() + max(0.0, wait_s)):
            return await requests.__anext__()  # (awaited here: no coroutine of its own per step)
    except StopAsyncIteration:
        return None
    except TimeoutError:
        if not deadlines.expired:
            raise
    finally:
        waiting = False
        if evicted is not None:
            evicted.remove_done_callback(evict_now)
    if evicted is not None and evicted.done():  # idle under memory pressure: end with a clear error
        raise _eviction(session)
    _nothing_came(session, timeouts, deadline)
    return None


def _step_wait_s(session: SessionState, timeouts: SessionTimeouts, deadline: float) -> float:
    """How long the next step may take to come: `step_timeout` after the session's last real token (zero-token
    steps are not activity: keep-alives alone can't hold a session past it), and never past `deadline`."""
    now = time.monotonic()
    ticket = session.ticket
    since = now if ticket is None else max(ticket.last_used_at, now - timeouts.step_timeout_s)
    return min(since + timeouts.step_timeout_s - now, deadline - now)


def _eviction(session: SessionState) -> SessionEvicted:
    """The error an evicted session ends with (its ticket's, set with the `evicted` event waited for)."""
    ticket = session.ticket
    assert ticket is not None and ticket.eviction is not None
    return ticket.eviction


def _nothing_came(session: SessionState, timeouts: SessionTimeouts, deadline: float) -> None:
    """A wait for the next step ended empty: TimeoutError past the session's `deadline`, else the step timeout (the
    session ends quietly)."""
    if time.monotonic() >= deadline:
        logger.info(f"rpc_inference.session_timeout(session_id={session.session_id!r:.40})")
        raise TimeoutError(f"inference session exceeded session_timeout={timeouts.session_timeout_s} s")
    logger.info(
        f"rpc_inference.step_timeout(session_id={session.session_id!r:.40}, "
        f"step_timeout_s={timeouts.step_timeout_s}, session_timeout_s={timeouts.session_timeout_s})"
    )


async def iterate_steps(
    first: runtime_pb2.ExpertRequest,
    requests: AsyncIterator[runtime_pb2.ExpertRequest],
    session: SessionState,
    timeouts: SessionTimeouts,
    deadline: float,
) -> AsyncIterator[tuple[runtime_pb2.ExpertRequest, InferenceRequestMetadata]]:
    """Yields the session's steps: the first request, then whichever comes first of the next client message and a
    pushed message, until an empty request, the end of the client stream, `step_timeout` or the session `deadline`
    (a `time.monotonic()` value). A step whose `step_id` was already processed (it came both pushed and directly) is
    skipped."""
    request: runtime_pb2.ExpertRequest | None = first
    client_next: asyncio.Task | None = None
    push_next: asyncio.Task | None = None
    evicted = asyncio.ensure_future(session.ticket.evicted.wait()) if session.ticket is not None else None
    try:
        while request is not None and request.tensors:
            if evicted is not None and session.ticket is not None and session.ticket.evicted.is_set():
                raise _eviction(session)  # (a client whose next step is always queued never makes it wait)
            parsed = InferenceRequestMetadata.from_bytes(request.metadata)
            step_id = parsed.step_id
            guard = session.push_guard
            metadata: InferenceRequestMetadata | None = parsed
            # A session whose client named no upstream takes no push (every one is refused), so its guard has
            # nothing to learn from a step that names neither an upstream nor a next hop: the push rules stay off
            # such a session's steps (a lone client's, a stock Petals client's) until it names one
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
                pass
            elif step_id is None or step_id not in session.seen_step_ids:
                if step_id is not None:
                    if len(session.seen_step_ids) >= MAX_REMEMBERED_STEP_IDS:
                        session.seen_step_ids.clear()
                        session.direct_step_ids.clear()
                    session.seen_step_ids.add(step_id)
                    if not metadata.pushed:
                        session.direct_step_ids.add(step_id)
                yield request, metadata
            elif metadata.pushed:  # the client's own copy came first and was answered: no second reply
                pass
            elif step_id not in session.direct_step_ids:  # its pushed copy came first and was answered
                session.direct_step_ids.add(step_id)
            else:  # the client sent this step twice: answer it (Petals drops it, leaving the client to time out)
                session.resend_pending = True
                yield request, metadata

            if TASK_DEADLINES and client_next is None and not _may_get_pushes(session):
                # no push can arrive (e.g. a stock Petals client, which names no upstream): await the client's next
                # message in this task, under one deadline that an eviction moves to now (no task, no wait set)
                request = await _next_client_or_end(requests, session, timeouts, deadline, evicted)
                continue
            if client_next is None:
                client_next = asyncio.ensure_future(_next_client_request(requests))
            waiting = {client_next}
            if session.push_queue is not None:
                if push_next is None:
                    push_next = asyncio.ensure_future(session.push_queue.get())
                waiting.add(push_next)
            if evicted is not None:
                waiting.add(evicted)
            wait_s = _step_wait_s(session, timeouts, deadline)
            done: set = set()
            if wait_s > 0:
                done, _ = await asyncio.wait(waiting, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                _nothing_came(session, timeouts, deadline)
                return
            if evicted is not None and evicted in done:  # idle under memory pressure: end with a clear error
                raise _eviction(session)
            if client_next in done:
                request = client_next.result()
                client_next = None
            else:
                assert push_next is not None
                request = push_next.result()
                push_next = None
    finally:
        for pending in (client_next, push_next, evicted):
            if pending is not None and not pending.done():
                pending.cancel()
        if session.deadlines is not None:
            session.deadlines.close()


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
            batch_size=session.batch_size,
            start_block=session.block_indices[0],
            end_block=session.block_indices[-1] + 1,
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
    ) -> None:
        """Reads `header.num_messages` part messages from the stream, validates them against this session's own
        cache layout (exact bytes, shapes, dtypes, finite values) and writes them; the session then starts at
        `header.position`. ValueError (nothing written) on any mismatch or past `request_timeout_s`."""
        started = time.perf_counter()
        blocks = session.block_indices
        if (header.batch_size, header.start_block, header.end_block) != (session.batch_size, blocks[0], blocks[-1] + 1):
            raise ValueError(
                f"KV import is for batch {header.batch_size}, blocks {header.start_block}:{header.end_block}; "
                f"this session has batch {session.batch_size}, blocks {blocks[0]}:{blocks[-1] + 1}"
            )
        if header.position > session.max_length:
            raise ValueError(
                f"KV import of {header.position} tokens exceeds the session's max_length {session.max_length}"
            )
        if session.cache is None:
            raise ValueError("a KV import needs a session with max_length > 0")
        descriptors = self.core.handoff_layout(session.cache.spec)  # HandoffUnsupported: the client replays
        expected = kv.canonical_nbytes(descriptors, header.position)
        if header.total_bytes != expected:
            raise ValueError(f"KV import announces {header.total_bytes} bytes; {header.position} tokens are {expected}")
        parts = await self._read_parts(header, uid, requests, expected)
        tensors = [deserialize_tensor(t) for t in combine_parts(parts)]
        del parts
        kv.validate_import(tensors, descriptors, header.position)
        await self.core.write_kv(session.cache, tensors, header.position)
        session.prefix_length = header.position
        if session.ticket is not None:  # the imported positions are real work (done on the old server)
            session.ticket.touch(header.position * session.batch_size)
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
        for _ in range(header.num_messages):
            try:
                message = await asyncio.wait_for(requests.__anext__(), max(deadline - time.monotonic(), 0.001))
            except StopAsyncIteration:
                raise ValueError(f"KV import ended after {received} of {expected} bytes") from None
            except asyncio.TimeoutError:
                raise ValueError(f"KV import not complete within request_timeout={timeout_s} s") from None
            if message.uid != uid:
                raise ValueError("KV import messages must carry the session's uid")
            received += hw.message_bytes(message.tensors)
            if received > expected:
                raise ValueError(f"KV import sent more than the {expected} bytes it announced")
            parts.extend(message.tensors)
        if received != expected:
            raise ValueError(f"KV import sent {received} bytes, announced {expected}")
        return parts


def _opening_tokens(first: runtime_pb2.ExpertRequest) -> int:
    """Tokens the opening request of a session brings: its hidden states' length `[B, T, H]` (0 for none)."""
    size = list(first.tensors[0].size) if first.tensors else []
    return int(size[1]) if len(size) == 3 else 0


class InferenceStreams:
    """The stream half of the front's RPC service (`handler.TransformerConnectionHandler`, which sets these
    attributes): `rpc_inference`, its steps, the pushes on to the next server, and the refusals' one count."""

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

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
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
            opening: int | None = kv_import.position if kv_import is not None else _opening_tokens(first)
            if opening == 0 and probe_keys(first, metadata) is not None:
                opening = None  # a prefix probe: its tokens follow once the cached part is known
            reservation = self.core.open_session(
                peer_key(context), spec, metadata.alloc_timeout_s, metadata.session_id, inbox, opening_tokens=opening
            )  # per-peer caps, what yields under pressure, then the KV cache itself (none for a max_length=0 probe)
            async with reservation as (ticket, cache):
                session = SessionState(
                    session_id=metadata.session_id,
                    block_indices=block_indices,
                    batch_size=batch_size,
                    max_length=max_length,
                    cache=cache,
                    active_adapter=adapter,
                    args_structure=metadata.args_structure,
                    push_queue=inbox.queue if inbox is not None else None,
                    push_guard=push_guard,  # peer_auth: what pushed steps may do
                    ticket=ticket,
                )
                if kv_import is not None:
                    await self.handoff.import_kv(session, kv_import, first.uid, requests)
                namespace = self.prefix_trust.namespace(peer_key(context), adapter)  # pushed steps: the owner's
                session.on_client_request = functools.partial(self._record_prefix_keys, session, namespace)
                probing = kv_import is None  # the first step may ask for a prefix hit
                steps = iterate_steps(first, requests, session, self.timeouts, deadline)
                async for request, step_metadata in steps:
                    hit = await self._attach_prefix(session, namespace, request, step_metadata) if probing else None
                    probing = False
                    if hw.EXPORT_KEY in step_metadata.extra:  # draining: the client moves the cache
                        async for response in self.handoff.export(session):
                            yield response
                        continue
                    if session.resend_pending:  # the client re-sent a step: never leave it without an answer
                        yield runtime_pb2.ExpertResponse(tensors=[session.resend_output(step_metadata.step_id)])
                        continue
                    try:
                        response, can_push = await self._inference_step(session, request, step_metadata, deadline)
                    except ValueError as e:
                        if not step_metadata.pushed:
                            raise
                        # a bad push (from another server) must not end this client's session
                        logger.info(f"rpc_inference.bad_push_ignored(session_id={session.session_id!r:.40}): {e}")
                        session.seen_step_ids.discard(step_metadata.step_id or "")
                        continue
                    output = response.tensors[0]
                    session.record_output(step_metadata, output)
                    # (the guard learnt from a step of the session's own client when it was screened)
                    if can_push and step_metadata.next_servers and push_guard.may_push_on(step_metadata):
                        self._schedule_push(request, output, step_metadata)
                    if step_metadata.pushed:
                        response = mark_pushed_reply(response)
                    yield response if hit is None else with_hit(response, hit)
        except Exception as e:
            self._reject("rpc_inference", e)
            raise
        finally:
            self.sessions.close()
            logger.info(
                f"rpc_inference.close(session_id={metadata.session_id!r:.40}, seconds={time.monotonic() - started:.2f})"
            )

    async def _attach_prefix(
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
            session.ticket.touch(hit * session.batch_size)
        self.metrics.prefix_probe(keyed_tokens=keys.end_position, hit_tokens=hit)
        logger.debug(f"rpc_inference.prefix_hit(session_id={session.session_id!r:.40}, tokens={hit})")
        return hit

    async def _inference_step(
        self,
        session: SessionState,
        request: runtime_pb2.ExpertRequest,
        metadata: InferenceRequestMetadata,
        deadline: float,
    ) -> tuple[runtime_pb2.ExpertResponse, bool]:
        """The step's response (its output's record built in it: `_serialize_output`'s `into`) and whether its
        output may be pushed on."""
        structure = metadata.args_structure if metadata.args_structure is not None else session.args_structure
        inputs = bf.decode_step(
            request.tensors,
            structure,
            self.limits,
            num_blocks=len(session.block_indices),
            batch_size=session.batch_size,
            current_length=session.prefix_length,
            start_from_position=metadata.start_from_position,
            max_length_tokens=session.max_length,
            adapter=session.active_adapter,
            lone_session=self.sessions.num_open == 1,  # (a handler process's: the device checks its own count)
        )  # the session changes only once the step is valid
        meta = inputs.hidden_meta  # the usual step's record of its bytes (no tensor built), else the tensor's shape
        batch_size, length, _ = meta[1] if meta is not None else inputs.tensor().shape
        output: torch.Tensor | TensorBytes
        if length == 0 or session.cache is None:
            output = inputs.tensor()  # zero tokens: nothing to compute, [B, 0, H] back
        else:
            assert session.cache is not None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout(f"inference session exceeded session_timeout={self.timeouts.session_timeout_s} s")
            try:
                step = self.core.step(session.cache, inputs)
                output = await self._step_within(session, step, remaining)
            except asyncio.TimeoutError:
                raise RequestTimeout(
                    f"inference session exceeded session_timeout={self.timeouts.session_timeout_s} s"
                ) from None
        drain_deadline = self.core.drain.deadline  # (while draining: the session's time left)
        response = hw.step_response(None if drain_deadline is None else drain_deadline - time.monotonic())
        self._serialize_output(output, into=response.tensors)
        session.prefix_length = inputs.prefix_length + length
        if session.ticket is not None:
            session.ticket.touch(batch_size * length)  # zero-token keep-alives are not use
        return response, inputs.prompts is None

    async def _step_within(self, session: SessionState, step: Awaitable[_T], remaining_s: float) -> _T:
        """The executor's `step` under the session's deadline: the session's `TaskDeadline` (one lazily moved timer
        for all its waits)."""
        if not TASK_DEADLINES:  # (Python < 3.11: a task of its own)
            return await asyncio.wait_for(step, remaining_s)
        deadlines = session.deadlines
        if deadlines is None:
            deadlines = session.deadlines = TaskDeadline(asyncio.get_running_loop())
        with deadlines.scope(deadlines.loop.time() + remaining_s):
            return await step

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

    def _schedule_push(
        self, request: runtime_pb2.ExpertRequest, output: runtime_pb2.Tensor, metadata: InferenceRequestMetadata
    ) -> None:
        if not metadata.next_servers or self.p2p is None:
            return
        task = asyncio.create_task(self._push_outputs(request, output, metadata))
        self._push_tasks.add(task)
        task.add_done_callback(self._push_tasks.discard)

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
