"""Training work merged across clients (`server.core.training_batch`), fp32 on CPU: concurrent forwards and backwards
of several clients through one runtime run as fewer block calls than works, and each client gets what it gets alone
(different row counts, deep prompts of different lengths or none, a different sequence length grouped apart);
inference queued meanwhile runs before the training works that wait; a failing block call fails only its own request;
a backward after its own forward reuses the forward's block inputs (backward works only, the same gradients), and
recomputes them for another client or other inputs; a training block call is launched while a decode batch launched
before it is still on the device, before the runtime waits for that batch, and never while the session is on its way
back (it waits for the session's next step, or the runtime's hold) unless its launch is expected to be over before
the session comes back; a request that arrives later waits for the one
ahead; merged training calls leave the inference steps' gather rule alone."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from tests.helpers import reference_backend as oracle

from corolla.server.backend import SpanBackend
from corolla.server.core.refusals import RuntimeStopped
from corolla.server.core.runtime import KIND_INFERENCE, PRIORITY_INFERENCE, Runtime, Task
from corolla.server.core.training_batch import (
    KIND_TRAINING_BACKWARD,
    KIND_TRAINING_FORWARD,
    TrainingBatcher,
    training_stats,
)
from helpers.training import tiny_llama_span

H, N_BLOCKS = 64, 3
SPAN = tuple(range(N_BLOCKS))


@pytest.fixture(scope="module")
def backend() -> SpanBackend:
    return tiny_llama_span(N_BLOCKS, "cpu")


def _client(rows: int, length: int, prompt: tuple[int, int] | None) -> tuple[torch.Tensor, ...]:
    hidden, grad = torch.randn(rows, length, H), torch.randn(rows, length, H)
    prompts = None if prompt is None else torch.randn(N_BLOCKS, prompt[0], prompt[1], H) * 0.1
    return hidden, grad, prompts


async def _queued(runtime: Runtime, count: int) -> None:
    """Lets the requests being started queue their first works (`count` of them) on a runtime not started yet."""
    for _ in range(100):
        if runtime.num_pending == count:
            break
        await asyncio.sleep(0)
    assert runtime.num_pending == count


async def test_concurrent_clients_merge_and_each_gets_its_own_result(backend: SpanBackend) -> None:
    torch.manual_seed(3)
    # (rows, length, deep prompt (rows, length) or None): the 7-token client can merge with nobody
    clients = [_client(1, 12, None), _client(2, 12, (1, 4)), _client(3, 12, (3, 6)), _client(1, 7, (1, 2))]
    runtime = Runtime(max_batch_size_tokens=1024)
    batcher = TrainingBatcher(backend, runtime)
    forwards = [batcher.forward(SPAN, h, p, "") for h, _, p in clients]
    backwards = [batcher.backward(SPAN, h, g, p, "") for h, g, p in clients]
    requests = asyncio.gather(*forwards, *backwards)
    await _queued(runtime, 2 * len(clients))  # by arrival, a request queued after the first call ran would trail it
    with runtime:
        got = await requests
        stats = training_stats(runtime.stats())
    works = len(clients) * N_BLOCKS + len(clients) * (2 * N_BLOCKS - 1)  # a backward recomputes all but the last
    assert stats.tasks == works
    assert stats.batches <= works // 2  # merged: the 12-token works of a block run together
    for (hidden, grad, prompts), out, (grad_in, grad_prompts) in zip(
        clients, got[: len(clients)], got[len(clients) :], strict=True
    ):
        torch.testing.assert_close(out, backend.forward(SPAN, hidden, prompts), atol=1e-5, rtol=1e-5)
        want_in, want_prompts = oracle.backward(backend, SPAN, hidden, grad, prompts)
        torch.testing.assert_close(grad_in, want_in, atol=1e-5, rtol=1e-5)
        if prompts is None:
            assert grad_prompts is None
        else:
            assert grad_prompts is not None and grad_prompts.shape == prompts.shape
            torch.testing.assert_close(grad_prompts, want_prompts, atol=1e-5, rtol=1e-5)


async def test_inference_queued_meanwhile_runs_before_waiting_training(backend: SpanBackend) -> None:
    order: list[str] = []
    release = threading.Event()
    with Runtime(max_batch_size_tokens=1024) as runtime:
        batcher = TrainingBatcher(backend, runtime)
        runtime.add_batch_observer(lambda kind, steps, seconds: order.append(kind))
        blocker = runtime.submit(release.wait, priority=PRIORITY_INFERENCE, size_tokens=1)  # the device is busy
        await asyncio.sleep(0.05)
        training = [asyncio.ensure_future(batcher.forward(SPAN, torch.randn(2, 8, H), None, "")) for _ in range(3)]
        await asyncio.sleep(0.05)  # the training works are queued behind the blocker
        step = runtime.submit(lambda: None, priority=PRIORITY_INFERENCE, size_tokens=1, kind=KIND_INFERENCE)
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.gather(blocker, step, *training)
    assert (
        order[1] == KIND_INFERENCE and order[2:] == [KIND_TRAINING_FORWARD] * N_BLOCKS
    )  # each block: 3 clients at once


async def test_a_failing_block_fails_its_request_only_and_stops_its_chain(backend: SpanBackend, monkeypatch) -> None:
    """A request's works run as a chain in the device thread: the error of one block call reaches that request's caller,
    its later blocks never run, and another request's chain goes on (run alone after the merged call failed)."""
    calls: list[tuple[int, int]] = []
    block_forward = backend.block_forward

    def failing_block_forward(index: int, hidden: torch.Tensor, prompt: torch.Tensor | None) -> torch.Tensor:
        calls.append((index, int(hidden.shape[0])))
        if index == 1 and hidden.shape[0] != 2:  # the 3-row request (alone or merged) fails at block 1
            raise RuntimeError("block 1 failed")
        return block_forward(index, hidden, prompt)

    monkeypatch.setattr(backend, "block_forward", failing_block_forward)
    with Runtime(max_batch_size_tokens=1024) as runtime:
        batcher = TrainingBatcher(backend, runtime)
        good, bad = torch.randn(2, 8, H), torch.randn(3, 8, H)
        got = await asyncio.gather(
            batcher.forward(SPAN, good, None, ""), batcher.forward(SPAN, bad, None, ""), return_exceptions=True
        )
    assert isinstance(got[1], RuntimeError) and "block 1 failed" in str(got[1])
    monkeypatch.undo()
    torch.testing.assert_close(got[0], backend.forward(SPAN, good), atol=1e-5, rtol=1e-5)
    assert (2, 3) not in calls and (2, 5) not in calls  # the failed request's chain stopped at block 1


async def test_a_backward_after_its_forward_reuses_the_kept_block_inputs(backend: SpanBackend) -> None:
    """The forward's block inputs are kept for the same client's backward of the same inputs and prompts: it runs
    only its backward works and gets exactly what the recomputing backward gets; another client's backward of the
    same inputs, or the same client's of other inputs, recomputes."""
    torch.manual_seed(5)
    hidden, grad, prompts = _client(2, 10, (1, 3))
    with Runtime(max_batch_size_tokens=1024) as runtime:
        batcher = TrainingBatcher(backend, runtime)

        async def works_of(call) -> tuple[object, int]:
            before = training_stats(runtime.stats()).tasks
            result = await call
            return result, training_stats(runtime.stats()).tasks - before

        out, forward_works = await works_of(batcher.forward(SPAN, hidden, prompts, "", "peer-a"))
        assert forward_works == N_BLOCKS and len(batcher.kept) == 1
        # another client sends the very same tensors: it recomputes (a hit would tell it what peer-a sent)
        other, other_works = await works_of(batcher.backward(SPAN, hidden, grad, prompts, "", "peer-b"))
        assert other_works == 2 * N_BLOCKS - 1 and len(batcher.kept) == 1
        changed = hidden.clone()
        changed[0, 0, 0] += 1.0
        _, changed_works = await works_of(batcher.backward(SPAN, changed, grad, prompts, "", "peer-a"))
        assert changed_works == 2 * N_BLOCKS - 1 and len(batcher.kept) == 1
        reused, reused_works = await works_of(batcher.backward(SPAN, hidden, grad, prompts, "", "peer-a"))
        assert reused_works == N_BLOCKS and len(batcher.kept) == 0  # one backward per forward
        again, again_works = await works_of(batcher.backward(SPAN, hidden, grad, prompts, "", "peer-a"))
        assert again_works == 2 * N_BLOCKS - 1
    assert (batcher.kept.hits, batcher.kept.misses) == (1, 3)
    want_in, want_prompts = oracle.backward(backend, SPAN, hidden, grad, prompts)
    torch.testing.assert_close(out, backend.forward(SPAN, hidden, prompts), atol=1e-5, rtol=1e-5)
    for grads in (reused, other, again):
        torch.testing.assert_close(grads[0], want_in, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grads[1], want_prompts, atol=1e-5, rtol=1e-5)
    assert torch.equal(reused[0], other[0]) and torch.equal(reused[1], other[1])  # lone requests: bit-equal


async def test_forward_and_backward_works_merge_under_their_own_limits(backend: SpanBackend) -> None:
    torch.manual_seed(7)
    clients = [_client(1, 12, None), _client(1, 12, None)]
    runtime = Runtime(max_batch_size_tokens=1024)
    batcher = TrainingBatcher(backend, runtime)
    batcher.set_merge_tokens(24, 12)  # two 12-token forward works per call, backward works alone
    forwards = asyncio.gather(*(batcher.forward(SPAN, h, None, "", f"peer-{i}") for i, (h, _, _) in enumerate(clients)))
    await _queued(runtime, len(clients))  # both first works queued before the device thread starts: they merge
    with runtime:
        await forwards
        kept = batcher.kept.kept_inputs()
        # merged calls' outputs are views of one tensor: a kept block input holds only its own rows
        assert len(kept) == 2 * (N_BLOCKS - 1)
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in kept)
        got = await asyncio.gather(
            *(batcher.backward(SPAN, h, g, None, "", f"peer-{i}") for i, (h, g, _) in enumerate(clients))
        )
        stats = runtime.stats()
    assert len(batcher.kept) == 0
    # merged training calls carry no sessions' steps: they leave the inference steps' gather rule as it was (no
    # forward time learned from them, no wait for pushes after them)
    assert runtime.gather.forward_s is None and runtime.gather.wait(0.0, 0) is None
    forward, backward = stats[KIND_TRAINING_FORWARD], stats[KIND_TRAINING_BACKWARD]
    # the backwards reused the forwards' inputs; each block's two forward works ran as one call (the next works are
    # queued at a call's launch, together)
    assert (forward.tasks, forward.batches) == (2 * N_BLOCKS, N_BLOCKS)
    assert (backward.tasks, backward.batches) == (2 * N_BLOCKS, 2 * N_BLOCKS)
    for (hidden, grad, _), (grad_in, _) in zip(clients, got, strict=True):
        torch.testing.assert_close(grad_in, oracle.backward(backend, SPAN, hidden, grad)[0], atol=1e-5, rtol=1e-5)


class _LaunchedDecode:
    """A decode batch on the fake device: `wait()` logs when the runtime waits for it."""

    def __init__(self, log: list[str], size: int) -> None:
        self.log, self.size = log, size

    def wait(self) -> list[object]:
        self.log.append("decode.wait")
        return [None] * self.size

    @property
    def device_s(self) -> float | None:
        return None


def _log_device(runtime: Runtime, backend: SpanBackend, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The order of work on the fake device: each training block call ("block<i>"), and each batch of kind "decode"
    (registered on `runtime` here) when launched and when the runtime waits for it."""
    log: list[str] = []
    block_forward = backend.block_forward

    def logged_block_forward(index: int, hidden: torch.Tensor, prompt: torch.Tensor | None) -> torch.Tensor:
        log.append(f"block{index}")
        return block_forward(index, hidden, prompt)

    def launch_decode(tasks: list[Task]) -> _LaunchedDecode:
        log.append("decode.launch")
        return _LaunchedDecode(log, len(tasks))

    monkeypatch.setattr(backend, "block_forward", logged_block_forward)
    runtime.register_batch_executor("decode", lambda tasks: [None] * len(tasks), launcher=launch_decode)
    return log


def _decode_step(runtime: Runtime) -> asyncio.Future:
    """A session's step of the fake device's "decode" kind (`_log_device`)."""
    return runtime.submit(lambda: None, priority=PRIORITY_INFERENCE, size_tokens=1, kind="decode", merge_key="span")


async def _forward_and_decode_step_after_a_busy_device(
    runtime: Runtime, batcher: TrainingBatcher
) -> tuple[asyncio.Future, asyncio.Future]:
    """A 3-block training forward and then a decode step queued while the device is busy (the decode step ahead: more
    urgent), then the device freed: their futures."""
    release = threading.Event()
    blocker = runtime.submit(release.wait, priority=PRIORITY_INFERENCE, size_tokens=1)  # the device is busy
    await asyncio.sleep(0.05)
    training = asyncio.ensure_future(batcher.forward(SPAN, torch.randn(1, 8, H), None, ""))
    decode = _decode_step(runtime)
    await asyncio.sleep(0.05)  # both queued behind the blocker
    release.set()
    await blocker
    return training, decode


async def test_a_training_call_launches_before_the_runtime_waits_for_a_launched_decode(
    backend: SpanBackend, monkeypatch
) -> None:
    """A decode batch the runtime launched is on the device while a training work waits: the training block call is
    launched before the runtime waits for the decode (its launch, CPU work, overlaps the decode's device time) rather
    than after the decode's results came back (the device idle during that launch)."""
    with Runtime(max_batch_size_tokens=1024) as runtime:
        log = _log_device(runtime, backend, monkeypatch)
        training, decode = await _forward_and_decode_step_after_a_busy_device(
            runtime, TrainingBatcher(backend, runtime)
        )
        await asyncio.gather(decode, training)
    assert log[:3] == ["decode.launch", "block0", "decode.wait"]
    assert log[3:] == ["block1", "block2"]


async def _forward_behind_a_decode_step(
    runtime: Runtime, backend: SpanBackend, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[str], asyncio.Future]:
    """On a started `runtime` holding training up to 30 s after a decode batch: a 3-block training forward and a decode
    step queued behind a busy device, then the device freed; once the decode step is complete and its session has
    been on its way back 0.2 s (nothing learned of its return yet: block1 waits for its step), the device's log and the
    forward's future."""
    runtime.pace_hold_s = 30.0
    log = _log_device(runtime, backend, monkeypatch)
    training, first = await _forward_and_decode_step_after_a_busy_device(runtime, TrainingBatcher(backend, runtime))
    await first
    await asyncio.sleep(0.2)  # the session's way back, slow
    assert log == ["decode.launch", "block0", "decode.wait"]
    return log, training


async def test_training_waits_for_the_sessions_next_step_then_launches_behind_it(
    backend: SpanBackend, monkeypatch
) -> None:
    """Once a decode batch is complete, a queued training work is not launched while the session is on its way back
    (the device thread would be busy launching it when the session's next step comes): it waits for that step, which
    launches first, and launches while the step is on the device; where no step comes, it waits `pace_hold_s`."""
    with Runtime(max_batch_size_tokens=1024) as runtime:
        log, training = await _forward_behind_a_decode_step(runtime, backend, monkeypatch)
        runtime.pace_hold_s = 0.05  # from the next decode batch on: its session does not come back (nor is learned)
        await _decode_step(runtime)
        await training
        # block1 launched while the second decode step was on the device; block2 once the hold after it ran out
        assert log[3:] == ["decode.launch", "block1", "decode.wait", "block2"]
    assert (runtime.num_paced, runtime.num_paced_out) == (2, 1)
    assert runtime.paced_s >= 0.2  # the first hold lasted the session's way back


async def test_a_training_launch_that_fits_the_sessions_way_back_is_not_held(backend: SpanBackend, monkeypatch) -> None:
    """Once the runtime learned how long the session takes to come back (0.2 s here) and how long a training block
    call's launch holds the thread (milliseconds on this CPU), a training work queued after a decode batch completes
    is launched at once, with no step of the session in sight: its launch is over before the step comes."""
    with Runtime(max_batch_size_tokens=1024) as runtime:
        log, training = await _forward_behind_a_decode_step(runtime, backend, monkeypatch)
        await _decode_step(runtime)  # block1 behind it; then block2 at once, within the session's way back learned here
        await asyncio.wait_for(training, 5.0)
        assert log[3:] == ["decode.launch", "block1", "decode.wait", "block2"]
    assert runtime.num_fitted == 1


async def test_training_is_not_held_after_a_session_step_run_to_its_end(backend: SpanBackend) -> None:
    """Where a session's steps run to their end in the runtime (no launcher: a CPU server), a training work queued
    after one is not held for the session's next step: there is no launch for it to go behind, and a session that
    kept coming back within the hold would starve it."""
    with Runtime(max_batch_size_tokens=1024) as runtime:
        runtime.pace_hold_s = 30.0
        runtime.register_batch_executor("decode", lambda tasks: [None] * len(tasks))  # no launcher
        batcher = TrainingBatcher(backend, runtime)
        await _decode_step(runtime)
        await asyncio.wait_for(batcher.forward(SPAN, torch.randn(1, 8, H), None, ""), 5.0)
    assert runtime.num_paced == 0


async def test_a_request_that_arrives_later_waits_for_the_one_ahead(backend: SpanBackend, monkeypatch) -> None:
    """A forward that arrives while another's first block runs waits until the request ahead ran all its blocks
    (which then goes back to its client while the late one runs), though its first block comes before the one ahead's
    next blocks (works by their requests' arrival, not by progress through the span)."""
    calls: list[tuple[int, int]] = []
    first_running, go_on = threading.Event(), threading.Event()
    block_forward = backend.block_forward

    def gated_block_forward(index: int, hidden: torch.Tensor, prompt: torch.Tensor | None) -> torch.Tensor:
        calls.append((index, int(hidden.shape[0])))
        if len(calls) == 1:
            first_running.set()
            assert go_on.wait(5.0)
        return block_forward(index, hidden, prompt)

    monkeypatch.setattr(backend, "block_forward", gated_block_forward)
    with Runtime(max_batch_size_tokens=1024) as runtime:
        batcher = TrainingBatcher(backend, runtime)
        ahead = asyncio.ensure_future(batcher.forward(SPAN, torch.randn(1, 8, H), None, ""))
        assert await asyncio.to_thread(first_running.wait, 5.0)
        behind = asyncio.ensure_future(batcher.forward(SPAN, torch.randn(2, 8, H), None, ""))
        await asyncio.sleep(0.05)  # queued while the first block call of `ahead` runs
        go_on.set()
        await asyncio.gather(ahead, behind)
    assert calls == [(0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2)]


async def test_a_request_queued_when_the_runtime_stops_gets_runtime_stopped(backend: SpanBackend) -> None:
    release = threading.Event()
    runtime = Runtime(max_batch_size_tokens=1024)
    with runtime:
        batcher = TrainingBatcher(backend, runtime)
        blocker = runtime.submit(release.wait, priority=PRIORITY_INFERENCE, size_tokens=1)  # the device is busy
        await asyncio.sleep(0.05)
        training = asyncio.ensure_future(batcher.forward(SPAN, torch.randn(1, 8, H), None, ""))
        await asyncio.sleep(0.05)  # its first work queued behind the blocker
        stopping = asyncio.ensure_future(asyncio.to_thread(runtime.stop))
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.gather(blocker, stopping)
        with pytest.raises(RuntimeStopped):
            await asyncio.wait_for(training, 5.0)
