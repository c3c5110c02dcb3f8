"""The in-process engine's own scheduler for the benchmark's labelled "in-process engine" row: `ContinuousBatcher`
runs, on its own thread, iterations of the pending steps of many sessions over one `SpanEngine` (one batched decode
forward of distinct sessions' single-token steps, oldest first, then a budget of prefill tokens), merging through
`corolla.engine.batcher.execute_steps`, the same function the server's `Runtime` calls. Not used by the server."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from corolla.engine.batcher import StepResult, execute_steps
from corolla.engine.span_engine import EngineSession, SpanEngine, StepRequest
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(eq=False)
class _Pending:
    """A queued step: its result goes to a `concurrent.futures.Future` (`submit`) or to an asyncio future, resolved
    in that future's loop (`step`)."""

    request: StepRequest
    future: Future | asyncio.Future
    seq: int
    submitted_at: float = field(default_factory=time.monotonic)

    def start(self) -> bool:
        """False if the caller gave up (cancelled) before the step ran."""
        if isinstance(self.future, Future):
            return self.future.set_running_or_notify_cancel()
        return not self.future.done()


def _resolve_all(pairs: list[tuple[asyncio.Future, StepResult]]) -> None:
    for future, result in pairs:  # runs in the futures' loop
        if future.done():
            continue
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)


class ContinuousBatcher:
    """Own-thread continuous batching over one `SpanEngine`.

    `submit` (any thread) returns a `concurrent.futures.Future` of the step's output, `await step(...)` (in an
    asyncio loop) returns the output itself, with one loop wake-up per iteration for all of that loop's steps;
    the batcher thread runs
    iterations: up to `max_batch_rows` rows of single-token steps from distinct sessions, oldest first (so no
    session starves), then at most `max_prefill_tokens_per_iteration` tokens of multi-token steps (at least one).
    While fewer sessions have a step pending than took part in the last batched decode, an iteration waits up to
    `gather_window_s` for their next steps (a lone session never waits)."""

    def __init__(
        self,
        engine: SpanEngine,
        *,
        max_batch_rows: int | None = None,
        max_prefill_tokens_per_iteration: int = 4096,
        gather_window_s: float = 0.002,
        name: str = "corolla-batcher",
    ):
        self.engine = engine
        self.max_batch_rows = max_batch_rows or engine.max_batch_rows
        self.max_prefill_tokens_per_iteration = max_prefill_tokens_per_iteration
        self.gather_window_s = gather_window_s
        self.name = name
        self._last_decode_sessions = 0
        self._pending: list[_Pending] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.iterations = 0
        self.batch_rows_history: list[int] = []  # rows of each batched decode (bounded, for tests and stats)

    # ------------------------------------------------------------------------------------------ API

    def submit(
        self,
        session: EngineSession,
        hidden: torch.Tensor,
        position: int,
        hypo_ids: torch.Tensor | None = None,
        prompts: torch.Tensor | None = None,
    ) -> Future:
        future: Future = Future()
        item = _Pending(StepRequest(session, hidden, int(position), hypo_ids, prompts), future, next(self._seq))
        with self._cond:
            if self._stopping:
                raise RuntimeError("The batcher is stopped; it accepts no new steps")
            self._pending.append(item)
            self._cond.notify()
        return future

    async def step(
        self,
        session: EngineSession,
        hidden: torch.Tensor,
        position: int,
        hypo_ids: torch.Tensor | None = None,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs one step through the batcher from an asyncio loop; returns its output [B, T, H]."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        request = StepRequest(session, hidden, int(position), hypo_ids, prompts)
        item = _Pending(request, future, next(self._seq))
        with self._cond:
            if self._stopping:
                raise RuntimeError("The batcher is stopped; it accepts no new steps")
            self._pending.append(item)
            self._cond.notify()
        return await future

    @property
    def num_pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def run_once(self) -> int:
        """Runs one iteration on the calling thread; returns the number of steps completed."""
        with self._cond:
            decode, prefill = self._select()
            chosen = {id(p) for p in decode + prefill}
            self._pending = [p for p in self._pending if id(p) not in chosen]
        if not decode and not prefill:
            return 0
        items = decode + prefill
        live = [p for p in items if p.start()]
        results = execute_steps(self.engine, [p.request for p in live])
        by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, StepResult]]]] = {}
        for item, result in zip(live, results, strict=True):
            future = item.future
            if isinstance(future, asyncio.Future):
                loop = future.get_loop()
                by_loop.setdefault(id(loop), (loop, []))[1].append((future, result))
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        for loop, pairs in by_loop.values():
            try:
                loop.call_soon_threadsafe(_resolve_all, pairs)
            except RuntimeError:  # that loop is closed: nobody waits any more
                pass
        self.iterations += 1
        self._last_decode_sessions = len(decode)
        if decode:
            self.batch_rows_history.append(sum(p.request.rows for p in decode))
            del self.batch_rows_history[:-1000]
        return len(live)

    def _select(self) -> tuple[list[_Pending], list[_Pending]]:
        """Oldest-first choice of this iteration's steps: one per session, decode rows and prefill tokens budgeted."""
        sessions: set[int] = set()
        decode: list[_Pending] = []
        prefill: list[_Pending] = []
        rows = prefill_tokens = 0
        for item in sorted(self._pending, key=lambda p: p.seq):
            req = item.request
            key = id(req.session)
            if key in sessions:
                continue
            sessions.add(key)  # a session's later steps wait behind its earliest one
            if req.is_decode:
                if rows + req.rows <= self.max_batch_rows or not decode:
                    decode.append(item)
                    rows += req.rows
            else:
                tokens = req.rows * req.num_tokens
                if not prefill or prefill_tokens + tokens <= self.max_prefill_tokens_per_iteration:
                    prefill.append(item)
                    prefill_tokens += tokens
        return decode, prefill

    # ------------------------------------------------------------------------------------------ own thread

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("ContinuousBatcher.start: already started")
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finishes the running iteration, then fails every pending step."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._cond:
            pending, self._pending = self._pending, []
        error = RuntimeError("The batcher stopped before this step ran")
        for item in pending:
            future = item.future
            if isinstance(future, asyncio.Future):
                failed: list[tuple[asyncio.Future, StepResult]] = [(future, error)]
                with contextlib.suppress(RuntimeError):
                    future.get_loop().call_soon_threadsafe(_resolve_all, failed)
            elif future.set_running_or_notify_cancel():
                future.set_exception(error)

    def __enter__(self) -> ContinuousBatcher:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _loop(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.set_device(self.engine.device)
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                deadline = time.monotonic() + self.gather_window_s
                while (
                    not self._stopping
                    and len({id(p.request.session) for p in self._pending}) < self._last_decode_sessions
                ):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                if self._stopping:
                    return
            try:
                # as its callers (`engine_steps` opens sessions under inference mode): the pool grows their block
                # tables in place as their tokens arrive, which torch allows on inference tensors only in that mode
                with torch.inference_mode():
                    self.run_once()
            except Exception:  # never let one bad iteration kill the thread
                logger.exception("batcher.iteration_failed")
