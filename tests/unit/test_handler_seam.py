"""The RPC handler against a fake executor with `EngineExecutor`'s methods (no model, no network; its sessions through
the same-host socket's port): what reaches the executor is validated once and typed (positions, rollback, lone
session), refusals are counted under their type's reason (too long, bad request, cache full) before any device work and
told to the client, and `rpc_info` names the serving path."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from corolla.models.block_base import TensorDescriptor
from corolla.protocol.codecs import deserialize_tensor, serialize_tensor
from corolla.protocol.metadata import decode_metadata, encode_metadata
from corolla.protocol.prefix import PREFIX_HIT_KEY, PREFIX_KEY, PrefixKeys
from corolla.server.core.executor import (
    PATH_EAGER,
    BackwardInputs,
    ForwardInputs,
    HandoffUnsupported,
    PrefixCacheStats,
    SessionCache,
    SessionSpec,
    StepInputs,
)
from corolla.server.core.limits import PeerLimits, SessionTimeouts
from corolla.server.core.runtime import Runtime
from corolla.server.core.span_core import SpanCore
from corolla.server.front import step_timeline
from corolla.server.front.block_functions import ServingLimits
from corolla.server.front.handler import TransformerConnectionHandler
from corolla.server.front.prefix_keys import with_hit
from corolla.server.metrics import ServerMetrics
from corolla.utils.errors import AllocationFailed
from helpers.socket_session import socket_session

H = 8
LIMITS = ServingLimits(
    dht_prefix="p", start_block=0, end_block=2, hidden_size=H, dtype=torch.float32,
    inference_max_length_tokens=32, max_batch_size_tokens=64,
)  # fmt: skip
BYTES_PER_TOKEN = 100


class FakeExecutor:
    """Doubles the hidden states and records what it was asked; a budget of `max_size_bytes`."""

    path = PATH_EAGER

    def __init__(self, *, max_size_bytes: int = 10**6):
        self._runtime = Runtime(max_batch_size_tokens=64)
        self.max_size_bytes = max_size_bytes
        self.bytes_left = max_size_bytes
        self.bytes_waiting = 0
        self.steps: list[StepInputs] = []
        self.opened: list[SessionSpec] = []
        self.prefix_hit = 16  # what `attach_prefix` answers (at most the keyed positions)
        self.prefix_calls: list[tuple[str, str, PrefixKeys]] = []

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    def session_bytes(self, spec: SessionSpec) -> int:
        return spec.batch_size * spec.max_length_tokens * spec.num_blocks * BYTES_PER_TOKEN

    def cache_bytes_per_token(self, block_indices: tuple[int, ...]) -> int:
        return len(block_indices) * BYTES_PER_TOKEN

    @contextlib.asynccontextmanager
    async def open_session(self, spec: SessionSpec, alloc_timeout_s: float | None) -> AsyncIterator[SessionCache]:
        size = self.session_bytes(spec)
        if size > self.bytes_left:
            raise AllocationFailed(f"Could not allocate {size} bytes: {self.bytes_left} left")
        self.bytes_left -= size
        self.opened.append(spec)
        try:
            yield SessionCache(spec)
        finally:
            self.bytes_left += size

    def step(
        self, cache: SessionCache, inputs: StepInputs, then: Callable[[asyncio.Future], None] | None = None
    ) -> asyncio.Future:
        future = asyncio.ensure_future(self._step(cache, inputs))
        if then is not None:
            future.add_done_callback(then)
        return future

    async def _step(self, cache: SessionCache, inputs: StepInputs) -> torch.Tensor:
        self.steps.append(inputs)
        return inputs.hidden_states * 2

    async def forward(
        self, block_indices: tuple[int, ...], inputs: ForwardInputs, *, chunk_tokens: int
    ) -> torch.Tensor:
        return inputs.hidden_states * 2

    async def backward(self, block_indices: tuple[int, ...], inputs: BackwardInputs) -> list[torch.Tensor]:
        return [inputs.grad_outputs * 2]

    async def attach_prefix(self, cache: SessionCache, namespace: str, keys: PrefixKeys) -> int:
        self.prefix_calls.append(("attach", namespace, keys))
        return min(self.prefix_hit, keys.end_position)

    def add_prefix_keys(self, cache: SessionCache, namespace: str, keys: PrefixKeys) -> None:
        self.prefix_calls.append(("add", namespace, keys))

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(cached_bytes=123, evictions=4)

    def handoff_layout(self, spec: SessionSpec) -> list[list[TensorDescriptor]]:
        raise HandoffUnsupported("fake")

    async def read_kv(self, cache: SessionCache, position: int) -> list[torch.Tensor]:
        raise HandoffUnsupported("fake")

    async def write_kv(self, cache: SessionCache, tensors: list[torch.Tensor], position: int) -> None:
        raise HandoffUnsupported("fake")


class _Context:
    remote_id = None  # the same-host socket's peer


def _handler(executor: FakeExecutor) -> TransformerConnectionHandler:
    metrics = ServerMetrics()  # the server's one set: the core's and its front's
    return TransformerConnectionHandler(
        limits=LIMITS,
        core=SpanCore(executor, metrics=metrics),
        timeouts=SessionTimeouts(5, 30, 5),
        metrics=metrics,  # type: ignore[arg-type]
    )


def _request(hidden: torch.Tensor, **metadata) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(
        uid="p.0 p.1", tensors=[serialize_tensor(hidden)], metadata=encode_metadata(metadata)
    )


async def _session(
    handler: TransformerConnectionHandler, requests: list[runtime_pb2.ExpertRequest]
) -> tuple[list[runtime_pb2.ExpertResponse], str | None]:
    """One stream through the same-host socket's port: its replies and its error text (None: it ended cleanly)."""
    payloads, error = await socket_session(handler, requests)
    return [runtime_pb2.ExpertResponse.FromString(p) for p in payloads], error


def _outputs(responses: list[runtime_pb2.ExpertResponse]) -> list[torch.Tensor]:
    return [deserialize_tensor(r.tensors[0]) for r in responses]


def _rejected(handler: TransformerConnectionHandler, reason: str) -> float:
    text = handler.metrics.render().decode()
    match = re.search(rf'corolla_requests_rejected_total{{reason="{reason}"}} ([0-9.]+)', text)
    assert match is not None, reason
    return float(match.group(1))


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_steps_reach_the_executor_typed_and_once() -> None:
    executor = FakeExecutor()
    handler = _handler(executor)
    a, b, c = torch.randn(1, 3, H), torch.randn(1, 1, H), torch.randn(1, 2, H)
    responses, error = _run(
        _session(
            handler,
            [
                _request(a, max_length=8, session_id="s"),
                _request(b),
                _request(c, start_from_position=2),  # rollback over the last two tokens
                _request(torch.randn(1, 0, H)),  # a zero-token keep-alive: never reaches the executor
            ],
        )
    )
    outputs = _outputs(responses)
    assert error is None and [o.shape[1] for o in outputs] == [3, 1, 2, 0]
    assert torch.equal(outputs[0], a * 2) and torch.equal(outputs[2], c * 2)
    assert [s.prefix_length for s in executor.steps] == [0, 3, 2]
    assert all(s.lone_session and s.prompts is None and s.hypo_ids is None for s in executor.steps)
    assert executor.opened == [SessionSpec((0, 1), 1, 8)]
    assert executor.bytes_left == executor.max_size_bytes  # the session's cache was given back


class SlowExecutor(FakeExecutor):
    """A step that takes 2 ms on the core's side."""

    async def _step(self, cache: SessionCache, inputs: StepInputs) -> torch.Tensor:
        await asyncio.sleep(0.002)
        return await super()._step(cache, inputs)


def test_a_streams_steps_are_stamped_from_the_request_to_the_reply(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The bench's step timeline (`--timeline`): each step's four stamps taken by the port and the session's steps,
    the core's part (handed over to its output back) between the front's (since the steps run by callbacks, the
    core's stamps had been looked up in a context the callbacks do not run in: no step had them)."""
    monkeypatch.setattr(step_timeline, "DIRECTORY", tmp_path)
    hidden = [torch.randn(1, 3, H), torch.randn(1, 1, H), torch.randn(1, 1, H)]
    requests = [_request(hidden[0], max_length=8, session_id="s"), _request(hidden[1]), _request(hidden[2])]
    responses, error = _run(_session(_handler(SlowExecutor()), requests))
    assert error is None and len(responses) == 3
    (saved,) = tmp_path.glob("timeline-*.jsonl")
    (rows,) = [json.loads(line) for line in saved.read_text().splitlines()]
    assert len(rows) == 3
    for t_in, sent, back, out in rows:
        assert 0 < t_in <= sent < back <= out
        assert back - sent >= 2_000_000  # the core's 2 ms, in ns


@pytest.mark.parametrize(
    "requests, start, reason",
    [
        ([_request(torch.randn(1, 1, H), max_length=33)], "Cannot allocate KV cache for max_length=33", "too_long"),
        ([_request(torch.randn(1, 5, H), max_length=8), _request(torch.randn(1, 4, H))],
         "Maximum length exceeded: prefix 5 + current 4", "too_long"),
        ([_request(torch.randn(1, 1, H))], "the first inference request must set metadata['max_length']",
         "bad_request"),
        ([_request(torch.randn(1, 1, H + 1), max_length=8)], "hidden_states last dimension must be hidden_size=8",
         "bad_request"),
        ([_request(torch.full((1, 1, H), float("nan")), max_length=8)], "hidden_states contains NaN", "bad_request"),
        ([_request(torch.randn(1, 1, H), max_length=8), _request(torch.randn(1, 1, H), start_from_position=5)],
         "start_from_position=5 must be in [0, 1]", "bad_request"),
        ([_request(torch.randn(2, 1, H), max_length=32)], "Could not allocate 12800 bytes", "cache_full"),
    ],
)  # fmt: skip
def test_refusals_are_typed_and_counted_once(requests, start, reason) -> None:
    executor = FakeExecutor(max_size_bytes=2 * 32 * 2 * BYTES_PER_TOKEN - 1)  # a batch of 2 x 32 tokens won't fit
    handler = _handler(executor)
    handler.core.configure(PeerLimits(max_kv_fraction_per_peer=1.0))  # the cache itself refuses, not a peer cap
    _, message = _run(_session(handler, requests))
    assert message is not None and message.startswith(start)  # the client hears why
    assert _rejected(handler, reason) == 1  # counted once, under the reason its type names
    assert sum(s.hidden_states.shape[1] for s in executor.steps) <= 5  # only steps before the refused one ran


def test_rpc_info_names_the_serving_path() -> None:
    handler = _handler(FakeExecutor())
    info = _run(handler.rpc_info(runtime_pb2.ExpertUID(uid="p.0"), _Context()))  # type: ignore[arg-type]
    answer = MSGPackSerializer.loads(info.serialized_info)
    assert answer["serving_path"] == "eager"
    assert answer["cache_tokens_available"] == 10**6 // BYTES_PER_TOKEN


def test_prefix_keys_reach_the_executor_under_the_clients_identity_and_the_probe_is_answered() -> None:
    executor = FakeExecutor()
    handler = _handler(executor)
    keys = PrefixKeys(0, (b"a" * 16, b"b" * 16))
    more = PrefixKeys(2, (b"c" * 16,))
    answers, error = _run(_session(handler, [
        _request(torch.randn(1, 0, H), max_length=32, session_id="s", **{PREFIX_KEY: keys.to_wire()}),
        _request(torch.randn(1, 3, H), **{PREFIX_KEY: more.to_wire()}),  # no start_from_position: at the hit
    ]))  # fmt: skip
    assert error is None
    assert decode_metadata(answers[0].metadata)[PREFIX_HIT_KEY] == 16
    assert not answers[1].metadata or PREFIX_HIT_KEY not in decode_metadata(answers[1].metadata)
    assert [s.prefix_length for s in executor.steps] == [16]  # the zero-token probe never reaches the executor
    namespace = "local/"  # the same-host socket's identity, no adapter
    assert [(kind, ns, k) for kind, ns, k in executor.prefix_calls] == [
        ("add", namespace, keys),
        ("attach", namespace, keys),
        ("add", namespace, more),
    ]
    assert "corolla_prefix_hit_tokens_total 16.0" in handler.metrics.render().decode()
    assert "corolla_prefix_cache_bytes 123.0" in handler.metrics.render().decode()


def test_a_probe_that_rewinds_or_a_first_step_with_tokens_reuses_nothing() -> None:
    executor = FakeExecutor()
    handler = _handler(executor)
    keys = PrefixKeys(0, (b"a" * 16,)).to_wire()
    tokens = _request(torch.randn(1, 2, H), max_length=32, **{PREFIX_KEY: keys})
    rewinds = _request(torch.randn(1, 0, H), max_length=32, start_from_position=0, **{PREFIX_KEY: keys})
    for request in (tokens, rewinds):
        assert _run(_session(handler, [request]))[1] is None
    assert [call[0] for call in executor.prefix_calls] == ["add", "add"]  # recorded for publication, never attached
    assert [s.prefix_length for s in executor.steps] == [0]


def test_the_hit_joins_what_the_reply_already_says() -> None:
    plain = with_hit(runtime_pb2.ExpertResponse(), 32)
    assert decode_metadata(plain.metadata) == {PREFIX_HIT_KEY: 32}
    draining = with_hit(runtime_pb2.ExpertResponse(metadata=encode_metadata({"corolla.draining": {"s": 1.0}})), 16)
    assert decode_metadata(draining.metadata) == {"corolla.draining": {"s": 1.0}, PREFIX_HIT_KEY: 16}
