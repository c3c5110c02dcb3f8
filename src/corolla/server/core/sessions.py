"""Inference sessions of one front: the registry of its streams (ended on shutdown), the inbox of a session's pushed
steps, and the step iterator that merges client steps with pushed ones (de-duplicated by `step_id`)
under `step_timeout` (counted from the last step that processed a token) and `session_timeout`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from hivemind.proto import runtime_pb2

from corolla.protocol.auth import UPSTREAM_PEER_KEY
from corolla.protocol.metadata import InferenceRequestMetadata
from corolla.server.core.admission import SessionTicket
from corolla.server.core.executor import SessionCache
from corolla.server.core.limits import DuplicateStep, SessionEvicted
from corolla.server.core.push_guard import SessionPushGuard, screen_step
from corolla.utils.deadlines import TASK_DEADLINES, TaskDeadline
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_PUSH_QUEUE = 8  # pushed steps waiting per session; a session is driven one step at a time
MAX_REMEMBERED_STEP_IDS = 4096


@dataclass(frozen=True)
class SessionTimeouts:
    step_timeout_s: float
    session_timeout_s: float
    request_timeout_s: float


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
    (a `time.monotonic()` value). A step whose `step_id`
        was already processed (it came both pushed and directly) is skipped."""
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
