"""A device channel's steps from the intake thread to the runtime (`device_channel.DeviceChannel`), a frame at a
time: every step of a STEP_BATCH is checked and prepared by the executor (`DeviceExecutor.prepare_step`: the same
typed refusals as `step`, each failing only its caller), then the frame's decode steps of the fast path travel as
ONE runtime task (payload `engine.batcher.StepGroup`, `Task.steps` = their count): one queue entry, one pop, one
callback that queues all of the frame's replies under one lock. A frame whose steps exceed what one merged forward
takes (`Runtime.merge_limit`) is split into tasks that each fit; the runtime merges whole frame tasks into a forward
while they fit (a frame that does not waits for the next). Prefill steps, steps of the plain executor and a lone
session's step (which may run inline on an idle runtime) stay one task each. The session's state (open, length) is
still checked per step in the runtime thread (`SpanEngine.validate`): a closed session fails its own step only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from corolla.engine.batcher import StepGroup, StepResult
from corolla.engine.span_engine import StepRequest
from corolla.server.core.admission import SessionTicket
from corolla.server.core.executor import DeviceExecutor, PreparedStep, SessionCache, StepInputs
from corolla.server.core.runtime import Task
from corolla.server.core.span_core import SpanCore
from corolla.server.handlers import proxy_wire as wire

# a step's reply as a channel queues it: request id, output [B, T, H] or what refused it, the output's bytes if known
StepReply = tuple[int, torch.Tensor | BaseException, memoryview | None]


@dataclass(eq=False, slots=True)
class _Entry:
    """A prepared step waiting for its result: what its reply and its accounting need."""

    request_id: int
    ticket: SessionTicket | None
    num_tokens: int  # B x T
    request: StepRequest | None  # the fast path's request (its `output_bytes` once a launched forward collected them)


class _FrameSteps:
    """A frame's decode steps of the fast path, as columns (no record per step): request ids, session handles,
    tickets, the prepared steps and their requests, and their tokens in all."""

    __slots__ = ("request_ids", "tickets", "prepared", "requests", "tokens", "mixed_keys")

    def __init__(self) -> None:
        self.request_ids: list[int] = []
        self.tickets: list[SessionTicket | None] = []
        self.prepared: list[PreparedStep] = []
        self.requests: list[StepRequest] = []
        self.tokens = 0
        self.mixed_keys = False  # some step's merge key differs from the first's

    def add(self, request_id: int, ticket: SessionTicket | None, prepared: PreparedStep, request: StepRequest) -> None:
        if self.prepared and prepared.merge_key != self.prepared[0].merge_key:
            self.mixed_keys = True
        self.request_ids.append(request_id)
        self.tickets.append(ticket)
        self.prepared.append(prepared)
        self.requests.append(request)
        self.tokens += prepared.size_tokens

    def part(self, start: int, end: int) -> _FrameSteps:
        """Steps [start, end) as a frame of their own (a frame split at the merge limit)."""
        part = _FrameSteps()
        part.request_ids, part.tickets = self.request_ids[start:end], self.tickets[start:end]
        part.prepared, part.requests = self.prepared[start:end], self.requests[start:end]
        part.tokens = sum(p.size_tokens for p in part.prepared)
        part.mixed_keys = any(p.merge_key != part.prepared[0].merge_key for p in part.prepared)
        return part


class FrameIntake:
    """Turns a channel's step frames into runtime tasks and their results into replies (see the module docstring).

    `held(handle)` gives an open session's cache and ticket (FrameError if none); `queue_replies` appends replies to
    the channel's outbox (any thread); `flush` sends them (one distinct object: the runtime flushes it once per
    batch)."""

    def __init__(
        self,
        executor: DeviceExecutor,
        core: SpanCore,
        held: Callable[[int], tuple[SessionCache, SessionTicket | None]],
        queue_replies: Callable[[list[StepReply]], None],
        flush: Callable[[], None],
    ):
        self.executor, self.core = executor, core
        self._held, self._queue_replies, self._flush = held, queue_replies, flush
        self.num_frame_tasks = 0  # tasks that carried two or more steps of one frame

    def submit(self, kind: int, request_id: int, payload: memoryview) -> int:
        """Queues a STEP_BATCH's (or a STEP's) steps on the runtime, waking its thread once; refusals are answered
        at once. Returns the number of steps read. A malformed batch (count or lengths) raises FrameError."""
        steps: list[wire.ParsedStep | wire.BadStep]
        if kind == wire.STEP_BATCH:
            steps = wire.parse_steps(payload)
        else:
            try:
                steps = [wire.parse_step(request_id, payload)]
            except wire.FrameError as e:
                steps = [wire.BadStep(request_id, e)]
        refused: list[StepReply] = []
        tasks: list[Task] = []
        frame = _FrameSteps()  # the fast path's queued decode steps: one task (or a few)
        runtime = self.executor.runtime
        may_run_alone = self.core.num_open <= 1  # alone in all processes (read once per frame)
        held, prepare_step = self._held, self.executor.prepare_step
        for step in steps:
            try:
                if isinstance(step, wire.BadStep):
                    raise step.error
                shape, dtype = step.shape, step.dtype
                if shape is None or dtype is None or len(shape) != 3:
                    raise wire.FrameError("a step needs hidden states [B, T, H]")
                cache, ticket = held(step.handle)
                # the hidden states as their bytes (no tensor unless the executor needs one: `StepInputs.tensor`)
                prepared = prepare_step(cache, StepInputs(None, step.prefix_length, step.prompts, step.hypo_ids,
                                                          step.adapter, step.lone and may_run_alone, step.raw,
                                                          (dtype, shape), step.rows))  # fmt: skip
                request = prepared.payload
                if (
                    not prepared.inline
                    and isinstance(request, StepRequest)
                    and request.is_decode
                    and prepared.merge_key is not None
                ):
                    frame.add(step.request_id, ticket, prepared, request)
                    continue
                entry = _Entry(step.request_id, ticket, shape[0] * shape[1],
                               request if isinstance(request, StepRequest) else None)  # fmt: skip
                if prepared.inline:  # a lone session: may run right here on an idle runtime
                    runtime.queue(self._task(entry, prepared), inline=True)
                else:
                    tasks.append(self._task(entry, prepared))
            except Exception as e:
                refused.append((step.request_id, e, None))
        if frame.request_ids:
            try:
                tasks.extend(self._frame_tasks(frame))
            except Exception as e:  # the runtime stopped meanwhile: each of these steps is refused
                refused.extend((rid, e, None) for rid in frame.request_ids)
        if tasks:
            try:
                runtime.queue(tasks)  # one lock and one wake for the frame
            except Exception as e:  # the runtime stopped: every step of the frame is refused
                for task in tasks:
                    assert task.on_done is not None
                    task.on_done(None, e)  # queues each of its steps' refusals
                if not refused:
                    self._flush()
        if refused:
            self._queue_replies(refused)
            self._flush()
        return len(steps)

    def _frame_tasks(self, frame: _FrameSteps) -> list[Task]:
        """The frame's decode steps in as few tasks as fit one merged forward each (in order): one task for the
        usual frame (one merge key, within the limit), else split where the limit or the merge key says."""
        first = frame.prepared[0]
        limit = self.executor.runtime.merge_limit(first.kind)
        n = len(frame.request_ids)
        if frame.tokens <= limit and not frame.mixed_keys:
            return [self._group_task(frame, 0, n, frame.tokens)]
        tasks: list[Task] = []
        start, tokens = 0, 0
        for i, prepared in enumerate(frame.prepared):
            size = prepared.size_tokens
            if i > start and (tokens + size > limit or prepared.merge_key != frame.prepared[start].merge_key):
                tasks.append(self._group_task(frame, start, i, tokens))
                start, tokens = i, 0
            tokens += size
        tasks.append(self._group_task(frame, start, n, tokens))
        return tasks

    def _task(self, entry: _Entry, prepared: PreparedStep) -> Task:
        """One runtime task for one step: its own payload and callback."""
        return self.executor.runtime.task(
            prepared.fn, on_done=partial(self._step_done, entry), flush=self._flush,
            priority=prepared.priority, size_tokens=prepared.size_tokens, kind=prepared.kind,
            merge_key=prepared.merge_key, payload=prepared.payload, sessions=(prepared.session,),
        )  # fmt: skip

    def _group_task(self, frame: _FrameSteps, start: int, end: int, tokens: int) -> Task:
        """One runtime task for steps [start, end) of a frame: a `StepGroup` (one step alone: its own task)."""
        first = frame.prepared[start]
        if end - start == 1:
            request = frame.requests[start]
            entry = _Entry(frame.request_ids[start], frame.tickets[start],
                           request.rows * request.num_tokens, request)  # fmt: skip
            return self._task(entry, first)
        part = frame if start == 0 and end == len(frame.request_ids) else frame.part(start, end)
        group = StepGroup(part.requests)
        self.num_frame_tasks += 1
        return self.executor.runtime.task(
            group.run, on_done=partial(self._frame_done, part), flush=self._flush,
            priority=first.priority, size_tokens=tokens, kind=first.kind, merge_key=first.merge_key, payload=group,
            steps=end - start, sessions=tuple(p.session for p in part.prepared),
        )  # fmt: skip

    def _step_done(self, entry: _Entry, output: torch.Tensor | None, error: BaseException | None) -> None:
        """One step's result, in the thread that ran it; the runtime then calls `flush` once for the batch."""
        self._queue_replies([self._reply(entry, output if error is None else error)])

    def _frame_done(self, frame: _FrameSteps, outputs: list[StepResult] | None, error: BaseException | None) -> None:
        """A frame task's results (one per step; `error`: the whole batch failed), queued under one lock."""
        if error is not None or outputs is None:
            failed = error if error is not None else RuntimeError("the frame's steps returned nothing")
            self._queue_replies([(rid, failed, None) for rid in frame.request_ids])
            return
        if len(outputs) != len(frame.request_ids):
            failed = RuntimeError(f"{len(outputs)} results for a frame of {len(frame.request_ids)} steps")
            self._queue_replies([(rid, failed, None) for rid in frame.request_ids])
            return
        reply = self._step_reply
        self._queue_replies([
            reply(rid, ticket, request.rows * request.num_tokens, request, out)
            for rid, ticket, request, out in zip(
                frame.request_ids, frame.tickets, frame.requests, outputs, strict=True
            )
        ])  # fmt: skip

    @classmethod
    def _reply(cls, entry: _Entry, result: torch.Tensor | BaseException | None) -> StepReply:
        return cls._step_reply(entry.request_id, entry.ticket, entry.num_tokens, entry.request, result)

    @staticmethod
    def _step_reply(
        request_id: int,
        ticket: SessionTicket | None,
        num_tokens: int,
        request: StepRequest | None,
        result: torch.Tensor | BaseException | None,
    ) -> StepReply:
        """A served step's reply (its session's ticket touched) or a refused one's."""
        if result is None or isinstance(result, BaseException):
            return (request_id, result if result is not None else RuntimeError("the step returned nothing"), None)
        if ticket is not None:
            ticket.touch(num_tokens)
        # [B, T, H], encoded by whoever sends it (from its bytes, where a launched forward collected them)
        return (request_id, result, request.output_bytes if request is not None else None)
