"""The rules a pushed step must pass before a server runs it (server.core.push_guard.screen_step): each case is an attack
by the session's declared upstream (or a replay of an honest push) and must be refused, while the honest push the
client announced runs once."""

from __future__ import annotations

import pytest
import torch
from hivemind.compression.serialization import serialize_torch_tensor
from hivemind.proto import runtime_pb2

from corolla.protocol.forwarding import NEXT_STEP_KEY
from corolla.protocol.handoff import EXPORT_KEY
from corolla.protocol.metadata import InferenceRequestMetadata
from corolla.protocol.packing import pack_args_kwargs
from corolla.server.core.push_guard import SessionPushGuard, screen_step

HIDDEN = 8
DUMMY = torch.empty(0)
DUMMY_INT64 = torch.empty(0, dtype=torch.int64)


def _request(tokens: int, prompts: torch.Tensor = DUMMY, hypo_ids: torch.Tensor = DUMMY_INT64, **metadata):
    tensors, structure = pack_args_kwargs(torch.zeros(1, tokens, HIDDEN), prompts, hypo_ids)
    meta = InferenceRequestMetadata.from_dict({"args_structure": structure, **metadata})
    request = runtime_pb2.ExpertRequest(tensors=[serialize_torch_tensor(t) for t in tensors])
    return request, meta, structure


class Session:
    """A session driven like `sessions.iterate_steps` drives one: direct steps teach the guard, pushes are screened."""

    def __init__(self) -> None:
        self.guard = SessionPushGuard()
        self.prefix_length = 0
        self.seen: set[str] = set()
        self.structure = _request(1)[2]

    def screen(self, request, metadata, pushed: bool):
        if pushed:
            metadata = InferenceRequestMetadata.from_dict({**metadata.to_dict(), "pushed": True})
        return screen_step(
            self.guard, request, metadata, prefix_length=self.prefix_length, args_structure=self.structure,
            already_seen=metadata.step_id in self.seen,
        )  # fmt: skip

    def direct(self, tokens: int, step_id: str, next_step_id: str | None, start: int | None = None) -> None:
        extra = {} if next_step_id is None else {NEXT_STEP_KEY: next_step_id}
        start = self.prefix_length if start is None else start
        request, metadata, _ = _request(tokens, step_id=step_id, start_from_position=start, **extra)
        assert self.screen(request, metadata, pushed=False) is metadata
        self.seen.add(step_id)
        self.prefix_length = start + tokens

    def push(self, tokens: int, step_id: str, start: int | None = None, **kwargs) -> InferenceRequestMetadata | None:
        start = self.prefix_length if start is None else start
        request, metadata, _ = _request(tokens, step_id=step_id, start_from_position=start, **kwargs)
        screened = self.screen(request, metadata, pushed=True)
        if screened is not None:
            self.seen.add(step_id)
            self.prefix_length = start + tokens
        return screened


@pytest.fixture
def session() -> Session:
    made = Session()
    made.direct(5, "s0", "s1")  # the prefill, announcing the next step's id
    return made


def test_the_announced_step_runs_once(session):
    assert session.push(1, "s1") is not None
    session.direct(1, "s1", "s2")  # the client's own copy (de-duplicated by iterate_steps) announces the next
    assert session.push(1, "s2") is not None


def test_a_step_the_client_never_announced_is_refused(session):
    assert session.push(1, "forged") is None
    assert session.push(1, "s1") is not None  # the honest push still runs


def test_a_replayed_step_id_is_refused(session):
    assert session.push(1, "s1") is not None
    session.seen.clear()  # as if the server forgot (MAX_REMEMBERED_STEP_IDS): the announcement is used up anyway
    assert session.push(1, "s1") is None


def test_more_tokens_than_any_client_step_are_refused(session):
    assert session.push(6, "s1") is None  # the prefill had 5
    assert session.push(5, "s1") is not None


def test_a_rewind_deeper_than_the_clients_last_step_is_refused(session):
    session.direct(1, "s1", "s2")  # positions [5, 6)
    assert session.push(1, "s2", start=0) is None  # would recompute the whole prefix on forged inputs
    assert session.push(1, "s2", start=5) is None  # would overwrite the token of the client's last step
    assert session.push(1, "s2", start=7) is None  # a gap past the cache
    assert session.push(1, "s2", start=6) is not None


def test_speculative_rollback_within_the_last_step_is_allowed():
    session = Session()
    session.direct(5, "s0", "s1")
    session.direct(4, "s1", "s2")  # 1 token + 3 drafts at [5, 9); suppose 1 draft accepted: next step starts at 7
    assert session.push(3, "s2", start=7) is not None


def test_pushed_prompts_or_hypo_ids_are_refused(session):
    prompts = torch.zeros(1, 1, 1, HIDDEN)
    assert session.push(1, "s1", prompts=prompts) is None
    assert session.push(1, "s1", hypo_ids=torch.zeros(1, dtype=torch.int64)) is None
    assert session.push(1, "s1") is not None


def test_a_different_args_structure_is_refused(session):
    assert session.push(1, "s1", args_structure=[[b"__T1", b"__T0", b"__T2"], {}]) is None


def test_pushed_control_keys_are_stripped(session):
    screened = session.push(1, "s1", **{EXPORT_KEY: {}, NEXT_STEP_KEY: "chosen-by-upstream"})
    assert screened is not None and screened.extra == {}
    assert session.guard.expected_step_id is None  # a push never announces steps


def test_no_push_before_the_client_sent_a_step_and_none_without_a_guard():
    fresh = Session()
    assert fresh.push(1, "s1") is None
    request, metadata, structure = _request(1, step_id="s1", start_from_position=0, pushed=True)
    kwargs = dict(prefix_length=0, args_structure=structure, already_seen=False)
    assert screen_step(None, request, metadata, **kwargs) is None


def test_a_late_push_passes_to_deduplication(session):
    session.direct(1, "s1", "s2")
    request, metadata, _ = _request(1, step_id="s1", start_from_position=5, pushed=True)
    screened = session.screen(request, metadata, pushed=True)
    assert screened is not None  # iterate_steps then skips it as already seen (never run twice)
