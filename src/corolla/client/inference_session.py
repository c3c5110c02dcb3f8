"""`InferenceSession`: one inference stream per server span of the chain; keeps every span's inputs so that when
a server fails, a replacement chain for its span replays them (start_from_position=0) and rebuilds the KV cache."""

from __future__ import annotations

import asyncio
import math
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch
from hivemind.proto import runtime_pb2

from corolla.client import background_loop
from corolla.client.forwarding import StepForwarding, is_pushed_reply, push_went_stale
from corolla.client.handoff import HandoffLog, hand_off_draining_spans, needs_handoff, read_drain_notice
from corolla.client.local_transport import LocalInferenceStream, responses_of
from corolla.client.output_checks import BadServerOutput, check_outputs
from corolla.client.remote_forward_backward import serialize_activations
from corolla.client.retries import RetryBudget
from corolla.client.routing import RemoteSequenceManager
from corolla.client.verification import StepVerifier
from corolla.protocol.auth import UPSTREAM_PEER_KEY
from corolla.protocol.codecs import deserialize_tensor
from corolla.protocol.handoff import DrainNotice
from corolla.protocol.metadata import encode_metadata
from corolla.protocol.packing import pack_args_kwargs
from corolla.protocol.records import RemoteSpanInfo
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DUMMY = torch.empty(0)
DUMMY_INT64 = torch.empty(0, dtype=torch.int64)

_steps_in_flight = 0  # inference steps of this process running now (any session, any thread)
_steps_lock = threading.Lock()


def _poll_s(config: Any) -> float:
    """How long to poll for a response instead of sleeping: `busy_poll_ms`, but only while this is the process's
    only step in flight (a polling thread delays every other Python thread's GIL hand-over by up to 5 ms)."""
    return config.busy_poll_ms / 1000 if config.busy_poll_ms > 0 and _steps_in_flight == 1 else 0.0


class _SpanSession:
    """The stream to one server for blocks `[span.start, span.end)`.

    `history` holds this span's inputs for positions `[0, position)` (`[B, position, H]`), i.e. exactly what the
    server's KV cache was built from, so a replacement server can be given the same inputs.
    """

    def __init__(self, manager: RemoteSequenceManager, span: RemoteSpanInfo, max_length: int):
        self.manager, self.span, self.max_length = manager, span, max_length
        self.session_id = str(uuid.uuid4())
        self.position = 0  # tokens in the server's cache
        self._history_buf: torch.Tensor | None = None  # [B, capacity, H]; positions [0, _history_len) are valid
        self._history_len = 0  # == position, except in a replacement that has yet to replay its inherited history
        self._requests: asyncio.Queue[runtime_pb2.ExpertRequest | None] = asyncio.Queue()
        self._responses: Any = None
        self.local: LocalInferenceStream | None = None  # the server's unix socket, if open: usable from any one thread
        self._started = False
        self._closed = False
        self.upstream_peer: str | None = None  # the previous span's server: the only peer that may push to this one
        self._declared_upstream: str | None = None
        # set when the server says it drains (client.handoff moves the span)
        self.drain_notice: DrainNotice | None = None
        self.last_outputs: torch.Tensor | None = None  # the last response's tensor as the server sent it (its dtype)
        self.expected_push: tuple[str, int] | None = None  # (step_id, start) last named to reach it by push
        self.last_reply_pushed = False  # the server flagged its last reply as the answer to a pushed step

    async def open(self) -> None:
        """Opens the stream: over the server's unix socket when it runs on this machine, else through p2p."""

        async def _read_requests():
            while True:
                request = await self._requests.get()
                if request is None:
                    return
                yield request

        config = self.manager.config
        if config.local_transport:
            self.local = await LocalInferenceStream.open(self.span.peer_id, timeout_s=config.connect_timeout_s)
        if self.local is not None:
            stream = responses_of(self.local, _read_requests())
        else:
            stub = await self.manager.get_stub(self.span.peer_id)
            stream = await asyncio.wait_for(stub.rpc_inference(_read_requests()), config.connect_timeout_s)
        self._responses = stream.__aiter__()

    @property
    def accepts_pushes(self) -> bool:
        """Open on its server (a push into a session the server does not have yet is dropped)."""
        return self._started and not self._closed

    @property
    def declared_upstream(self) -> str | None:
        """The upstream peer this span's server was told (the only peer it accepts pushes from)."""
        return self._declared_upstream

    @property
    def transport(self) -> str | None:
        """`local` (unix socket) or `p2p` once open, else None."""
        if self._responses is None:
            return None
        return "p2p" if self.local is None else "local"

    @property
    def history(self) -> torch.Tensor | None:
        """This span's inputs we hold, `[B, n, H]` (a view: copy before keeping)."""
        return None if self._history_buf is None else self._history_buf[:, : self._history_len]

    @history.setter
    def history(self, value: torch.Tensor | None) -> None:
        """Replaces the history (a replacement span inherits a failed one's, replayed by its first step)."""
        self._history_buf = None if value is None else value.clone()
        self._history_len = 0 if value is None else value.shape[1]

    def _record(self, inputs: torch.Tensor, send_from: int) -> None:
        """Writes `inputs` [B, n, H] as positions `[send_from, send_from + n)`, growing the buffer by doubling (a
        whole-history copy per token would cost O(position) each step)."""
        end = send_from + inputs.shape[1]
        buf = self._history_buf
        if buf is None or buf.shape[1] < end or buf.shape[0] != inputs.shape[0] or buf.dtype != inputs.dtype:
            capacity = max(end, 2 * (buf.shape[1] if buf is not None else 0), 16)
            grown = inputs.new_empty(inputs.shape[0], min(capacity, max(self.max_length, end)), inputs.shape[2])
            if buf is not None and send_from > 0:
                grown[:, :send_from] = buf[:, :send_from]
            self._history_buf = buf = grown
        buf[:, send_from:end] = inputs
        self._history_len = self.position = end

    def inputs_from(self, send_from: int, hidden: torch.Tensor, hidden_from: int) -> torch.Tensor:
        """This span's inputs for positions `[send_from, hidden_from + hidden.shape[1])` from history + `hidden`."""
        if send_from >= hidden_from:
            return hidden[:, send_from - hidden_from :]
        history = self.history  # [B, have, H]
        have = 0 if history is None else history.shape[1]
        assert history is not None and have >= hidden_from, (
            f"span {self.span.start}:{self.span.end} lacks inputs [{have}, {hidden_from})"
        )
        return torch.cat([history[:, send_from:hidden_from], hidden], dim=1)

    def _request(
        self,
        hidden: torch.Tensor,
        hidden_from: int,
        position: int,
        prompts: torch.Tensor,
        hypo_ids: torch.Tensor,
        step_id: str,
        compression: int,
        extra: dict[str, Any],
    ) -> tuple[runtime_pb2.ExpertRequest, torch.Tensor, int]:
        """The request for positions `[min(self.position, position), ...)`: (request, its inputs, their start)."""
        send_from = min(self.position, position)
        inputs = self.inputs_from(send_from, hidden, hidden_from)  # [B, n, H]
        tensors, structure = pack_args_kwargs(inputs, prompts, hypo_ids)
        metadata: dict[str, Any] = {
            "session_id": self.session_id,
            "step_id": step_id,
            "start_from_position": send_from,
            "args_structure": structure,
            **self.manager.request_metadata(self.span.peer_id),
            **extra,  # client.forwarding: next step id, next_servers
        }
        if self.upstream_peer is not None and self.upstream_peer != self._declared_upstream:
            metadata[UPSTREAM_PEER_KEY] = self._declared_upstream = self.upstream_peer  # who may rpc_push to it
        if not self._started:
            metadata["max_length"] = self.max_length
            if self.manager.config.alloc_timeout_s:
                metadata["alloc_timeout"] = float(self.manager.config.alloc_timeout_s)
        request = runtime_pb2.ExpertRequest(
            uid=self.manager.make_chain(self.span.start, self.span.end),
            tensors=serialize_activations(tensors, compression),
            metadata=encode_metadata(metadata),
        )
        return request, inputs, send_from

    def _accept(
        self, response: runtime_pb2.ExpertResponse, inputs: torch.Tensor, send_from: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, int]:
        """Checks the response (shape as sent, wire dtype, finite: else BadServerOutput, the failure of this span's
        server), records the inputs as the server's cache contents; returns (outputs, first position)."""
        peer_id = self.span.peer_id
        if len(response.tensors) != 1:
            raise BadServerOutput(peer_id, f"inference response has {len(response.tensors)} tensors, expected 1")
        try:
            outputs = deserialize_tensor(response.tensors[0])
        except ValueError as e:
            raise BadServerOutput(peer_id, f"undecodable inference output: {e}") from e
        check_outputs(outputs, expected_shape=inputs.shape, peer_id=peer_id, what="inference output")
        self._record(inputs, send_from)
        self.drain_notice = read_drain_notice(response)
        self.last_outputs = outputs
        self.last_reply_pushed = is_pushed_reply(response)
        return outputs.to(dtype), send_from

    async def step(
        self,
        hidden: torch.Tensor,
        hidden_from: int,
        *,
        position: int,
        prompts: torch.Tensor,
        hypo_ids: torch.Tensor,
        step_id: str,
        extra: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """Runs positions `[min(self.position, position), position + T)`; returns (outputs, their first position).

        `hidden` [B, *, H] holds this span's inputs from `hidden_from` on. A fresh session (position 0) replays its
        whole history; a rollback (`position < self.position`) overwrites the server's cache from `position`.
        """
        compression = await self.manager.input_compression(self.span.peer_id, self.manager.block_uids[self.span.start])
        request, inputs, send_from = self._request(
            hidden, hidden_from, position, prompts, hypo_ids, step_id, compression, extra or {}
        )
        self._started = True
        await self._requests.put(request)
        try:
            response = await self._next_response()
        except StopAsyncIteration:
            raise ConnectionError(f"server ...{self.span.peer_id[-6:]} closed the inference stream") from None
        return self._accept(response, inputs, send_from, hidden.dtype)

    def can_step_here(self) -> bool:
        """True when `step_here` may run: an open local stream with a known input compression."""
        return (
            self.local is not None
            and not self.local.closed
            and not self._closed
            and self._started
            and self.manager.cached_input_compression(self.span.peer_id) is not None
        )

    def step_here(
        self,
        hidden: torch.Tensor,
        hidden_from: int,
        *,
        position: int,
        prompts: torch.Tensor,
        hypo_ids: torch.Tensor,
        step_id: str,
        extra: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """`step` in the calling thread over the local stream (no hop to the client loop). On any failure the
        stream is closed, so the async path replaces this span (replaying its history) instead of reading a late
        response as the answer to a new request."""
        assert self.local is not None
        config = self.manager.config
        compression = self.manager.cached_input_compression(self.span.peer_id)
        assert compression is not None
        request, inputs, send_from = self._request(
            hidden, hidden_from, position, prompts, hypo_ids, step_id, compression, extra or {}
        )
        try:
            response = self.local.exchange(request, timeout_s=config.request_timeout_s, poll_s=_poll_s(config))
            return self._accept(response, inputs, send_from, hidden.dtype)
        except BaseException:
            self.local.close()
            raise

    async def _next_response(self) -> runtime_pb2.ExpertResponse:
        """The next response within `request_timeout_s`; while waiting, pings the server every
        `liveness_check_period_s` so that a dead server (whose stream may never report an error) fails in seconds."""
        config = self.manager.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.request_timeout_s
        pending = asyncio.ensure_future(anext(self._responses))
        poll_s = _poll_s(config)
        poller = background_loop.get_selector() if poll_s > 0 else None
        if poller is not None and loop is background_loop.get_loop():
            poller.keep_hot(poll_s)
        try:
            while True:
                wait_s = min(config.liveness_check_period_s or math.inf, deadline - loop.time())
                done, _ = await asyncio.wait({pending}, timeout=max(wait_s, 0.0))
                if done:
                    return pending.result()
                if loop.time() >= deadline:
                    raise TimeoutError(f"no response within request_timeout_s={config.request_timeout_s}")
                if math.isinf(await self.manager.ping_s(self.span.peer_id)) and not pending.done():
                    raise ConnectionError(f"server ...{self.span.peer_id[-6:]} stopped answering pings")
        finally:
            if poller is not None:
                poller.cool()
            if not pending.done():
                pending.cancel()

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        """Mirrors the server's cache reordering for beam search on the history we keep."""
        if self._history_buf is not None:
            self._history_buf = self._history_buf[hypo_ids]

    async def _drain(self) -> None:
        async for _ in self._responses:
            pass

    async def close(self, *, drain: bool = True) -> None:
        """Ends the server session (empty request) and our input stream; `drain=False` (a failed server) does not
        wait for the server's last messages."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._started and drain:
                await self._requests.put(runtime_pb2.ExpertRequest())  # empty request = end of session
            await self._requests.put(None)  # end of our input stream
            if self._responses is not None:
                if drain:
                    await asyncio.wait_for(self._drain(), self.manager.config.connect_timeout_s)
                else:
                    await asyncio.wait_for(self._responses.aclose(), 1.0)
        except Exception as e:  # the server may already be gone; closing must never fail
            logger.debug("inference_session.close_failed(peer=...%s, error=%r)", self.span.peer_id[-6:], e)


class InferenceSession:
    """Autoregressive inference over blocks `[start, end)` of the manager's sequence, `max_length` tokens at most.

    Use as a context manager; `step(hidden [B, T, H])` returns the last block's outputs `[B, T, H]`. Setting
    `position` rolls back (the next step overwrites the servers' caches from there).
    """

    def __init__(self, manager: RemoteSequenceManager, max_length: int, *, start: int = 0, end: int | None = None):
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.manager, self.max_length = manager, max_length
        self.start, self.end = start, manager.num_blocks if end is None else end
        self._spans: list[_SpanSession] = []
        self._position = 0
        self._batch_size: int | None = None  # fixed by the first step (servers allocate caches for it)
        self._zero_prompts: torch.Tensor | None = None  # deep prompts given at position 0, needed for replays
        self._closed = False
        self.output_ids: torch.Tensor | None = None  # tokens generated so far (kept by generate())
        self.num_steps_here = 0  # steps run in the caller's thread over local streams (no client-loop hop)
        self.forwarding = StepForwarding(manager.config.server_forwarding)  # step ids, next_servers
        self.num_pushed_steps = 0  # span steps whose server answered the copy pushed by the previous server
        self.handoffs = HandoffLog()  # spans moved off draining servers with their KV cache
        self.verifier = StepVerifier(manager)  # cross-checks a `verify_fraction` of steps on other servers
        self.on_enter: list[Callable[[], None]] = []  # hooks of the module that opened this session
        self.on_exit: list[Callable[[], None]] = []

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    @property
    def route(self) -> list[tuple[RemoteSpanInfo, str | None]]:
        """The chain in use now: each span's `RemoteSpanInfo` and transport (`local`/`p2p`/None), in block order."""
        return [(s.span, s.transport) for s in list(self._spans)]

    @property
    def position(self) -> int:
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        if not 0 <= value <= self._position:
            raise ValueError(f"can only roll back to a position in [0, {self._position}], got {value}")
        self._position = value

    def step(
        self,
        inputs: torch.Tensor,
        prompts: torch.Tensor | None = None,
        hypo_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("inference session is closed")
        if inputs.ndim != 3:
            raise ValueError(f"inputs must be [batch, tokens, hidden], got shape {list(inputs.shape)}")
        batch_size, num_tokens, _ = inputs.shape
        if self._batch_size is not None and batch_size != self._batch_size:
            raise ValueError(f"this session's batch size is {self._batch_size}, got inputs of batch {batch_size}")
        if self._position + num_tokens > self.max_length:
            raise ValueError(
                f"session max_length={self.max_length} exceeded: position {self._position} + {num_tokens} new tokens"
            )
        if prompts is not None and prompts.numel() > 0:
            if prompts.ndim != 4 or prompts.shape[0] != self.num_blocks or prompts.shape[1] not in (1, batch_size):
                raise ValueError(
                    f"deep prompts must be [num_blocks={self.num_blocks}, batch or 1, prefix, hidden], got {list(prompts.shape)}"
                )
            if prompts.shape[2] > num_tokens:
                raise ValueError(f"deep prompt length {prompts.shape[2]} exceeds the {num_tokens} tokens of this step")
            prompts = prompts.detach().cpu()
        else:
            prompts = None
        if hypo_ids is not None:
            if hypo_ids.dtype != torch.int64 or hypo_ids.shape != (batch_size,):
                raise ValueError(f"hypo_ids must be int64 [{batch_size}], got {hypo_ids.dtype} {list(hypo_ids.shape)}")
            hypo_ids = hypo_ids.cpu()
        if self._position == 0:
            self._zero_prompts = prompts
        self._batch_size = batch_size
        cpu_inputs = inputs.detach().cpu()
        global _steps_in_flight
        with _steps_lock:
            _steps_in_flight += 1
        verify = prompts is None and self._zero_prompts is None and self.verifier.sample()  # see StepVerifier
        try:
            outputs = self._step_here(cpu_inputs, prompts) if hypo_ids is None and not verify else None
            if outputs is None:
                outputs = background_loop.run(self._step(cpu_inputs, prompts, hypo_ids, verify=verify))
        finally:
            with _steps_lock:
                _steps_in_flight -= 1
        if needs_handoff(self):  # a server drains: move its span's cache to another server (no replay)
            background_loop.run(hand_off_draining_spans(self))
        self._position += num_tokens
        return outputs.to(inputs.device)

    def _step_here(self, inputs: torch.Tensor, prompts: torch.Tensor | None) -> torch.Tensor | None:
        """The step in this thread when every span of the chain is on a local stream (servers on this machine):
        no hop to the client loop and back, each an idle thread's wake-up. None when not possible or when a span
        fails: then the async path runs the step (spans already stepped are re-sent from the same position, which
        the servers overwrite; the failed span's stream is closed, so it is replaced and replayed)."""
        spans = self._spans
        if not spans or spans[0].span.start != self.start or spans[-1].span.end != self.end:
            return None
        if any(a.span.end != b.span.start for a, b in zip(spans[:-1], spans[1:], strict=True)) or not all(
            s.can_step_here() for s in spans
        ):
            return None
        position, step_id = self._position, self.forwarding.take_step_id()
        hidden, hidden_from = inputs, position
        for span_index, span_session in enumerate(spans):
            span_prompts = self._prompts_for(
                span_session.span, prompts, sends_from_zero=min(span_session.position, position) == 0
            )
            try:
                hidden, hidden_from = span_session.step_here(
                    hidden,
                    hidden_from,
                    position=position,
                    prompts=span_prompts,
                    hypo_ids=DUMMY_INT64,
                    step_id=step_id,
                    extra=self.forwarding.request_extra(spans, span_index, position, step_id, allowed=False),
                )
            except Exception as e:
                logger.info(
                    "inference_session.local_step_failed(peer=...%s, error=%r): retrying through the client loop",
                    span_session.span.peer_id[-6:],
                    e,
                )
                return None
            self.manager.on_request_success(span_session.span.peer_id)
        self.num_steps_here += 1
        return hidden[:, position - hidden_from :]

    async def _step(
        self, inputs: torch.Tensor, prompts: torch.Tensor | None, hypo_ids: torch.Tensor | None, *, verify: bool = False
    ) -> torch.Tensor:
        position, step_id = self._position, self.forwarding.take_step_id()
        may_forward = prompts is None and hypo_ids is None and self._zero_prompts is None  # see client.forwarding
        if hypo_ids is not None:
            for reordered in self._spans:
                reordered.reorder(hypo_ids)
        hidden, hidden_from = inputs, position  # `hidden` holds the inputs of block `block` from `hidden_from` on
        block, index, budget = self.start, 0, RetryBudget(self.manager)
        pending_replacement: _SpanSession | None = None
        while block < self.end:
            span_session = self._spans[index] if index < len(self._spans) else None
            try:
                if span_session is None or span_session is pending_replacement:
                    await self._replace_spans(index, block, span_session)
                    pending_replacement = None
                    continue
                span = span_session.span
                if push_went_stale(span_session, step_id, position):  # its stream may hold another answer: reopen
                    logger.info("inference_session.stale_push(blocks=%d:%d): reopening the span", span.start, span.end)
                    span_session.expected_push = None
                    pending_replacement = span_session
                    continue
                span_prompts = self._prompts_for(
                    span, prompts, sends_from_zero=min(span_session.position, position) == 0
                )
                outputs, outputs_from = await span_session.step(
                    hidden,
                    hidden_from,
                    position=position,
                    prompts=span_prompts,
                    hypo_ids=hypo_ids if hypo_ids is not None else DUMMY_INT64,
                    step_id=step_id,
                    extra=self.forwarding.request_extra(self._spans, index, position, step_id, allowed=may_forward),
                )
                self.num_pushed_steps += span_session.last_reply_pushed
                if verify and span_session.last_outputs is not None and span_session.history is not None:
                    await self.verifier.verify(span, span_session.history, span_session.last_outputs)
                self.manager.on_request_success(span.peer_id)
                budget.on_success()
                hidden, hidden_from = outputs, outputs_from
                block, index = span.end, index + 1
            except Exception as e:
                if isinstance(e, (AssertionError, asyncio.CancelledError)):
                    raise
                replacing = span_session is None or span_session is pending_replacement
                failed = span_session.span.peer_id if span_session is not None and not replacing else None
                if isinstance(e, BadServerOutput) and e.taints_history:
                    for later in self._spans[index + 1 :]:  # they may hold states built from its earlier lies
                        later.position = 0
                logger.warning(
                    "inference_session.span_failed(blocks=%d:%d, peer=...%s, error=%r)",
                    block,
                    span_session.span.end if span_session is not None else self.end,
                    (failed or "?")[-6:],
                    e,
                )
                blocks = (block, span_session.span.end if span_session is not None else self.end)
                delay_s = await asyncio.to_thread(budget.on_failure, e, failed, blocks)
                await asyncio.sleep(delay_s)
                pending_replacement = span_session  # replaced (and its history replayed) on the next iteration
        assert hidden_from <= position, "the last span always covers the new tokens"
        return hidden[:, position - hidden_from :]

    def _prompts_for(
        self, span: RemoteSpanInfo, prompts: torch.Tensor | None, *, sends_from_zero: bool
    ) -> torch.Tensor:
        """Deep prompts for a span's request; a request replaying from position 0 needs the prompts of position 0."""
        source = self._zero_prompts if sends_from_zero else prompts
        if source is None:
            return DUMMY
        return source[span.start - self.start : span.end - self.start]

    async def _replace_spans(self, index: int, block: int, failed: _SpanSession | None) -> None:
        """Swaps `_spans[index]` (failed or missing) for a fresh chain covering the same blocks; the first new
        session inherits the failed one's history so that its first step replays it."""
        end = failed.span.end if failed is not None else self.end
        if failed is not None:
            await failed.close(drain=False)
        route = await asyncio.to_thread(
            self.manager.make_sequence, block, end, mode="min_latency", cache_tokens_needed=self.max_length
        )
        new_sessions: list[_SpanSession] = []
        try:
            for span in route:
                session = _SpanSession(self.manager, span, self.max_length)
                new_sessions.append(session)
                try:
                    await session.open()
                except Exception:
                    self.manager.on_request_failure(span.peer_id)  # blame the server we could not reach
                    raise
        except BaseException:
            for session in new_sessions:
                await session.close(drain=False)
            if failed is not None:  # keep a placeholder so the retry loop replans this span again
                self._spans[index] = failed
            raise
        if failed is not None and failed.history is not None:
            new_sessions[0].history = failed.history[:, : self._position]
        self._spans[index : index + 1 if failed is not None else index] = new_sessions
        chain = self._spans[max(0, index - 1) : index + len(new_sessions) + 1]
        for previous, following in zip(chain, chain[1:], strict=False):
            following.upstream_peer = previous.span.peer_id
        logger.debug(
            "inference_session.route(blocks=%d:%d) %s",
            block,
            end,
            " => ".join(
                f"{s.span.start}:{s.span.end} via ...{s.span.peer_id[-6:]} ({s.transport})" for s in new_sessions
            ),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def _close_all() -> None:
            await asyncio.gather(*(session.close() for session in self._spans), return_exceptions=True)

        background_loop.run(_close_all(), timeout_s=self.manager.config.connect_timeout_s + 5)
        self._spans = []

    def __enter__(self) -> InferenceSession:
        for hook in self.on_enter:
            hook()
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.close()
        finally:
            for hook in self.on_exit:
                hook()
