"""Graceful drain, client side: when a server marks its responses as draining (`protocol.handoff.DrainNotice`), the
session asks it for the span's KV cache on the same stream and relays the parts, unread, to a replacement server
holding the same blocks, which validates and imports them: the session continues there with no replay. If anything
fails, the draining stream is closed and the next step replays the history, as after any failure. Works with
`SpanSession`'s request queue, response stream and history, hence beside it."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.proto import runtime_pb2

from corolla.client.calls.output_checks import REPLY_OVERHEAD_BYTES, reply_limit_bytes
from corolla.client.calls.remote_forward_backward import NO_HYPO_IDS, NO_PROMPTS
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session.span_session import SpanSession
from corolla.protocol import handoff as wire
from corolla.protocol.codecs import serialize_tensor
from corolla.protocol.metadata import decode_metadata, encode_metadata
from corolla.protocol.packing import pack_args_kwargs
from corolla.protocol.records import RemoteSpanInfo
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_CANDIDATES = 2  # replacement servers tried per hand-off before falling back to a replay
# a hand-off may take the draining server's remaining time (its word), at least this, at most the client's
# request_timeout_s, + connect_timeout_s
MIN_HANDOFF_S = 2.0
NONE = runtime_pb2.CompressionType.NONE


_closing: set[asyncio.Future] = set()  # old streams being closed in the background (kept referenced)


class HandoffFailed(RuntimeError):
    """This hand-off did not happen (no replacement, refused export or import, bad data): replay instead."""


@dataclass
class HandoffRecord:
    """One hand-off attempt of a span: where from, where to (None: fell back to replay), how much, how long."""

    start: int
    end: int
    from_peer: str
    to_peer: str | None
    position: int
    num_bytes: int
    seconds: float
    error: str | None = None


@dataclass
class HandoffLog:
    """The hand-offs of one `InferenceSession` (each span stream is tried once) and what they need of it."""

    manager: RemoteSequenceManager
    max_length: int  # the session's: a replacement must hold it
    # the session's one way to make a span session (`InferenceSession._new_span_session`): a replacement shares its
    # stall events and prefix keys as any other span of the chain does
    new_span_session: Callable[[RemoteSpanInfo], SpanSession]
    records: list[HandoffRecord] = field(default_factory=list)
    tried: set[str] = field(default_factory=set)  # span session ids already handed off or given up


def needs_handoff(log: HandoffLog, spans: list[SpanSession]) -> bool:
    """True when a span's server said it drains and that span was not handed off yet. Never with
    `ClientConfig.kv_handoff` off, nor in a client that verifies (`ClientConfig.verifies`): the
    cache is the draining server's word, relayed unread, and a poisoned one makes the replacement answer wrong
    with no check (a handed-off span session is not shadowed, its mirror would start mid-session; a step check
    would blame the replacement). Such spans are replayed from the client's history once their server ends the
    stream."""
    config = log.manager.config
    if not config.kv_handoff or config.verifies:
        return False
    return any(s.drain_notice is not None and s.session_id not in log.tried for s in spans)


async def hand_off_draining_spans(log: HandoffLog, spans: list[SpanSession]) -> None:
    """Moves every span of the live chain `spans` (block order; each moved span is swapped in place) whose server
    drains, once per span stream; on failure, closes that stream so that the next step replaces the span and
    replays its history."""
    for index, old in enumerate(list(spans)):
        if old.drain_notice is None or old.session_id in log.tried:
            continue
        log.tried.add(old.session_id)
        started = time.perf_counter()
        record = HandoffRecord(old.span.start, old.span.end, old.span.peer_id, None, old.position, 0, 0.0)
        config = log.manager.config
        timeout_s = max(MIN_HANDOFF_S, min(old.drain_notice.deadline_s, config.request_timeout_s))
        timeout_s += config.connect_timeout_s
        try:
            new, record.num_bytes = await asyncio.wait_for(_move(log, old), timeout_s)
            spans[index] = new
            for previous, following in zip(spans, spans[1:], strict=False):
                following.upstream_peer = previous.span.peer_id  # forwarding: who may push to it now
            record.to_peer = new.span.peer_id
        except Exception as e:  # anything at all: the replay path still works
            record.error = repr(e)[:300]
            logger.warning(
                "handoff.failed(blocks=%d:%d, peer=...%s, error=%r): the next step replays the history",
                old.span.start, old.span.end, old.span.peer_id[-6:], e,
            )  # fmt: skip
        record.seconds = time.perf_counter() - started
        log.records.append(record)
        if record.to_peer is None:  # the next step finds this stream closed and replays on a replacement
            await old.close(drain=False)
            continue
        # end the session on the draining server (it can then stop sooner) without making this step wait for it
        closing = asyncio.ensure_future(old.close())
        _closing.add(closing)
        closing.add_done_callback(_closing.discard)
        logger.info(
            "handoff.moved(blocks=%d:%d, from=...%s, to=...%s, position=%d, bytes=%d, seconds=%.4f)",
            record.start, record.end, record.from_peer[-6:], record.to_peer[-6:], record.position, record.num_bytes,
            record.seconds,
        )  # fmt: skip


def _candidates(log: HandoffLog, old: SpanSession) -> list[RemoteSpanInfo]:
    """Servers other than the draining one that hold all of its blocks and announce room for the session, nearest
    first; each cut to exactly the draining span."""
    start, end = old.span.start, old.span.end
    rtts = log.manager.client_rtts_s
    needed = log.max_length * (end - start)
    result = [
        dataclasses.replace(span, start=start, end=end)
        for span in log.manager.spans
        if span.peer_id != old.span.peer_id
        and span.start <= start
        and span.end >= end
        and (span.server_info.cache_tokens_left is None or span.server_info.cache_tokens_left >= needed)
    ]
    result.sort(key=lambda span: (rtts.get(span.peer_id, math.inf), -span.throughput))
    return result[:MAX_CANDIDATES]


async def _move(log: HandoffLog, old: SpanSession) -> tuple[SpanSession, int]:
    """Exports the span's cache from `old` and imports it on a replacement; returns (new span session, bytes)."""
    started = time.monotonic()
    candidates = _candidates(log, old)
    if not candidates:  # a replica may have joined since the last read (`update_period_s` may be a minute)
        await asyncio.to_thread(log.manager.reread_for_drain, old.span.peer_id, started)
        candidates = _candidates(log, old)
    if not candidates:
        raise HandoffFailed(f"no other server holds blocks {old.span.start}:{old.span.end}")
    if old.history is None or old.history.shape[1] != old.position:
        raise HandoffFailed("the span's history does not match its position")
    first = log.new_span_session(candidates[0])
    opening = asyncio.ensure_future(first.open())  # connect to the replacement while the cache is exported
    try:
        header, messages = await _export(log.manager, old)
    except BaseException:
        opening.cancel()
        await asyncio.gather(opening, return_exceptions=True)
        await first.close(drain=False)
        raise
    errors = []
    for span in candidates:
        new = first if span is candidates[0] else log.new_span_session(span)
        try:
            await (opening if new is first else new.open())
            await _import(new, old, header, messages)
            return new, header.total_bytes
        except Exception as e:
            errors.append(f"...{span.peer_id[-6:]}: {e!r:.200}")
            await new.close(drain=False)
    raise HandoffFailed(f"no replacement imported the cache ({'; '.join(errors)})")


def _empty_step(old: SpanSession) -> tuple[list[runtime_pb2.Tensor], Any, torch.Tensor]:
    """A zero-token step's tensors `[B, 0, H]` (+ dummies), its args structure and the empty inputs."""
    assert old.history is not None
    empty = old.history[:, :0]  # [B, 0, H]
    tensors, structure = pack_args_kwargs(empty, NO_PROMPTS, NO_HYPO_IDS)
    return [serialize_tensor(t, NONE) for t in tensors], structure, empty


async def _export(
    manager: RemoteSequenceManager, old: SpanSession
) -> tuple[wire.KvHeader, list[list[runtime_pb2.Tensor]]]:
    """Asks the draining server for the span's cache on its stream; checks what comes back against what we know
    (position, batch, blocks, byte counts, `kv_handoff_max_bytes`). The export has a step's deadline (decision 0168):
    its header a zero-token step's, each part the bytes received before it plus a full message's at the slow-link rate
    (`StepClock.handoff_deadline_s`), all from the request, so announcing more bytes than come buys no time; past it,
    a step's rules (`SpanSession.next_response`): the hand-off fails and the span is replayed elsewhere."""
    tensors, structure, empty = _empty_step(old)
    metadata = {"session_id": old.session_id, "args_structure": structure, wire.EXPORT_KEY: {}}
    uid = manager.make_chain(old.span.start, old.span.end)
    old.step_tokens = 0  # (a zero-token step, as its stall events tell)
    await old.send(runtime_pb2.ExpertRequest(uid=uid, tensors=tensors, metadata=encode_metadata(metadata)))
    sent_s = time.monotonic()
    first = await _export_reply(old, sent_s + old.clock.deadline_s(0), REPLY_OVERHEAD_BYTES)  # metadata only
    try:
        raw = decode_metadata(first.metadata).get(wire.KV_HEADER_KEY) if first.metadata else None
    except ValueError as e:
        raise HandoffFailed(f"garbled export header: {e}") from None
    if raw is None:
        raise HandoffFailed("the server sent no KV export")
    error = wire.export_error(raw)
    if error is not None:
        raise HandoffFailed(f"the server refused to export: {error}")
    header = wire.KvHeader.from_dict(raw)
    expected = (old.position, empty.shape[0], old.span.start, old.span.end)
    if (header.position, header.batch_size, header.start_block, header.end_block) != expected:
        raise HandoffFailed(f"export header {header} does not match the span's state {expected}")
    max_bytes = manager.config.kv_handoff_max_bytes
    if header.total_bytes > max_bytes:
        raise HandoffFailed(f"export of {header.total_bytes} bytes exceeds kv_handoff_max_bytes={max_bytes}")
    max_parts = header.max_parts  # an empty part is a few bytes on the wire and a Python object here
    messages, received, parts = [], 0, 0
    for _ in range(header.num_messages):
        # due once the bytes received so far and this message's (at most a full one) could have come at the slow-link
        # rate: the header's count alone is the drainer's word (up to `kv_handoff_max_bytes`, 1 GiB: ~18 min)
        due_s = sent_s + old.clock.handoff_deadline_s(min(header.total_bytes, received + wire.MAX_MESSAGE_BYTES))
        response = await _export_reply(old, due_s, wire.MAX_MESSAGE_BYTES + REPLY_OVERHEAD_BYTES)
        received += wire.message_bytes(response.tensors)
        parts += len(response.tensors)
        if received > header.total_bytes:
            raise HandoffFailed(f"the server sent more than the {header.total_bytes} bytes it announced")
        if parts > max_parts:
            raise HandoffFailed(f"the server sent more than the {max_parts} parts its header allows")
        messages.append(list(response.tensors))
    if received != header.total_bytes:
        raise HandoffFailed(f"the server sent {received} bytes, announced {header.total_bytes}")
    return header, messages


async def _export_reply(old: SpanSession, due_s: float, limit_bytes: int) -> runtime_pb2.ExpertResponse:
    """The draining server's next export message, due at `due_s` (`time.monotonic`): waited for under a step's rules
    with what is left until then, its time past it charged to the span's late budget (a server that sends each part
    just past the deadline spends one budget in all, not one a part)."""
    wait = old.step_wait(max(0.0, due_s - time.monotonic()))
    response = await old.next_response(wait, limit_bytes=limit_bytes)
    old.time_step(wait)
    return response


async def _import(
    new: SpanSession, old: SpanSession, header: wire.KvHeader, messages: list[list[runtime_pb2.Tensor]]
) -> None:
    """Opens the replacement's session at `header.position` with the cache parts; its first (zero-token) answer
    confirms the import, within `StepClock.handoff_deadline_s` under a step's rules (`SpanSession.next_response`;
    failing, the next candidate or a replay). The new span session inherits the old one's history (for a later
    replay)."""
    assert old.history is not None
    new.history = old.history
    new.position = header.position
    empty = old.history[:, :0]  # [B, 0, H]
    request, inputs, send_from = new.build_request(
        empty, header.position, header.position, NO_PROMPTS, NO_HYPO_IDS,
        str(uuid.uuid4()), NONE, {wire.IMPORT_KEY: header.to_dict()},
    )  # fmt: skip
    new.started = True
    new.step_tokens = 0
    deadline_s = new.clock.handoff_deadline_s(header.total_bytes)
    await new.send(request)
    for parts in messages:
        await new.send(runtime_pb2.ExpertRequest(uid=request.uid, tensors=parts))
    wait = new.step_wait(deadline_s)  # (timed from the last part sent)
    response = await new.next_response(wait, limit_bytes=reply_limit_bytes(inputs.shape))
    new.accept_reply(response, inputs, send_from, empty.dtype)
    new.time_step(wait)  # (late: charged to the new span's budget)
