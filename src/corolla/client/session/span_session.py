"""`SpanSession`: the client's inference stream to one server for blocks `[span.start, span.end)` (the server's unix
socket on this machine, its direct port, or p2p). It keeps the span's inputs (`history`), exactly what the server's
KV cache was built from, so that `InferenceSession` can replay them on a replacement server; it builds each step's
request, checks the response, and watches a silent or slow server (`StepWait`: ping, fail over with `HopStalled`
where another server holds the blocks, move with `ServerTooSlow` once the late budget is spent: decision 0144)."""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgpack
import torch
from hivemind.proto import runtime_pb2

from corolla.client import background_loop
from corolla.client.calls.output_checks import (
    REPLY_OVERHEAD_BYTES,
    BadServerOutput,
    check_fits,
    input_range_dtype,
    read_output,
    reply_limit_bytes,
)
from corolla.client.calls.remote_forward_backward import (
    NO_HYPO_IDS,
    NO_PROMPTS,
    open_socket_stream,
    serialize_activations,
)
from corolla.client.calls.retries import PushedReplyRejected, ServerTooSlow, has_alternative
from corolla.client.calls.step_request import step_payload, uid_field
from corolla.client.config import ClientConfig
from corolla.client.prefix.prefix_chain import PrefixChain
from corolla.client.routing.announced_pace import announced_step_s, announced_token_s
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session.delivery import (
    JUDGE_MIN_STEPS,
    JUDGE_PERIOD_S,
    JUDGE_WINDOW_S,
    JUDGE_WINDOW_STEPS,
    MOVE_PERIOD_S,
    MovePacer,
    Workload,
    judge,
    observed_block_s,
    pace_of,
)
from corolla.client.session.stalls import SLOW_AVOID_S, StallAction, StallEvent, StepClock
from corolla.client.session.step_wait import PING_TRIES, PINGS, Due, StepWait, ping_overslept
from corolla.client.transport.direct_transport import DirectInferenceStream
from corolla.client.transport.framed_socket import FramedSocketStream
from corolla.client.transport.local_transport import LocalInferenceStream
from corolla.client.transport.p2p_stream import InferenceStream, P2PInferenceStream
from corolla.protocol.auth import UPSTREAM_PEER_KEY
from corolla.protocol.forwarding import PUSHED_FROM_KEY, PUSHED_REPLY_KEY, flags_pushed_replies
from corolla.protocol.handoff import DRAINING_KEY, DrainNotice
from corolla.protocol.metadata import TUPLE_EXT_TYPE, decode_metadata, encode_metadata
from corolla.protocol.packing import pack_args_kwargs
from corolla.protocol.prefix import PREFIX_BLOCK_TOKENS, PREFIX_KEY, parse_prefix_hit
from corolla.protocol.records import DECODE_MAX_TOKENS, RemoteSpanInfo
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


def _packed_tuples(value: Any) -> Any:
    """`value` with each tuple replaced by the msgpack ext value hivemind's MSGPackSerializer encodes it as (so a
    constant structure is packed once, not at every request; the request's bytes stay the same)."""
    if not isinstance(value, tuple):
        return value
    packed = msgpack.packb(list(value), strict_types=True, use_bin_type=True, default=_packed_tuples)
    return msgpack.ExtType(TUPLE_EXT_TYPE, packed)


# `args_structure` of (inputs, prompts, hypo_ids) as three distinct tensors: ((b"__T0", b"__T1", b"__T2"), {})
_STEP_ARGS_STRUCTURE = _packed_tuples(pack_args_kwargs(torch.empty(0), torch.empty(0), torch.empty(0))[1])


_steps_in_flight = 0  # inference steps of this process running now (any session, any thread)
_steps_lock = threading.Lock()


class StepsInFlight:
    """The context of `steps_in_flight` (a class, not a generator: no generator and context object a step)."""

    def __enter__(self) -> None:
        global _steps_in_flight
        with _steps_lock:
            _steps_in_flight += 1

    def __exit__(self, *exc_info: object) -> None:
        global _steps_in_flight
        with _steps_lock:
            _steps_in_flight -= 1


_STEP_IN_FLIGHT = StepsInFlight()


def _forked() -> None:
    """In a forked child (a pre-forking server's worker): no step of the parent's threads is in flight here, and the
    lock is a fresh one (another thread may have held it at the fork)."""
    global _steps_in_flight, _steps_lock
    _steps_in_flight, _steps_lock = 0, threading.Lock()


os.register_at_fork(after_in_child=_forked)


def steps_in_flight() -> StepsInFlight:
    """Counts one inference step of this process as in flight while the `with` block runs."""
    return _STEP_IN_FLIGHT


def _poll_s(config: ClientConfig) -> float:
    """How long to poll for a response instead of sleeping: `busy_poll_ms`, but only while this is the process's
    only step in flight (a polling thread delays every other Python thread's GIL hand-over by up to 5 ms)."""
    return config.busy_poll_ms / 1000 if config.busy_poll_ms > 0 and _steps_in_flight == 1 else 0.0


def reply_flags(response: runtime_pb2.ExpertResponse) -> tuple[DrainNotice | None, bool, int | None]:
    """The server's drain notice in a response's metadata, whether a corolla server flagged the response as the
    answer to a step that reached it by push, and the position that step started at (None: not said, a server before
    decision 0154); None / False / None when absent or garbled (never raises: a garbled notice means no hand-off)."""
    try:
        metadata = decode_metadata(response.metadata) if response.metadata else {}
    except ValueError:
        return None, False, None
    pushed, raw = metadata.get(PUSHED_REPLY_KEY) is True, metadata.get(DRAINING_KEY)
    start = metadata.get(PUSHED_FROM_KEY)
    pushed_from = start if pushed and type(start) is int else None
    try:
        return (None if raw is None else DrainNotice.from_dict(raw)), pushed, pushed_from
    except ValueError:
        return None, pushed, pushed_from


class HopStalled(ConnectionError):
    """A server stayed silent past its step deadline and did not answer a ping while another server holds its
    blocks: the span fails over (a network failure: the server is banned like an unreachable one, never as a liar)."""


class SpanUnreachable(ConnectionError):
    """A span's stream could not be opened (the failure is `peer_id`'s, blamed by the retry budget)."""

    def __init__(self, peer_id: str, error: BaseException):
        self.peer_id = peer_id
        super().__init__(f"cannot open a stream to ...{peer_id[-6:]}: {error!r}")


class _ThreadWaiter:
    """A span session's step waited for in a stepping thread (`FramedSocketStream.exchange`'s `ReplyWaiter`): `wait`'s
    policy, its pings run on the client loop."""

    def __init__(self, session: SpanSession, wait: StepWait) -> None:
        self.session, self.wait = session, wait

    def wake_at(self, now_s: float) -> float:
        return self.wait.wake_at(now_s)

    def woke(self, asked_s: float, now_s: float) -> float:
        return self.wait.woke(asked_s, now_s)

    def idle(self) -> None:
        due = self.wait.due()
        if due is not None:
            alive = background_loop.run(self.session.answers_ping(self.wait)) if due in PINGS else True
            self.session.on_due(self.wait, due, alive)


class SpanSession:
    """The stream to one server for blocks `[span.start, span.end)`.

    `history` holds this span's inputs for positions `[0, position)` (`[B, position, H]`), i.e. exactly what the
    server's KV cache was built from, so a replacement server can be given the same inputs; None while the span
    lacks the inputs of a prefix its server reused from its cache (`history_from` > 0).
    """

    def __init__(self, manager: RemoteSequenceManager, span: RemoteSpanInfo, max_length: int):
        self.manager, self.span, self.max_length = manager, span, max_length
        self.session_id = str(uuid.uuid4())
        self._uid = manager.make_chain(span.start, span.end)  # the span's uid chain, sent in every request
        self._uid_field = uid_field(self._uid)  # (its bytes in a request: `build_payload`)
        self.position = 0  # tokens in the server's cache
        self._history_buf: torch.Tensor | None = None  # [B, capacity, H]; positions [0, _history_len) are valid
        self._history_len = 0  # == position, except in a replacement that has yet to replay its inherited history
        self._history_view: tuple[torch.Tensor, memoryview] | None = None  # (a buffer, its bytes): `_history_bytes`
        self.history_from = 0  # inputs before it were never sent: the server reused that prefix from its cache
        self.prefix: PrefixChain | None = None  # the session's token chain, when this server takes prefix keys
        self._stream: InferenceStream | None = None  # once open (p2p, or a socket stream), driven on the loop
        # `_stream` if a step may run in any one thread (`step_here`): the server's unix socket, else its direct TCP
        # port where it offers one, else p2pd's (a test's fake stream may be none of them)
        self._direct: FramedSocketStream | None = None
        # where p2pd reached the server (direct TCP only): knocked on while the link is down (`transport.link_probe`)
        self.link_address: tuple[str, int] | None = None
        self.started = False  # the server opened the session (its first request sent: no max_length after it)
        self._closed = False
        self._counted = False  # the manager counts its open stream (`stepping_through`) until it is closed
        self.upstream_peer: str | None = None  # the previous span's server: the only peer that may push to this one
        # the upstream peer its server was told (it accepts pushes only from it)
        self.declared_upstream: str | None = None
        # set when the server says it drains (client.session.handoff moves the span)
        self.drain_notice: DrainNotice | None = None
        self.last_outputs: torch.Tensor | None = None  # the last response's tensor as the server sent it (its dtype)
        self.expected_push: tuple[str, int] | None = None  # (step_id, start) last named to reach it by push
        self.last_reply_pushed = False  # the server flagged its last reply as the answer to a pushed step
        self.flags_pushes = flags_pushed_replies(span.server_info)  # it says which replies answer pushes (0169)
        # this span's recent step times: the deadline of a step's silence, and its late budget
        info = span.server_info
        self.input_range_dtype = input_range_dtype(info)  # its inputs must stay finite cast to it (None: unchecked)
        self.clock = StepClock(
            announced_step_s(span.length, info.inference_rps),
            announced_token_s(span.length, info.forward_rps, info.inference_rps),
        )
        self.step_tokens = 0  # tokens the step in flight sends (a stall event names them: a decode step or a long one)
        self.step_rows = 1  # its rows (what a step delivers is judged per row and token: `StepClock.delivered`)
        self.last_step_s = math.nan  # the last answered step's time, the server's (`time_step`)
        self.stall_events: list[StallEvent] = []  # the session shares its list with every span session
        self.too_slow = False  # its late budget ran out while another server holds its blocks: to be replaced
        # where it was left for what it delivers: the chain judged to run the session's rest faster (decision 0193)
        self.move_to: tuple[RemoteSpanInfo, ...] | None = None
        self._noted_on_time = False  # told the manager its server answered a step within its deadline
        # an inference session's spans share one (None: never judged by delivery, e.g. a verification's shadow)
        self.pacer: MovePacer | None = None
        self._judged_at_s = -math.inf  # when its delivery was last judged (`client.session.delivery`)

    async def open(self) -> None:
        """Opens the stream: over the server's unix socket when it runs on this machine, else through p2p;
        SpanUnreachable where it cannot (the server's failure, for the retry budget to blame)."""
        try:
            self._stream = self._direct = await open_socket_stream(self.manager, self.span.peer_id, "rpc_inference")
            if self._stream is None:
                opening = self.manager.open_inference_stream(self.span.peer_id)
                self._stream = stream = await asyncio.wait_for(opening, self.manager.config.connect_timeout_s)
                self._direct = stream if isinstance(stream, FramedSocketStream) else None
                self.link_address = stream.remote_address if isinstance(stream, P2PInferenceStream) else None
        except Exception as e:
            raise SpanUnreachable(self.span.peer_id, e) from e
        if not self._closed:  # (closed meanwhile: `close` found no stream to close)
            self.manager.stepping_through(self.span.peer_id)
            self._counted = True

    @property
    def local(self) -> LocalInferenceStream | None:
        """The stream when it runs over the server's unix socket (the server runs on this machine), else None."""
        return self._stream if isinstance(self._stream, LocalInferenceStream) else None

    @property
    def accepts_pushes(self) -> bool:
        """Open on its server (a push into a session the server does not have yet is dropped)."""
        return self.started and not self._closed

    @property
    def transport(self) -> str | None:
        """`local` (unix socket), `direct` (the server's TCP port) or `p2p` once open, else None."""
        if self._stream is None:
            return None
        if self.local is not None:
            return "local"
        return "direct" if isinstance(self._stream, DirectInferenceStream) else "p2p"

    @property
    def history(self) -> torch.Tensor | None:
        """This span's inputs we hold, `[B, n, H]` (a view: copy before keeping); None when we never had some."""
        if self._history_buf is None or self.history_from > 0:
            return None
        return self._history_buf[:, : self._history_len]

    @history.setter
    def history(self, value: torch.Tensor | None) -> None:
        """Replaces the history (a replacement span inherits a failed one's, replayed by its first step)."""
        self._history_buf = None if value is None else value.clone()
        self._history_len = 0 if value is None else value.shape[1]
        self.history_from = 0

    def reuse(self, position: int, inputs: torch.Tensor | None) -> None:
        """After the probe: the server keeps positions `[0, position)` of the prefix it reported, and the next step
        starts there. `inputs` [B, position, H] are this span's inputs for them if the client knows them (the
        chain's first span: the embeddings), else the span holds no history before `position`."""
        self.position = self._history_len = position
        if inputs is not None:
            self.history = inputs
        else:
            self._history_buf, self.history_from = None, position

    def lacks_inputs(self, send_from: int, hidden_from: int) -> bool:
        """Whether a step sending from `send_from` needs inputs before `hidden_from` that this span never had."""
        return send_from < hidden_from and send_from < self.history_from

    def _record(self, inputs: torch.Tensor, send_from: int, values: bytes | None = None) -> None:
        """Writes `inputs` [B, n, H] as positions `[send_from, send_from + n)`, growing the buffer by doubling (a
        whole-history copy per token would cost O(position) each step); a new buffer has room for as many tokens
        again (up to `max_length`), so the first decode step after a prompt copies nothing. `values`: the inputs'
        bytes (contiguous, native order), written into the buffer's bytes where it is one batch row (no torch call:
        a stepping thread runs this cold, where a torch slice write costs 10-30 us)."""
        end = send_from + inputs.shape[1]
        buf = self._history_buf
        if buf is None or buf.shape[1] < end or buf.shape[0] != inputs.shape[0] or buf.dtype != inputs.dtype:
            capacity = max(2 * end, 2 * (buf.shape[1] if buf is not None else 0), 16)
            grown = inputs.new_empty(inputs.shape[0], min(capacity, max(self.max_length, end)), inputs.shape[2])
            if buf is not None and send_from > 0:
                grown[:, :send_from] = buf[:, :send_from]
            self._history_buf = buf = grown
        view = self._history_bytes(buf) if values is not None and buf.shape[0] == 1 and end > send_from else None
        if view is not None:
            assert values is not None
            row = len(values) // (end - send_from)  # bytes a position
            view[send_from * row : end * row] = values
        else:
            buf[:, send_from:end] = inputs
        self._history_len = self.position = end
        self.history_from = min(self.history_from, send_from)

    def _history_bytes(self, buf: torch.Tensor) -> memoryview | None:
        """The bytes of the history buffer `buf` (kept while it is the buffer); None where it is not contiguous."""
        kept = self._history_view
        if kept is not None and kept[0] is buf:
            return kept[1]
        if not buf.is_contiguous():
            return None
        view = buf.view(-1).view(torch.uint8).numpy().data  # [B * capacity * H * itemsize] bytes, writable
        self._history_view = (buf, view)
        return view

    def inputs_from(self, send_from: int, hidden: torch.Tensor, hidden_from: int) -> torch.Tensor:
        """This span's inputs for positions `[send_from, hidden_from + hidden.shape[1])` from history + `hidden`."""
        if send_from == hidden_from:
            return hidden
        if send_from > hidden_from:
            return hidden[:, send_from - hidden_from :]
        history = self.history  # [B, have, H]
        have = 0 if history is None else history.shape[1]
        assert history is not None and have >= hidden_from, (
            f"span {self.span.start}:{self.span.end} lacks inputs [{have}, {hidden_from}) (reused from the server's "
            f"prefix cache before {self.history_from}: the session restarts the chain instead)"
        )
        return torch.cat([history[:, send_from:hidden_from], hidden], dim=1)

    def _request_parts(
        self,
        hidden: torch.Tensor,
        hidden_from: int,
        position: int,
        prompts: torch.Tensor,
        hypo_ids: torch.Tensor,
        step_id: str,
        extra: dict[str, Any],
        keys_until: int | None,
    ) -> tuple[list[torch.Tensor], bytes, torch.Tensor, int]:
        """What the request for positions `[min(self.position, position), ...)` carries: (tensors, encoded
        metadata, its inputs, their start)."""
        send_from = min(self.position, position)
        inputs = self.inputs_from(send_from, hidden, hidden_from)  # [B, n, H]
        if self.input_range_dtype is not None:  # values its server would refuse and be banned for: not sent (0170)
            check_fits(inputs, self.input_range_dtype, peer_id=self.span.peer_id, what="inputs")
            check_fits(prompts, self.input_range_dtype, peer_id=self.span.peer_id, what="prompts")
        keys = None
        if self.prefix is not None:
            keys = self.prefix.keys(send_from, send_from + inputs.shape[1] if keys_until is None else keys_until)
        if inputs is prompts or inputs is hypo_ids or prompts is hypo_ids:  # shared objects: markers shared too
            tensors, structure = pack_args_kwargs(inputs, prompts, hypo_ids)
        else:
            tensors, structure = [inputs, prompts, hypo_ids], _STEP_ARGS_STRUCTURE
        metadata: dict[str, Any] = {
            "session_id": self.session_id,
            "step_id": step_id,
            "args_structure": structure,
            **self.manager.request_metadata(self.span.peer_id),
            **extra,  # client.session.forwarding: next step id, next_servers
        }
        if keys_until is None:  # a probe's session starts at the server's hit, not at 0 (which truncates)
            metadata["start_from_position"] = send_from
        if keys is not None:
            metadata[PREFIX_KEY] = keys.to_wire()
        if self.upstream_peer is not None and self.upstream_peer != self.declared_upstream:
            metadata[UPSTREAM_PEER_KEY] = self.declared_upstream = self.upstream_peer  # who may rpc_push to it
        if not self.started:
            metadata["max_length"] = self.max_length
            if self.manager.config.alloc_timeout_s:
                metadata["alloc_timeout"] = float(self.manager.config.alloc_timeout_s)
        return tensors, encode_metadata(metadata), inputs, send_from

    def build_request(
        self,
        hidden: torch.Tensor,
        hidden_from: int,
        position: int,
        prompts: torch.Tensor,
        hypo_ids: torch.Tensor,
        step_id: str,
        compression: int,
        extra: dict[str, Any],
        keys_until: int | None = None,
    ) -> tuple[runtime_pb2.ExpertRequest, torch.Tensor, int]:
        """The request for positions `[min(self.position, position), ...)`: (request, its inputs, their start). With
        prefix keys, it names the blocks it completes (or, for the probe, those of positions `[0, keys_until)`, and
        no start position)."""
        tensors, metadata, inputs, send_from = self._request_parts(
            hidden, hidden_from, position, prompts, hypo_ids, step_id, extra, keys_until
        )
        return self._message(tensors, compression, metadata), inputs, send_from

    def build_payload(
        self,
        hidden: torch.Tensor,
        hidden_from: int,
        position: int,
        prompts: torch.Tensor,
        hypo_ids: torch.Tensor,
        step_id: str,
        compression: int,
        extra: dict[str, Any],
    ) -> tuple[bytes, bytes | None, torch.Tensor, int]:
        """`build_request`'s request serialized: (its bytes, the inputs' values as sent where the usual step's
        bytes were built directly (`step_request.step_payload`) else None, its inputs, their start)."""
        tensors, metadata, inputs, send_from = self._request_parts(
            hidden, hidden_from, position, prompts, hypo_ids, step_id, extra, None
        )
        built = step_payload(self._uid_field, tensors, compression, metadata)
        if built is not None:
            return built[0], built[1], inputs, send_from
        return self._message(tensors, compression, metadata).SerializeToString(), None, inputs, send_from

    def _message(self, tensors: Sequence[torch.Tensor], compression: int, metadata: bytes) -> runtime_pb2.ExpertRequest:
        """A step's request as a message (the way of every request `step_request.step_payload` does not build)."""
        return runtime_pb2.ExpertRequest(
            uid=self._uid, tensors=serialize_activations(tensors, compression), metadata=metadata
        )

    def accept_reply(
        self,
        response: runtime_pb2.ExpertResponse,
        inputs: torch.Tensor,
        send_from: int,
        dtype: torch.dtype,
        values: bytes | None = None,
        *,
        step_id: str | None = None,
    ) -> tuple[torch.Tensor, int]:
        """Checks the response (else BadServerOutput, or PushedReplyRejected where it may answer the copy of step
        `step_id` pushed to it), records the inputs (`values`: their bytes as sent, where known) as the server's
        cache contents; returns (outputs, first position)."""
        peer_id = self.span.peer_id
        drain_notice, pushed, pushed_from = reply_flags(response)
        expected = self.expected_push  # (step id, start) of a push the client named this span to receive
        # the answer to that push, as its server says, or may be where it cannot say (a stock Petals server)
        may_answer_push = pushed or not self.flags_pushes
        push_named = may_answer_push and expected is not None and step_id is not None and expected[0] == step_id
        try:
            if len(response.tensors) != 1:
                raise BadServerOutput(peer_id, f"inference response has {len(response.tensors)} tensors, expected 1")
            if push_named and pushed_from is not None and expected is not None and pushed_from != expected[1]:
                raise BadServerOutput(peer_id, f"answer to a step from position {pushed_from}, not {expected[1]}")
            outputs = read_output(
                response.tensors[0], expected_shape=inputs.shape, peer_id=peer_id, what="inference output", dtype=dtype
            )
        except BadServerOutput as e:
            if push_named:
                message = f"{e} (the answer to the copy pushed to it)"
                raise PushedReplyRejected(peer_id, self.declared_upstream, message) from e
            raise
        self._record(inputs, send_from, values)
        self.drain_notice, self.last_reply_pushed = drain_notice, pushed
        self.last_outputs = outputs
        return (outputs if outputs.dtype == dtype else outputs.to(dtype)), send_from

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
        request, inputs, send_from = self.build_request(
            hidden, hidden_from, position, prompts, hypo_ids, step_id, compression, extra or {}
        )
        wait = self._begin(inputs)
        response = await self.next_response(wait, limit_bytes=reply_limit_bytes(inputs.shape), request=request)
        result = self.accept_reply(response, inputs, send_from, hidden.dtype, step_id=step_id)
        self.time_step(wait)
        return result

    async def probe(self, keys_until: int, like: torch.Tensor) -> int:
        """The session's first request: zero tokens with the keys of positions `[0, keys_until)`; returns how many
        leading positions the server holds (its `corolla.prefix_hit`, 0 from a server without a cache). `like`
        [B, *, H] gives the batch, hidden size and dtype. A malformed answer is BadServerOutput."""
        assert self.prefix is not None and not self.started, "a probe opens a keyed session"
        compression = await self.manager.input_compression(self.span.peer_id, self.manager.block_uids[self.span.start])
        empty = like[:, :0]  # [B, 0, H]
        request, _, _ = self.build_request(
            empty, 0, 0, NO_PROMPTS, NO_HYPO_IDS, str(uuid.uuid4()), compression, {}, keys_until=keys_until
        )
        wait = self._begin(empty)  # (a loris may not hold the probe either)
        response = await self.next_response(wait, limit_bytes=reply_limit_bytes(empty.shape), request=request)
        self.accept_reply(response, empty, 0, like.dtype)
        try:
            metadata = decode_metadata(response.metadata) if response.metadata else {}
            limit = keys_until // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS
            return parse_prefix_hit(metadata, max_positions=limit)
        except ValueError as e:
            raise BadServerOutput(self.span.peer_id, f"bad prefix hit: {e}") from e

    async def send(self, request: runtime_pb2.ExpertRequest) -> None:
        """Writes one request to the open stream (on the client loop)."""
        if self._stream is None or self._closed or self._stream.closed:  # closed: e.g. after a failed step_here
            raise ConnectionError(f"the stream to ...{self.span.peer_id[-6:]} is not open")
        await self._stream.send(request)

    def can_step_here(self) -> bool:
        """True when `step_here` may run: an open socket stream with a known input compression."""
        return (
            self._direct is not None
            and not self._direct.closed
            and not self._closed
            and self.started
            and self.manager.cached_input_compression(self.span.peer_id) is not None
            and not self.too_slow
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
        """`step` in the calling thread over the socket stream (no hop to the client loop). On any failure the
        stream is closed, so the async path replaces this span (replaying its history) instead of reading a late
        response as the answer to a new request. Its wait is `step`'s (`client.session.step_wait`; the pings through
        the client loop), without pings over the same-host socket (its server's liveness is the socket's)."""
        stream = self._direct
        assert stream is not None
        config = self.manager.config
        compression = self.manager.cached_input_compression(self.span.peer_id)
        assert compression is not None
        payload, values, inputs, send_from = self.build_payload(
            hidden, hidden_from, position, prompts, hypo_ids, step_id, compression, extra or {}
        )
        wait = self._begin(inputs, pings=self.local is None)
        try:
            response = stream.exchange(
                payload,
                timeout_s=config.request_timeout_s,
                poll_s=_poll_s(config),
                max_response_bytes=reply_limit_bytes(inputs.shape),
                waiter=_ThreadWaiter(self, wait),
            )
            result = self.accept_reply(response, inputs, send_from, hidden.dtype, values)
        except BaseException:
            stream.close()
            raise
        self.time_step(wait)
        return result

    def _begin(self, inputs: torch.Tensor, *, pings: bool = True) -> StepWait:
        """Marks a step of `inputs` [B, n, H] as sent (the server opens the session at it; a stall event names its
        tokens) and returns its wait (`step_wait`) under the clock's deadline for it."""
        self.started = True
        self.step_rows, self.step_tokens = inputs.shape[0], inputs.shape[1]
        return self.step_wait(self.clock.deadline_s(inputs.shape[1], inputs.nbytes), pings=pings)

    def step_wait(self, stall_deadline_s: float | None, *, pings: bool = True) -> StepWait:
        """The wait policy of a step starting now, silent past `stall_deadline_s` (`client.session.step_wait`)."""
        config = self.manager.config
        return StepWait(
            self.clock, time.monotonic(), stall_deadline_s, timeout_s=config.request_timeout_s,
            ping_period_s=config.liveness_check_period_s, max_wait_s=config.max_wait_s, pings=pings,
        )  # fmt: skip

    def on_due(self, wait: StepWait, due: Due, alive: bool) -> None:
        """Does what `wait` says is due at a wake without the reply (`alive`: the ping's answer, where it asked for
        one): TimeoutError past the timeout; past the late budget, leaves the server where it may (ServerTooSlow);
        after a ping at the deadline or an unanswered one, judges the server's silence (HopStalled: fail over)."""
        if due == "timeout":
            timeout_s = self.manager.config.request_timeout_s
            raise TimeoutError(f"no response from ...{self.span.peer_id[-6:]} within {timeout_s} s (or max_wait_s)")
        if due == "late":
            if wait.stall_deadline_s is not None and self._may_move():
                self._move_off(wait.at_s, wait.stall_deadline_s)
        elif wait.pinged(due, alive):
            self._on_silence(wait.at_s, alive=alive, stall_deadline_s=wait.stall_deadline_s)

    def _may_move(self) -> bool:
        """Whether a slow server may be left: other unbanned servers cover its blocks, and the client may avoid it
        (`RemoteSequenceManager.may_avoid`: not where its region would lose a block)."""
        peer_id, blocks = self.span.peer_id, (self.span.start, self.span.end)
        return has_alternative(self.manager, peer_id, blocks) and self.manager.may_avoid(peer_id)

    def time_step(self, wait: StepWait) -> None:
        """After a step of `step_tokens` answered at `wait`'s last wake: its time (the server's,
        `client.session.step_wait`) feeds the clock's deadlines or, past its deadline, the late budget, and counts in
        what the span delivers. Answered at a wake that overslept (when the reply came is not known), none of this."""
        num_tokens, elapsed_s, answered_s = self.step_tokens, wait.at_s, wait.now_s
        stall_deadline_s = wait.stall_deadline_s
        self.last_step_s = elapsed_s
        if not wait.overslept:
            self.clock.delivered(num_tokens, elapsed_s, answered_s, rows=self.step_rows)
        if stall_deadline_s is not None and elapsed_s > stall_deadline_s:
            self.clock.charge_late(elapsed_s - stall_deadline_s, answered_s)
        elif not wait.overslept:
            self.clock.record(num_tokens, elapsed_s)
            if not self._noted_on_time:  # once a session: a replacement race tries such servers first (0163)
                self._noted_on_time = True
                self.manager.note_on_time(self.span.peer_id)
        # (late steps too: one answering each step just past its deadline delivers slowly, decision 0201)
        if num_tokens > DECODE_MAX_TOKENS:  # a prompt's or a replay's pace, for the client's next judgments (0193)
            token_s = self.clock.delivered_token_s(JUDGE_WINDOW_STEPS)
            if token_s is not None:
                self.manager.observed_steps.note_long(self.span.peer_id, token_s / self.span.length, answered_s)
        if self.pacer is not None and answered_s - self._judged_at_s >= JUDGE_PERIOD_S:
            self._judged_at_s = answered_s
            self.judge_delivery(answered_s)

    def judge_delivery(self, now_s: float, step_tokens: int = 0) -> bool:
        """Notes what the span delivers on decode steps for routes (`routing.observed_steps`) and marks it `too_slow`
        (the next step replaces it, as after a stall) where `delivery.judge` finds a chain of its blocks that pays for
        a move: after a step (`step_tokens` 0), or before a long step of `step_tokens` (a new turn's prompt). The
        server is avoided `MOVE_PERIOD_S`, not banned. True where it moves."""
        delivered_s = self.clock.delivered_step_s(JUDGE_MIN_STEPS, JUDGE_WINDOW_STEPS, JUDGE_WINDOW_S, now_s)
        token_s = self.clock.delivered_token_s(JUDGE_WINDOW_STEPS)
        peer_id, blocks = self.span.peer_id, (self.span.start, self.span.end)
        if delivered_s is not None:
            block_s = observed_block_s(self.manager, peer_id, delivered_s, self.span.length)
            self.manager.observed_steps.note(peer_id, block_s, now_s)
        if step_tokens <= 0 and delivered_s is None:
            return False
        if step_tokens > 0 and token_s is None and self.manager.observed_steps.token_block_s(peer_id, now_s) is None:
            return False  # its long steps never seen: its record's word against the others'
        if self.pacer is None or self.too_slow or not self.pacer.may_move(now_s, blocks, delivered_s):
            return False
        history = self.history
        work = Workload(
            step_tokens, self.max_length - self.position - step_tokens, self.position,
            0 if history is None else history.nbytes,
        )  # fmt: skip
        own = pace_of(self.manager, self.span, now_s, step_s=delivered_s, token_s=token_s)
        verdict = judge(self.manager, self.span, own, work, now_s)
        # (the region's other servers need not cover the blocks: the chain's RTTs are priced; decision 0196)
        if verdict is None or not self.manager.avoid(peer_id, MOVE_PERIOD_S, keep_region=False, slow=True):
            return False
        self.pacer.moved(now_s, blocks, verdict.promised_s)
        # (the servers the session goes to are marked pending as it reaches them, not the verdict's: decision 0214)
        self.too_slow, self.move_to = True, verdict.route
        tokens = step_tokens or self.step_tokens
        self.stall_events.append(StallEvent(peer_id, blocks, verdict.delivered_s, verdict.other_s, "outpaced", tokens))
        logger.warning(
            "span_session.outpaced(peer=...%s, blocks=%d:%d, step_tokens=%d, step_s=%.3f, route=%s, "
            "route_step_s=%.3f, saving_s=%.1f, price_s=%.1f): moving the session, the server avoided for %.0f s",
            peer_id[-6:], *blocks, tokens, verdict.delivered_s,
            " => ".join(f"{hop.start}:{hop.end} via ...{hop.peer_id[-6:]}" for hop in verdict.route),
            verdict.other_s, verdict.saving_s, verdict.price_s, MOVE_PERIOD_S,
        )  # fmt: skip
        return True

    def _move_off(self, waited_s: float, stall_deadline_s: float) -> None:
        """The span's late budget ran out while another server holds its blocks: records the move, avoids the server
        for `SLOW_AVOID_S` (not a ban: it answered, slowly) and raises ServerTooSlow (the session replays the span's
        history elsewhere)."""
        blocks, peer_id = (self.span.start, self.span.end), self.span.peer_id
        self.too_slow = True
        self.stall_events.append(StallEvent(peer_id, blocks, waited_s, stall_deadline_s, "moved", self.step_tokens))
        logger.warning(
            "span_session.too_slow(peer=...%s, blocks=%d:%d, waited_s=%.2f, step_deadline_s=%.2f): moving the session,"
            " the server avoided for %.0f s", peer_id[-6:], blocks[0], blocks[1], waited_s, stall_deadline_s,
            SLOW_AVOID_S,
        )  # fmt: skip
        self.manager.avoid(peer_id, SLOW_AVOID_S, slow=True)  # replacement chains are planned without it
        self.manager.suspect_unproven(SLOW_AVOID_S)  # and new sessions' chains over servers seen on time (0163)
        raise ServerTooSlow(
            peer_id, f"server ...{peer_id[-6:]} answers pings but its steps ran past their deadlines (last one "
            f"{waited_s:.1f} s, deadline {stall_deadline_s:.2f} s) while another server holds its blocks",
        )  # fmt: skip

    async def answers_ping(self, wait: StepWait) -> bool:
        """Whether the server answers a ping (on the client loop). A ping that failed only after its timeout overslept
        (the client's loop paused past it: `step_wait.ping_overslept`) proves nothing: its time past the timeout is
        credited to `wait`'s step, and it is asked again (at most `PING_TRIES` in all)."""
        timeout_s = self.manager.config.ping_timeout_s
        for _ in range(PING_TRIES):
            asked_s = time.monotonic()
            if not math.isinf(await self.manager.ping_s(self.span.peer_id)):
                return True
            took_s = time.monotonic() - asked_s
            if not ping_overslept(took_s, timeout_s):
                return False
            wait.lost_s += took_s - timeout_s
        return False

    async def next_response(
        self, wait: StepWait, *, limit_bytes: int, request: runtime_pb2.ExpertRequest | None = None
    ) -> runtime_pb2.ExpertResponse:
        """The next response, of at most `limit_bytes` (what the request implies: `output_checks.reply_limit_bytes`;
        else ConnectionError), waited for under `wait`'s policy (`client.session.step_wait`; `on_due`: HopStalled,
        ServerTooSlow, TimeoutError); ConnectionError when the server ended the stream. The step answered at `wait`'s
        last wake. `request`: sent first, under the same wait (a server that leaves a long request unread, pings
        answered, holds the write as a loris holds its reply: decision 0245)."""
        config = self.manager.config
        if self._stream is None:
            raise ConnectionError(f"the stream to ...{self.span.peer_id[-6:]} is not open")
        loop = asyncio.get_running_loop()
        stream, read_s = self._stream, [math.nan]  # (when the reply was read: `StepWait.replied`)

        async def receive() -> runtime_pb2.ExpertResponse | None:
            if request is not None:
                await self.send(request)
            response = await stream.receive(limit_bytes)
            read_s[0] = time.monotonic()
            return response

        pending: asyncio.Future[runtime_pb2.ExpertResponse | None] = asyncio.ensure_future(receive())
        poll_s = _poll_s(config)
        poller = background_loop.get_selector() if poll_s > 0 else None
        if poller is not None and loop is background_loop.get_loop():
            poller.keep_hot(poll_s)
        try:
            while True:
                now_s = time.monotonic()
                asked_s = wait.wake_at(now_s)
                done, _ = await asyncio.wait({pending}, timeout=asked_s - now_s)
                wait.woke(asked_s, time.monotonic())
                if done:
                    response = pending.result()
                    wait.replied(read_s[0])
                    if response is None:
                        raise ConnectionError(f"server ...{self.span.peer_id[-6:]} closed the inference stream")
                    return response
                due = wait.due()
                if due is None:
                    continue
                alive = await self.answers_ping(wait) if due in PINGS else True
                if not pending.done():  # (answered meanwhile: the reply is read at the next wake)
                    self.on_due(wait, due, alive)
        finally:
            if poller is not None:
                poller.cool()
            if not pending.done():
                pending.cancel()

    def _on_silence(self, waited_s: float, *, alive: bool, stall_deadline_s: float | None) -> None:
        """Decides after a ping of a silent server: wait (it answered: slow; or it is the only server of its
        blocks), else raise HopStalled (fail over)."""
        blocks = (self.span.start, self.span.end)
        failing_over = not alive and has_alternative(self.manager, self.span.peer_id, blocks)
        action: StallAction = "slow" if alive else "failed_over" if failing_over else "waited"
        self.stall_events.append(
            StallEvent(self.span.peer_id, blocks, waited_s, stall_deadline_s, action, self.step_tokens)
        )
        logger.warning(
            "span_session.hop_silent(peer=...%s, blocks=%d:%d, waited_s=%.2f, step_deadline_s=%s, answers_ping=%s, "
            "action=%s)",
            self.span.peer_id[-6:], blocks[0], blocks[1], waited_s,
            "none" if stall_deadline_s is None else f"{stall_deadline_s:.2f}", alive, action,
        )  # fmt: skip
        if failing_over:
            raise HopStalled(
                f"server ...{self.span.peer_id[-6:]} silent for {waited_s:.1f} s (step deadline "
                f"{stall_deadline_s}) and not answering pings"
            )

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        """Mirrors the server's cache reordering for beam search on the history we keep."""
        if self._history_buf is not None:
            self._history_buf = self._history_buf[hypo_ids]

    async def _drain(self, stream: InferenceStream) -> None:
        """Reads the server's last messages until it ends the stream: none is the answer to a step any more (the
        session is over), so none may be bigger than a reply without outputs."""
        while await stream.receive(REPLY_OVERHEAD_BYTES) is not None:
            pass

    async def close(self, *, drain: bool = True) -> None:
        """Ends the server session (empty request) and our input stream; `drain=False` (a failed server) does not
        wait for the server's last messages."""
        if self._closed:
            return
        self._closed = True
        if self._counted:
            self._counted = False
            self.manager.stepped_off(self.span.peer_id)
        stream = self._stream
        if stream is None:
            return
        try:
            if drain:
                if self.started:
                    await stream.send(runtime_pb2.ExpertRequest())  # empty request = end of session
                await stream.send_end()  # end of our input stream
                await asyncio.wait_for(self._drain(stream), self.manager.config.connect_timeout_s)
        except Exception as e:  # the server may already be gone; closing must never fail
            logger.debug("inference_session.close_failed(peer=...%s, error=%r)", self.span.peer_id[-6:], e)
        finally:
            stream.close()
