"""Server-to-server forwarding of inference steps (`ClientConfig.server_forwarding`): each span's request names the
following spans that can take its outputs by push (`next_servers`, Petals' wire format), so the last span's reply
reaches the client after n+1 one-way delays instead of 2n. The client still sends every span its own copy (same
`step_id`; servers de-duplicate): a lost or refused push costs latency, never correctness. Each request announces
the client's next step id (`NEXT_STEP_KEY`): a corolla server runs a pushed step only if it carries that id.

A span is pushed to only when the push would be exactly the request the client sends it (same start position, no
deep prompts nor `hypo_ids`, an open session whose server knows its upstream). A session's first request names no
`next_servers`: stock Petals 2.2 servers push every later step with their first request's metadata and tensors."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from hivemind.p2p import P2PHandlerError

from corolla.client.calls.retries import PushedReplyRejected
from corolla.client.routing.push_suspects import PushSuspects
from corolla.client.session.span_session import SpanSession
from corolla.protocol.forwarding import NEXT_STEP_KEY
from corolla.swarm.cache_refusals import is_cache_refusal


def _start(span: SpanSession, position: int) -> int:
    """The position a span's request for a step at `position` starts from (a replacement replays from 0)."""
    return min(span.position, position)


def can_push(source: SpanSession, target: SpanSession, position: int, suspects: PushSuspects | None = None) -> bool:
    """Whether `source`'s outputs for a step at `position` are exactly `target`'s next request, and the client may
    name that push now (`suspects`: not after an answer to one of theirs failed the checks, decision 0169)."""
    return (
        source.span.end == target.span.start
        and source.accepts_pushes  # not the source session's first request (see the module docstring)
        and target.accepts_pushes
        and target.declared_upstream == source.span.peer_id
        and _start(source, position) == _start(target, position)
        and (suspects is None or suspects.may_push(source.span.peer_id, target.span.peer_id))
    )


def push_chain(
    spans: Sequence[SpanSession], index: int, position: int, suspects: PushSuspects | None = None
) -> list[SpanSession]:
    """The spans after `spans[index]` that this step's outputs reach by push, in order (maybe none)."""
    chain: list[SpanSession] = []
    source = spans[index]
    for target in spans[index + 1 :]:
        if not can_push(source, target, position, suspects):
            break
        chain.append(target)
        source = target
    return chain


IDS_A_DRAW = 64  # step ids whose random bytes one `os.urandom` call draws


def random_ids() -> Iterator[str]:
    """`str(uuid.uuid4())`'s strings (the same random bits, version 4, RFC 4122 variant), the random bytes drawn
    `IDS_A_DRAW` ids at a time: a step's id costs no system call and no `UUID` object (~10 us a step in a client's
    stepping thread, cold after its wait: benchmarks.users.client_cpu)."""
    while True:
        data = bytearray(os.urandom(16 * IDS_A_DRAW))
        for i in range(0, len(data), 16):
            data[i + 6] = data[i + 6] & 0x0F | 0x40  # version 4
            data[i + 8] = data[i + 8] & 0x3F | 0x80  # variant 10xx
            h = data[i : i + 16].hex()
            yield f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class StepForwarding:
    """Step ids and the forwarding metadata of one `InferenceSession`."""

    def __init__(self, enabled: bool, suspects: PushSuspects | None = None):
        self.enabled = enabled
        self.suspects = suspects  # the client's pushes not to name for now (its sequence manager's)
        self._ids = random_ids()
        self._next_step_id = next(self._ids)

    def take_step_id(self) -> str:
        """The id of the step starting now (the one announced so far); announces a fresh one for the next step."""
        step_id, self._next_step_id = self._next_step_id, next(self._ids)
        return step_id

    def request_extra(
        self, spans: Sequence[SpanSession], index: int, position: int, step_id: str, *, allowed: bool
    ) -> dict[str, Any]:
        """Metadata to add to `spans[index]`'s request: the next step's id and, when `allowed` (no prompts, no
        hypo_ids), the `next_servers` chain; marks the spans named there as expecting this step by push."""
        if not self.enabled:
            return {}
        extra: dict[str, Any] = {NEXT_STEP_KEY: self._next_step_id}
        chain = push_chain(spans, index, position, self.suspects) if allowed else []
        if chain:
            extra["next_servers"] = [[s.span.peer_id, s.session_id, s.span.start, s.span.end] for s in chain]
            for target in chain:
                target.expected_push = (step_id, _start(target, position))
        return extra


def push_went_stale(span: SpanSession, step_id: str, position: int) -> bool:
    """True when `span` may have answered this step by push from another start position than the request the
    client must send it now (e.g. a tainted history makes it replay): its stream may hold an answer that is not the
    one the client needs, so the span must be reopened instead."""
    return (
        span.expected_push is not None
        and span.expected_push[0] == step_id
        and (span.expected_push[1] != _start(span, position))
    )


def refusal_after_push(span: SpanSession, error: BaseException) -> PushedReplyRejected | None:
    """`error` as the push's maybe-fault where `span`'s server refused a step (its own error, not the network's or a
    full cache) while it cannot flag its answers to pushes (a stock Petals server) and the client named it to receive
    pushes in this span session: a Petals server takes any start a push names, so an upstream's push from an earlier
    start rolls its cache back and it refuses the client's next step (decision 0169). None otherwise."""
    if span.flags_pushes or span.expected_push is None or not isinstance(error, P2PHandlerError):
        return None
    if is_cache_refusal(error):
        return None
    message = f"{error} (refused by a server named to receive pushes, which cannot say whether one caused it)"
    return PushedReplyRejected(span.span.peer_id, span.declared_upstream, message)
