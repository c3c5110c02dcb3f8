"""The per-session push rules (`SessionPushGuard`, `screen_step`): `rpc_push` only from the upstream peer the
session's client named, only the step the client announced next (once), no bigger than a step that client sent, no
deeper rewind than its last step, no prompts/hypo_ids/control keys, and onward pushes only to hops that client named
itself (docs/contracts.md, "Server-to-server forwarding")."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from hivemind.proto import runtime_pb2

from corolla.protocol.auth import parse_upstream_peer
from corolla.protocol.forwarding import PUSHED_FROM_KEY, PUSHED_REPLY_KEY, parse_next_step_id
from corolla.protocol.metadata import InferenceRequestMetadata, decode_metadata, encode_metadata
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_DECLARED_NEXT_HOPS = 64  # (peer, session) pairs a session's client may name as its next hop
MAX_PUSHED_TENSORS = 3  # hidden states, prompts, hypo_ids (as Petals packs them)


def _step_tokens(request: runtime_pb2.ExpertRequest) -> int | None:
    """T of the `[B, T, H]` hidden states a step carries, read from the declared size (nothing is decoded)."""
    tensors = request.tensors
    if not tensors:
        return None
    size = tensors[0].size  # (the repeated field itself: no list copy)
    return int(size[1]) if len(size) == 3 else None


@dataclass
class SessionPushGuard:
    """Who may push into one session, what a pushed step may be, and where it may be pushed on.

    `upstream` is the peer its client named (`corolla.upstream_peer`) when opening it or in a later direct step;
    None (e.g. a stock Petals client, which names none) refuses every push: such clients send every step directly,
    so nothing is lost. `next_hops` are the `(peer, session_id)` the client itself named as next hop: a pushed step
    may be pushed on only there, so an upstream cannot make this server push into other people's sessions. The
    rest bounds what an upstream can make this server compute for the session (`admit_push`): one step per step
    of the client, with the id the client announced (`corolla.next_step_id`), at most as many tokens as the
    client's biggest step, and a rewind no deeper than the client's last step."""

    upstream: str | None = None
    next_hops: set[tuple[str, str]] = field(default_factory=set)
    expected_step_id: str | None = None  # the step id the client announced for its next step; used once
    min_push_start: int | None = None  # lowest start_from_position a pushed step may have (None: refuse)
    max_step_tokens: int = 0  # most tokens in any step the client sent directly

    @classmethod
    def from_open_request(cls, metadata: InferenceRequestMetadata) -> SessionPushGuard:
        """The guard of a session opened with `metadata` (ValueError on a malformed upstream peer id)."""
        guard = cls()
        guard.observe_client_step(metadata)
        return guard

    def accepts_push_from(self, sender: str | None) -> bool:
        return self.upstream is not None and sender == self.upstream

    def observe_client_step(self, metadata: InferenceRequestMetadata) -> None:
        """Learns from a step the session's own client sent on its stream (never from a pushed one)."""
        upstream = parse_upstream_peer(metadata.extra)
        if upstream is not None:
            self.upstream = upstream
        if metadata.next_servers:
            if len(self.next_hops) >= MAX_DECLARED_NEXT_HOPS:
                self.next_hops.clear()
            hop = metadata.next_servers[0]
            self.next_hops.add((hop.peer_id, hop.session_id))

    def observe_direct_request(
        self, metadata: InferenceRequestMetadata, request: runtime_pb2.ExpertRequest, *, prefix_length: int
    ) -> None:
        """Learns from every request of the session's own client, also one skipped because its pushed copy was
        answered first (`prefix_length`: the session's length before the request). ValueError if malformed."""
        self.observe_client_step(metadata)
        self.expected_step_id = parse_next_step_id(metadata.extra)
        start = metadata.start_from_position if metadata.start_from_position is not None else prefix_length
        tokens = _step_tokens(request) or 0
        self.min_push_start = start + min(tokens, 1)  # the client's next step keeps at least one of these tokens
        self.max_step_tokens = max(self.max_step_tokens, tokens)

    def admit_push(
        self,
        metadata: InferenceRequestMetadata,
        request: runtime_pb2.ExpertRequest,
        *,
        prefix_length: int,
        args_structure: object,
    ) -> str | None:
        """None if a pushed step may run (its announced id is then used up), else why not."""
        if metadata.step_id is None or metadata.step_id != self.expected_step_id:
            return "step_id is not the next step the session's client announced"
        if metadata.args_structure is not None and metadata.args_structure != args_structure:
            return "args_structure differs from the session's"
        if len(request.tensors) > MAX_PUSHED_TENSORS or any(
            math.prod(tensor.size) != 0 for tensor in request.tensors[1:]
        ):
            return "a pushed step carries prompts or hypo_ids (only hidden states may be pushed)"
        tokens = _step_tokens(request)
        if tokens is None or not 1 <= tokens <= self.max_step_tokens:
            return f"{tokens} tokens, not in [1, {self.max_step_tokens}] (the client's biggest step)"
        start = metadata.start_from_position
        if start is None or self.min_push_start is None or not self.min_push_start <= start <= prefix_length:
            return f"start_from_position={start} outside [{self.min_push_start}, {prefix_length}]"
        self.expected_step_id = None
        return None

    def may_push_on(self, metadata: InferenceRequestMetadata) -> bool:
        """Whether a step's `next_servers[0]` may receive this step's outputs by push."""
        if not metadata.next_servers:
            return False
        if not metadata.pushed:
            return True  # the session's own client named it
        hop = metadata.next_servers[0]
        return (hop.peer_id, hop.session_id) in self.next_hops


def screen_step(
    guard: SessionPushGuard | None,
    request: runtime_pb2.ExpertRequest,
    metadata: InferenceRequestMetadata,
    *,
    prefix_length: int,
    args_structure: object,
    already_seen: bool,
) -> InferenceRequestMetadata | None:
    """The metadata to run a session's step with, or None to drop it: a direct step teaches the guard; a pushed one
    not yet seen must pass `admit_push` (a session without a guard runs no pushed step) and loses every extension
    key (a push may not carry the client's control keys, e.g. a KV export request)."""
    if not metadata.pushed:
        if guard is not None:
            guard.observe_direct_request(metadata, request, prefix_length=prefix_length)
        return metadata
    if already_seen:
        return metadata  # a late push: de-duplicated by step_id, never run
    reason = (
        "no push guard"
        if guard is None
        else guard.admit_push(metadata, request, prefix_length=prefix_length, args_structure=args_structure)
    )
    if reason is not None:
        logger.info(f"rpc_push.step_refused(session_id={metadata.session_id!r:.40}): {reason}")
        return None
    return replace(metadata, extra={})


def mark_pushed_reply(response: runtime_pb2.ExpertResponse, start: int | None) -> runtime_pb2.ExpertResponse:
    """`response` to a step that came by push, flagged (`corolla.pushed`: the client counts them) with the position
    the step started at (`corolla.pushed_from`: the client checks it is its own copy's)."""
    merged = {**decode_metadata(response.metadata), PUSHED_REPLY_KEY: True, PUSHED_FROM_KEY: start}
    return runtime_pb2.ExpertResponse(tensors=response.tensors, metadata=encode_metadata(merged))
