"""`StepOrder`: which step one `rpc_inference` session runs next, driven by callbacks (no task and no await per step).

Its inputs are the client's requests, handed over one at a time as the session makes room for them (`client`; the
transport is told when there is room: `ready`), and the steps other servers push into the session (its `PushInbox`,
which wakes it). Each request is screened here: its metadata decoded, a pushed step checked against the push rules
(`push_guard.screen_step`), the client's own requests shown to `on_client_request`, and a step whose `step_id` was
already processed skipped (it came both pushed and directly) or, re-sent by the client, answered again
(`SessionState.resend_pending`). A step that passes is handed to `run`, one at a time: `run` returns True when the
step is over, else it calls `done` (or `fail`) when it is. The client's request goes before queued pushes.

The session ends (`end(None)`) at an empty request or the end of the client's stream; after `step_timeout` without a
step that processed a token (zero-token keep-alives are not activity), counted from the session's last real token;
with `TimeoutError` past the session's `deadline` while it waits, `RequestTimeout` past it while a step runs, and
with its ticket's `SessionEvicted` once evicted (between steps). One timer per session, re-armed lazily when it fires
before the time it guards (deadlines only move later while steps come), as `utils.deadlines.TaskDeadline` does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from hivemind.proto import runtime_pb2

from corolla.protocol.auth import UPSTREAM_PEER_KEY
from corolla.protocol.metadata import InferenceRequestMetadata
from corolla.server.core.limits import SessionEvicted, SessionTimeouts
from corolla.server.core.push_guard import screen_step
from corolla.server.core.refusals import RequestTimeout
from corolla.server.front.session_state import PushInbox, SessionState
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_REMEMBERED_STEP_IDS = 4096
EARLY_FIRE_S = 1e-4  # a timer firing this close before its time counts as on time (no re-arm for less)


class StepOrder:
    """See the module docstring. `deadline` is a `time.monotonic()` value (the event loop's clock)."""

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

    @property
    def holds_client_request(self) -> bool:
        """A client request waits here (the transport hands over the next one only after `ready`)."""
        return self._client is not None

    def start(self, first: runtime_pb2.ExpertRequest) -> None:
        """Begins with the session's opening request."""
        self.client(first)

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
