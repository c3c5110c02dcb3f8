"""Two-phase decode on a real GPU (`SpanEngine.launch_decode`, `engine.batcher.launch_steps`): forwards launched
before the earlier ones are waited for (three in a row, more than the two pinned staging sets, one session in two of
them) give exactly what `decode_many` gives one after another; an invalid step fails alone; what `can_launch` refuses
is said before anything runs; late units join a forward launched behind a running one (`SpanEngine.join_decode`) and
give what their steps give alone, and one joined after the device ran that forward is not answered from it, writes
no key/value that a later step reads wrong, and runs again correctly. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from test_engine_gpu import BF16, DEV, make_blocks, make_engine

from corolla.engine.batcher import launch_steps
from corolla.engine.span_engine import StepRequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _opened(engine, prompts):
    sessions = [engine.open_session(p.shape[0], 256) for p in prompts]
    for s, p in zip(sessions, prompts, strict=True):
        engine.step(s, p, 0)
    return sessions


@torch.no_grad()
def test_launched_forwards_equal_forwards_run_one_after_another() -> None:
    engine = make_engine(make_blocks())
    engine.join_late_rows = False  # the same graph buckets as decode_many: bit-equal (late rows: the test below)
    torch.manual_seed(4)
    prompts = [torch.randn(b, n, 512, dtype=BF16) for b, n in ((1, 3), (2, 70), (1, 129), (1, 20))]
    tokens = [[torch.randn(p.shape[0], 1, 512, dtype=BF16) for _ in range(2)] for p in prompts]
    # forwards: (sessions 0, 1) at step 0, (2, 3) at step 0, (0, 2) at step 1 - session 0 in the first and third
    plan = [((0, 0), (1, 0)), ((2, 0), (3, 0)), ((0, 1), (2, 1))]

    def requests(sessions, forward):
        return [StepRequest(sessions[k], tokens[k][i], prompts[k].shape[1] + i) for k, i in forward]

    sessions = _opened(engine, prompts)
    expected = [[o.clone() for o in engine.decode_many(requests(sessions, f))] for f in plan]
    for s in sessions:
        s.close()
    sessions = _opened(engine, prompts)
    pending = [engine.launch_decode(requests(sessions, f)) for f in plan]  # three launches before any wait
    got = {j: pending[j].wait() for j in (2, 0, 1)}  # waited out of order
    for j in range(len(plan)):
        for out, ref in zip(got[j], expected[j], strict=True):
            assert out.device.type == "cpu" and out.shape == ref.shape
            assert torch.equal(out, ref), j
    for s in sessions:
        s.close()


@torch.no_grad()
def test_launch_steps_fails_an_invalid_step_alone_and_declines_what_one_forward_cannot_serve() -> None:
    engine = make_engine(make_blocks(layers=2))
    a, b = engine.open_session(1, 64), engine.open_session(1, 64)
    x = torch.randn(1, 1, 512, dtype=BF16)
    pending = launch_steps(engine, [StepRequest(a, x, 0), StepRequest(b, x, 5)])  # b: position past its length
    assert pending is not None
    out_a, err_b = pending.wait()
    assert isinstance(out_a, torch.Tensor) and out_a.shape == (1, 1, 512)
    assert isinstance(err_b, ValueError) and "start position" in str(err_b)
    assert launch_steps(engine, [StepRequest(a, torch.randn(1, 3, 512, dtype=BF16), 1)]) is None  # a prefill
    assert launch_steps(engine, [StepRequest(a, x, 1), StepRequest(a, x, 2)]) is None  # one session twice
    assert launch_steps(engine, [StepRequest(a, x.to(DEV), 1)]) is None  # inputs on the device
    assert a.length_tokens == 1  # nothing declined ran
    with pytest.raises(ValueError, match="launch_decode"):
        engine.launch_decode([StepRequest(a, x, 1), StepRequest(a, x, 2)])
    a.close()
    b.close()


@torch.no_grad()
def test_late_units_ride_the_forward_behind_a_running_one_and_a_missed_one_runs_again() -> None:
    engine = make_engine(make_blocks())
    torch.manual_seed(5)
    prompts = [torch.randn(1, 10 + 7 * k, 512, dtype=BF16) for k in range(6)]
    tokens = [[torch.randn(1, 1, 512, dtype=BF16) for _ in range(4)] for _ in range(6)]
    length = [p.shape[1] for p in prompts]
    ref_sessions = _opened(engine, prompts)
    expected = [
        [engine.decode_many([StepRequest(s, tokens[k][i], length[k] + i)])[0].clone() for i in range(4)]
        for k, s in enumerate(ref_sessions)
    ]
    for s in ref_sessions:
        s.close()
    sessions = _opened(engine, prompts)

    def req(k: int, i: int) -> StepRequest:
        return StepRequest(sessions[k], tokens[k][i], length[k] + i)

    def close(out: torch.Tensor, k: int, i: int) -> None:  # other graph buckets: equal up to bf16 rounding
        torch.testing.assert_close(out.float(), expected[k][i].float(), rtol=2e-2, atol=2e-2)

    first = [
        engine.launch_decode([req(0, 0), req(1, 0), req(2, 0)]),
        engine.launch_decode([req(3, 0), req(4, 0), req(5, 0)]),
    ]
    for j, pending in enumerate(first):
        for n, out in enumerate(pending.wait()):
            close(out, 3 * j + n, 0)
    # step 1: the device is busy, so `a` has not run when `b` is launched behind it: `b` leaves room for 3 rows (the
    # rows of the forward before `a` launched from b's staging set, at most the sessions in neither)
    torch.cuda._sleep(100_000_000)
    a = engine.launch_decode([req(0, 1)])
    b = engine.launch_decode([req(1, 1)])
    assert b.capacity >= 4 and b.room >= 3 and not a.ready()
    assert all(engine.join_decode(b, [req(k, 1)]) for k in (2, 3, 4))
    assert b.room == b.capacity - 4
    close(a.wait()[0], 0, 1)
    close(b.wait()[0], 1, 1)
    for k, outs in zip((2, 3, 4), b.joined_outputs(), strict=True):
        assert outs is not None
        close(outs[0], k, 1)
        assert sessions[k].length_tokens == length[k] + 2
    assert engine.decode_many([req(5, 1)])[0].shape == (1, 1, 512)  # session 5 catches up alone
    # step 2: `d` joins after the device already ran `c`: not answered from it, its session's length unchanged
    torch.cuda._sleep(100_000_000)
    a2 = engine.launch_decode([req(0, 2)])
    c = engine.launch_decode([req(1, 2)])
    assert c.room >= 1
    torch.cuda.synchronize()
    assert engine.join_decode(c, [req(2, 2)])
    close(a2.wait()[0], 0, 2)
    close(c.wait()[0], 1, 2)
    assert c.joined_outputs() == [None] and sessions[2].length_tokens == length[2] + 2
    close(engine.decode_many([req(2, 2)])[0], 2, 2)  # run again: right
    for k in (3, 4, 5):
        close(engine.decode_many([req(k, 2)])[0], k, 2)
    for k in range(6):  # every session's next step reads every key/value written so far: none went astray
        close(engine.decode_many([req(k, 3)])[0], k, 3)
    for s in sessions:
        s.close()
