"""The server-side state of one open `rpc_inference` stream (`SessionState`: its cache, ticket, push rules, the step
ids it has seen and its last reply) and the inbox of the steps other servers push into it (`PushInbox`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hivemind.proto import runtime_pb2

from corolla.protocol.metadata import InferenceRequestMetadata
from corolla.server.core.admission import SessionTicket
from corolla.server.core.executor import SessionCache
from corolla.server.core.limits import DuplicateStep
from corolla.server.core.push_guard import SessionPushGuard
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_PUSH_QUEUE = 8  # pushed steps waiting per session; a session is driven one step at a time


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
    push_guard: SessionPushGuard | None = None  # what pushed steps may do (None: none runs); push_guard.screen_step
    seen_step_ids: set[str] = field(default_factory=set)
    direct_step_ids: set[str] = field(default_factory=set)  # steps the client itself sent (not only pushed)
    ticket: SessionTicket | None = None  # idle time and eviction (None: not admitted through `admission`)
    last_step_id: str | None = None
    last_output: runtime_pb2.Tensor | None = None
    resend_pending: bool = False  # the step being yielded is the client's re-send of a step already answered
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
    """Where the pushed steps of one stream's session wait, behind the session's guard: the core's push table hands
    each push here (`span_core.PushSink`), and the session's `step_order.StepOrder` is woken (`wake`)."""

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
