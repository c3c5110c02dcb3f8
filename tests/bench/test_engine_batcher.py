"""Continuous batching on CPU: concurrent sessions get exactly what they would get alone while their steps share
batched forwards; sessions join and leave between iterations; oldest steps go first so nobody starves; a bad
step fails alone (the bench's `ContinuousBatcher`); and the server's Runtime drives the same merging
(`execute_steps`) as a batch executor."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from benchmarks.common.batcher import ContinuousBatcher
from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.batcher import execute_steps
from corolla.engine.span_engine import StepRequest
from corolla.models.registry import get_family
from corolla.server.core.runtime import KIND_INFERENCE, PRIORITY_INFERENCE, Runtime
from corolla.utils.tensor_bytes import TensorBytes
from helpers.tiny_models import tiny_config

H = 64
WAIT_S = 60


def make_engine(num_layers: int = 2, **overrides) -> SpanEngine:
    torch.manual_seed(0)
    config = tiny_config("llama", num_layers)
    blocks = [get_family(config).build_block(config, i).eval() for i in range(num_layers)]
    for block in blocks:
        for p in block.parameters():
            torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.15)
    settings = dict(kv_pool_bytes=4 << 20, page_size_tokens=16, max_seq_len_tokens=128, max_batch_rows=8)
    settings.update(overrides)
    return SpanEngine.from_blocks(blocks, EngineConfig(**settings))


def solo_outputs(engine: SpanEngine, prompt: torch.Tensor, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    with engine.open_session(prompt.shape[0], 64) as s:
        outs = [engine.step(s, prompt, 0)]
        outs += [engine.step(s, t, prompt.shape[1] + i) for i, t in enumerate(tokens)]
    return outs


def test_concurrent_sessions_match_solo_and_share_forwards() -> None:
    engine = make_engine()
    n_sessions, n_tokens = 6, 5
    prompts = [torch.randn(1, 3 + 4 * i, H) for i in range(n_sessions)]
    tokens = [[torch.randn(1, 1, H) for _ in range(n_tokens)] for _ in range(n_sessions)]
    expected = [solo_outputs(engine, p, t) for p, t in zip(prompts, tokens, strict=True)]
    results: dict[int, list[torch.Tensor]] = {}
    barrier = threading.Barrier(n_sessions)

    def client(i: int) -> None:
        with engine.open_session(1, 64) as s:
            outs = [batcher.submit(s, prompts[i], 0).result(WAIT_S)]
            barrier.wait(WAIT_S)  # everyone decodes at the same time
            for k, tok in enumerate(tokens[i]):
                outs.append(batcher.submit(s, tok, prompts[i].shape[1] + k).result(WAIT_S))
            results[i] = outs

    with ContinuousBatcher(engine) as batcher:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(n_sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
    assert sorted(results) == list(range(n_sessions))
    for i in range(n_sessions):
        for got, ref in zip(results[i], expected[i], strict=True):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert max(batcher.batch_rows_history) > 1  # steps of different sessions did share a forward
    assert engine.pool.pages_free == engine.pool.num_pages - 1


def test_sessions_join_and_leave_between_iterations() -> None:
    engine = make_engine()
    batcher = ContinuousBatcher(engine)  # driven by hand: run_once is one iteration
    a, b = engine.open_session(1, 64), engine.open_session(2, 64)
    xa, xb = torch.randn(1, 4, H), torch.randn(2, 6, H)
    fa, fb = batcher.submit(a, xa, 0), batcher.submit(b, xb, 0)
    while batcher.num_pending:
        batcher.run_once()
    ta, tb = torch.randn(1, 1, H), torch.randn(2, 1, H)
    fa, fb = batcher.submit(a, ta, 4), batcher.submit(b, tb, 6)
    assert batcher.run_once() == 2 and batcher.batch_rows_history[-1] == 3  # both decode rows in one forward
    assert fb.result(WAIT_S).shape == (2, 1, H)
    b.close()  # b leaves; c joins
    c = engine.open_session(1, 64)
    xc = torch.randn(1, 2, H)
    fc = batcher.submit(c, xc, 0)
    ta2 = torch.randn(1, 1, H)
    fa2 = batcher.submit(a, ta2, 5)
    fb2 = batcher.submit(b, torch.randn(2, 1, H), 7)  # a closed session's step fails alone
    batcher.run_once()
    with pytest.raises(ValueError, match="closed"):
        fb2.result(WAIT_S)
    expected_a = solo_outputs(engine, xa, [ta, ta2])
    expected_c = solo_outputs(engine, xc, [])
    torch.testing.assert_close(fa.result(WAIT_S), expected_a[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(fa2.result(WAIT_S), expected_a[2], atol=1e-5, rtol=0)
    torch.testing.assert_close(fc.result(WAIT_S), expected_c[0], atol=1e-5, rtol=0)
    a.close()
    c.close()


def test_oldest_steps_go_first_and_each_session_keeps_its_order() -> None:
    engine = make_engine(num_layers=1, max_batch_rows=2)
    batcher = ContinuousBatcher(engine)
    sessions = [engine.open_session(1, 64) for _ in range(5)]
    futures = [batcher.submit(s, torch.randn(1, 1, H), 0) for s in sessions]
    second = batcher.submit(sessions[0], torch.randn(1, 1, H), 1)  # queued behind session 0's first step
    done_after: list[set[int]] = []
    while batcher.num_pending:
        batcher.run_once()
        done_after.append({i for i, f in enumerate(futures) if f.done()})
    assert done_after[0] == {0, 1}  # two rows per iteration, oldest first
    assert done_after[1] == {0, 1, 2, 3}
    assert done_after[2] == {0, 1, 2, 3, 4}
    assert second.done() and len(done_after) == 3  # ran with session 4, after session 0's first step
    assert sessions[0].length_tokens == 2
    for s in sessions:
        s.close()


def test_execute_steps_isolates_invalid_requests_and_orders_repeated_sessions() -> None:
    engine = make_engine(num_layers=1)
    s = engine.open_session(1, 64)
    x0, x1 = torch.randn(1, 3, H), torch.randn(1, 1, H)
    bad = StepRequest(s, torch.randn(1, 1, H), 40)  # beyond what was written
    results = execute_steps(engine, [StepRequest(s, x0, 0), bad, StepRequest(s, x1, 3)])
    assert isinstance(results[1], ValueError)
    expected = solo_outputs(engine, x0, [x1])
    torch.testing.assert_close(results[0], expected[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(results[2], expected[1], atol=1e-5, rtol=0)
    s.close()


async def test_runtime_merges_inference_steps_through_the_engine() -> None:
    engine = make_engine()
    sessions = [engine.open_session(1, 64) for _ in range(4)]
    prompts = [torch.randn(1, 5 + i, H) for i in range(4)]
    toks = [torch.randn(1, 1, H) for _ in range(4)]
    expected = [solo_outputs(engine, p, [t]) for p, t in zip(prompts, toks, strict=True)]
    batches: list[int] = []

    def counting_executor(tasks):  # what the fast executor registers: each task's StepRequest through execute_steps
        batches.append(len(tasks))
        return execute_steps(engine, [task.payload for task in tasks])

    def submit(runtime, session, x, position):
        req = StepRequest(session, x, position)
        return runtime.submit(
            lambda: engine.step(session, x, position),
            priority=PRIORITY_INFERENCE,
            size_tokens=x.shape[0] * x.shape[1],
            kind=KIND_INFERENCE,
            merge_key="span",
            payload=req,
        )

    with Runtime(max_batch_size_tokens=4096) as runtime:
        runtime.register_batch_executor(KIND_INFERENCE, counting_executor)
        gate = threading.Event()
        blocker = runtime.submit(lambda: gate.wait(10), priority=0, size_tokens=1)
        firsts = [submit(runtime, s, p, 0) for s, p in zip(sessions, prompts, strict=True)]
        gate.set()
        await asyncio.wait_for(blocker, WAIT_S)
        outs = await asyncio.wait_for(asyncio.gather(*firsts), WAIT_S)
        gate.clear()
        blocker = runtime.submit(lambda: gate.wait(10), priority=0, size_tokens=1)
        seconds = [submit(runtime, s, t, p.shape[1]) for s, t, p in zip(sessions, toks, prompts, strict=True)]
        gate.set()
        await asyncio.wait_for(blocker, WAIT_S)
        outs2 = await asyncio.wait_for(asyncio.gather(*seconds), WAIT_S)
    assert 4 in batches  # the queued steps ran as merged batches
    for i in range(4):
        torch.testing.assert_close(outs[i], expected[i][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(outs2[i], expected[i][1], atol=1e-5, rtol=0)
    for s in sessions:
        s.close()


def test_sessions_over_different_layer_ranges_are_batched_separately() -> None:
    engine = make_engine(num_layers=3)
    whole, part = engine.open_session(1, 64), engine.open_session(1, 64, layers=(1, 3))
    xw, xp = torch.randn(1, 5, H), torch.randn(1, 6, H)
    tw, tp = torch.randn(1, 1, H), torch.randn(1, 1, H)
    execute_steps(engine, [StepRequest(whole, xw, 0), StepRequest(part, xp, 0)])
    outs = execute_steps(engine, [StepRequest(whole, tw, 5), StepRequest(part, tp, 6)])
    with engine.open_session(1, 64) as s:  # whole span alone
        engine.step(s, xw, 0)
        torch.testing.assert_close(outs[0], engine.step(s, tw, 5), atol=1e-5, rtol=0)
    with engine.open_session(1, 64, layers=(1, 3)) as s:  # layers 1..2 alone
        engine.step(s, xp, 0)
        torch.testing.assert_close(outs[1], engine.step(s, tp, 6), atol=1e-5, rtol=0)
    with engine.open_session(1, 64) as s:  # and not what the whole span computes
        engine.step(s, xp, 0)
        assert not torch.allclose(outs[1], engine.step(s, tp, 6), atol=1e-3)
    whole.close()
    part.close()


async def test_async_steps_from_one_loop_share_forwards() -> None:
    engine = make_engine()
    prompts = [torch.randn(1, 3 + 2 * i, H) for i in range(5)]
    tokens = [[torch.randn(1, 1, H) for _ in range(4)] for _ in range(5)]
    expected = [solo_outputs(engine, p, t) for p, t in zip(prompts, tokens, strict=True)]
    sessions = [engine.open_session(1, 64) for _ in prompts]

    async def client(k: int) -> list[torch.Tensor]:
        outs = [await batcher.step(sessions[k], prompts[k], 0)]
        for i, tok in enumerate(tokens[k]):
            outs.append(await batcher.step(sessions[k], tok, prompts[k].shape[1] + i))
        return outs

    with ContinuousBatcher(engine) as batcher:
        got = await asyncio.wait_for(asyncio.gather(*(client(k) for k in range(5))), WAIT_S)
        with pytest.raises(ValueError, match="closed"):
            sessions[0].close()
            await asyncio.wait_for(batcher.step(sessions[0], tokens[0][0], 7), WAIT_S)
    for outs, ref in zip(got, expected, strict=True):
        for a, b in zip(outs, ref, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert max(batcher.batch_rows_history) > 1
    for s in sessions:
        s.close()


async def test_stop_fails_the_steps_still_queued_of_either_kind() -> None:
    engine = make_engine()
    batcher = ContinuousBatcher(engine)  # never started: both steps stay queued until `stop`
    a, b = engine.open_session(1, 64), engine.open_session(1, 64)
    queued = batcher.submit(a, torch.randn(1, 2, H), 0)
    waiting = asyncio.ensure_future(batcher.step(b, torch.randn(1, 2, H), 0))
    await asyncio.sleep(0)  # the async step is queued and awaits its future
    assert batcher.num_pending == 2
    batcher.stop()
    with pytest.raises(RuntimeError, match="stopped before this step ran"):
        queued.result(WAIT_S)
    with pytest.raises(RuntimeError, match="stopped before this step ran"):
        await asyncio.wait_for(waiting, WAIT_S)  # resolved in its own loop
    with pytest.raises(RuntimeError, match="accepts no new steps"):
        batcher.submit(a, torch.randn(1, 2, H), 0)
    a.close()
    b.close()


def test_launch_steps_declines_what_the_cpu_engine_runs() -> None:
    from corolla.engine.batcher import launch_steps

    engine = make_engine()  # CPU: no CUDA graphs, so every step runs through execute_steps in one phase
    with engine.open_session(1, 16) as s:
        request = StepRequest(s, torch.randn(1, 1, H), 0)
        assert not engine.can_launch([request])
        assert launch_steps(engine, [request]) is None
        assert s.length_tokens == 0  # declining ran nothing
        with pytest.raises(ValueError, match="launch_decode"):
            engine.launch_decode([request])


def test_inputs_are_checked_once_where_the_step_enters_and_the_state_where_it_runs(monkeypatch) -> None:
    engine = make_engine(num_layers=1)
    calls: list[StepRequest] = []
    check = engine.check_inputs

    def counted(req: StepRequest) -> None:
        calls.append(req)
        check(req)

    monkeypatch.setattr(engine, "check_inputs", counted)
    with engine.open_session(1, 8) as s, engine.open_session(1, 8) as closed:
        good, late = StepRequest(s, torch.randn(1, 1, H), 0), StepRequest(closed, torch.randn(1, 1, H), 0)
        for req in (good, late):
            engine.check_inputs(req)  # where the step enters (EngineExecutor.prepare_step)
        with pytest.raises(ValueError, match=r"hidden states must be \[1, tokens, 64\]"):
            engine.check_inputs(StepRequest(s, torch.randn(1, 1, H + 1), 0))
        closed.close()  # the session's state changes after the inputs were checked
        results = execute_steps(engine, [good, late, StepRequest(s, torch.randn(1, 1, H), 5)])
        assert len(calls) == 4  # the two checked steps are not checked again; the unchecked one is, once
        assert isinstance(results[0], torch.Tensor) and results[0].shape == (1, 1, H)
        assert isinstance(results[1], ValueError) and "closed" in str(results[1])
        assert isinstance(results[2], ValueError) and "start position 5" in str(results[2])


def test_launch_steps_checks_launchability_once_per_set() -> None:
    from corolla.engine.batcher import launch_steps

    class Req:
        def __init__(self, value: int, rows: int) -> None:
            self.value, self.rows = value, rows
            self.num_tokens = 1  # a decode step: one position per row, as StepRequest counts it
            self.shape = (rows, 1, 1)  # [B, T, H]
            self.output_bytes: memoryview | None = None

    class Engine:
        """Records how `launch_steps` asks: one can_launch for the set, the valid subset launched as launchable."""

        def __init__(self) -> None:
            self.can_launch_calls = 0
            self.launched: list[tuple[list[int], bool]] = []

        def can_launch(self, reqs) -> bool:
            self.can_launch_calls += 1
            return True

        def validate(self, req) -> None:
            if req.value < 0:
                raise ValueError("bad step")

        def launch_decode(self, reqs, *, validated: bool = False, launchable: bool = False):
            self.launched.append(([r.value for r in reqs], launchable))
            return _Pending(sum(r.rows for r in reqs))

    class _Pending:
        dtype = torch.int32  # one element (4 bytes) per row

        def __init__(self, rows: int) -> None:
            self.rows = rows
            self.data = memoryview(bytearray(torch.arange(10, 10 + rows, dtype=torch.int32).numpy().tobytes()))

        def output_bytes(self) -> memoryview:
            return self.data  # (no `wait`: a launched step's result is its bytes, no tensor is built for it)

    engine = Engine()
    requests = [Req(1, 2), Req(-1, 1), Req(2, 1)]
    pending = launch_steps(engine, requests)  # type: ignore[arg-type]
    assert pending is not None
    results = pending.wait()
    assert isinstance(results[1], ValueError)
    # each launched request gets its rows' bytes of the collected output, in row order, as its result (shape and
    # dtype its output's) and as its `output_bytes`; a refused one none
    first, last = results[0], results[2]
    assert isinstance(first, TensorBytes) and isinstance(last, TensorBytes)
    assert first.shape == (2, 1, 1) and first.dtype == torch.int32 and last.shape == (1, 1, 1)
    assert first.tensor().flatten().tolist() == [10, 11] and last.tensor().flatten().tolist() == [12]
    assert first.data is requests[0].output_bytes and requests[1].output_bytes is None
    assert bytes(requests[2].output_bytes or b"") == bytes(last.data)
    assert engine.can_launch_calls == 1 and engine.launched == [([1, 2], True)]


def test_a_merged_batch_of_distinct_sessions_runs_in_one_decode_call(monkeypatch) -> None:
    # the device channels' usual batch (one decode step per session, one layer range) takes one pass and one
    # decode_many call; refusals stay in place and a failing forward fails only the steps that joined it
    engine = make_engine(num_layers=1)
    sessions = [engine.open_session(1, 64) for _ in range(4)]
    prompts = [torch.randn(1, 2 + i, H) for i in range(4)]
    for s, p in zip(sessions, prompts, strict=True):
        engine.step(s, p, 0)
    toks = [torch.randn(1, 1, H) for _ in range(4)]
    expected = [solo_outputs(engine, p, [t])[1] for p, t in zip(prompts, toks, strict=True)]
    calls: list[int] = []
    decode_many = engine.decode_many

    def counted(reqs, **kwargs):
        calls.append(len(reqs))
        return decode_many(reqs, **kwargs)

    monkeypatch.setattr(engine, "decode_many", counted)
    sessions[2].close()
    requests = [StepRequest(s, t, p.shape[1]) for s, t, p in zip(sessions, toks, prompts, strict=True)]
    requests[1] = StepRequest(sessions[1], toks[1], 40)  # beyond what was written
    results = execute_steps(engine, requests)
    assert calls == [2]
    assert isinstance(results[1], ValueError) and "start position 40" in str(results[1])
    assert isinstance(results[2], ValueError) and "closed" in str(results[2])
    for i in (0, 3):
        torch.testing.assert_close(results[i], expected[i], atol=1e-5, rtol=0)

    def failing(reqs, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "decode_many", failing)
    again = [StepRequest(sessions[0], toks[0], prompts[0].shape[1] + 1), StepRequest(sessions[2], toks[2], 9)]
    results = execute_steps(engine, again)
    assert isinstance(results[0], RuntimeError) and isinstance(results[1], ValueError)
    for s in sessions:
        s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_forwards_outputs_carry_their_bytes_for_the_replies(dtype: torch.dtype) -> None:
    # the eager/CPU decode's outputs are consecutive rows of one buffer: each request gets its rows' bytes (what a
    # launched forward's collection gives), so that its reply needs no torch call; any other layout gets none
    from corolla.engine.batcher import attach_output_bytes

    engine = make_engine(num_layers=1)
    sessions = [engine.open_session(b, 64) for b in (1, 2, 1)]
    requests = [StepRequest(s, torch.randn(s.batch_size, 1, H), 0) for s in sessions]
    outs = execute_steps(engine, requests)
    for req, out in zip(requests, outs, strict=True):
        assert isinstance(out, torch.Tensor) and req.output_bytes is not None
        assert bytes(req.output_bytes) == out.numpy().tobytes()
    out = torch.randn(5, 1, H).to(dtype)
    pieces = list(out.split([1, 2, 2]))
    reqs = [StepRequest(sessions[0], torch.randn(b, 1, H), 1) for b in (1, 2, 2)]  # [B_i, 1, H] as the pieces
    attach_output_bytes(reqs, pieces)
    words = out.view(torch.int16) if dtype == torch.bfloat16 else out
    for req, piece in zip(reqs, pieces, strict=True):
        ref = piece.view(torch.int16) if dtype == torch.bfloat16 else piece
        assert req.output_bytes is not None and bytes(req.output_bytes) == ref.numpy().tobytes()
    words[0, 0, 0] = 7  # the bytes are the output's memory, not a copy
    assert bytes(reqs[0].output_bytes[: words.element_size()]) == words[0, 0, :1].numpy().tobytes()
    for layout in ([pieces[1], pieces[0], pieces[2]], [pieces[0], pieces[1].clone(), pieces[2]],
                   [pieces[0], out.view(5, H)[1:3].t(), pieces[2]]):  # fmt: skip  # moved, copied, strided
        fresh = [StepRequest(sessions[0], torch.randn(b, 1, H), 1) for b in (1, 2, 2)]
        attach_output_bytes(fresh, layout)
        assert all(req.output_bytes is None for req in fresh)
    rows_disagree = [StepRequest(sessions[0], torch.randn(1, 1, H), 1) for _ in range(3)]  # 1 row each
    attach_output_bytes(rows_disagree, pieces)
    assert all(req.output_bytes is None for req in rows_disagree)
    for s in sessions:
        s.close()
