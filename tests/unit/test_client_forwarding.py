"""The client's forwarding plan (client.session.forwarding): which following spans a step is pushed to, the announced step
ids, and when a span that may hold a pushed answer must be reopened."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from types import SimpleNamespace

from hivemind.proto import runtime_pb2

from corolla.client.session.forwarding import IDS_A_DRAW, StepForwarding, push_chain, push_went_stale
from corolla.client.session.span_session import reply_flags
from corolla.protocol.forwarding import NEXT_STEP_KEY, PUSHED_FROM_KEY, PUSHED_REPLY_KEY
from corolla.protocol.metadata import encode_metadata


@dataclass
class Span:
    peer_id: str
    start: int
    end: int
    position: int = 10
    accepts_pushes: bool = True
    declared_upstream: str | None = None
    expected_push: tuple[str, int] | None = None

    @property
    def span(self):
        return SimpleNamespace(peer_id=self.peer_id, start=self.start, end=self.end)

    @property
    def session_id(self) -> str:
        return f"session-{self.peer_id}"


def chain_of_three() -> list[Span]:
    return [Span("A", 0, 2), Span("B", 2, 3, declared_upstream="A"), Span("C", 3, 4, declared_upstream="B")]


def test_a_steady_chain_is_pushed_end_to_end():
    spans = chain_of_three()
    forwarding = StepForwarding(enabled=True)
    step_id = forwarding.take_step_id()
    extra = forwarding.request_extra(spans, 0, 10, step_id, allowed=True)
    assert extra["next_servers"] == [["B", "session-B", 2, 3], ["C", "session-C", 3, 4]]
    assert spans[1].expected_push == spans[2].expected_push == (step_id, 10)
    assert extra[NEXT_STEP_KEY] != step_id and forwarding.take_step_id() == extra[NEXT_STEP_KEY]  # announced, then used


def test_no_push_into_a_replay_an_unopened_session_or_an_undeclared_upstream():
    spans = chain_of_three()
    spans[1].position = 0  # a replacement that has yet to replay: its request starts at 0, the push would at 10
    assert push_chain(spans, 0, 10) == []
    spans = chain_of_three()
    spans[2].accepts_pushes = False
    assert [s.peer_id for s in push_chain(spans, 0, 10)] == ["B"]
    spans = chain_of_three()
    spans[1].declared_upstream = "old"  # its server would refuse A's push
    assert push_chain(spans, 0, 10) == []
    spans = chain_of_three()
    spans[0].accepts_pushes = False  # A's first request: a stock server would push its metadata on every step
    assert push_chain(spans, 0, 10) == []


def test_a_rollback_keeps_forwarding():
    spans = chain_of_three()
    assert [s.peer_id for s in push_chain(spans, 0, 7)] == ["B", "C"]  # all restart from 7


def test_disabled_or_not_allowed_sends_no_next_servers():
    spans = chain_of_three()
    assert StepForwarding(enabled=False).request_extra(spans, 0, 10, "s", allowed=True) == {}
    extra = StepForwarding(enabled=True).request_extra(spans, 0, 10, "s", allowed=False)  # prompts or hypo_ids
    assert "next_servers" not in extra and NEXT_STEP_KEY in extra
    assert spans[1].expected_push is None


def test_a_span_named_for_a_push_from_another_start_is_stale():
    span = Span("B", 2, 3, expected_push=("s1", 10))
    assert not push_went_stale(span, "s1", 10)
    span.position = 0  # e.g. its history was tainted: it must now replay from 0 under the same step id
    assert push_went_stale(span, "s1", 10)
    assert not push_went_stale(span, "s2", 10)  # a later step: nothing was pushed for it


def test_pushed_reply_flag():
    flagged = runtime_pb2.ExpertResponse(metadata=encode_metadata({PUSHED_REPLY_KEY: True}))
    assert reply_flags(flagged)[1] and reply_flags(flagged)[2] is None  # (a server before 0154: no start said)
    flagged = runtime_pb2.ExpertResponse(metadata=encode_metadata({PUSHED_REPLY_KEY: True, PUSHED_FROM_KEY: 5}))
    assert reply_flags(flagged)[1:] == (True, 5)
    for start in (True, 5.0, "5"):  # only an int is a position
        flagged = runtime_pb2.ExpertResponse(metadata=encode_metadata({PUSHED_REPLY_KEY: True, PUSHED_FROM_KEY: start}))
        assert reply_flags(flagged)[2] is None
    assert not reply_flags(runtime_pb2.ExpertResponse())[1]
    assert not reply_flags(runtime_pb2.ExpertResponse(metadata=b"\xc1garbage"))[1]


def test_step_ids_are_uuid4_strings_drawn_in_batches() -> None:
    first, second = StepForwarding(enabled=True), StepForwarding(enabled=False)
    ids = [first.take_step_id() for _ in range(3 * IDS_A_DRAW)] + [second.take_step_id() for _ in range(IDS_A_DRAW)]
    for step_id in ids:
        parsed = uuid.UUID(step_id)
        assert str(parsed) == step_id and parsed.version == 4 and parsed.variant == uuid.RFC_4122
    assert len(set(ids)) == len(ids)
