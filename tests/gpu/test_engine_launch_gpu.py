"""Two-phase decode on a real GPU (`SpanEngine.launch_decode`, `engine.batcher.launch_steps`): forwards launched
before the earlier ones are waited for (three in a row, more than the two pinned staging sets, one session in two of
them) give exactly what `decode_many` gives one after another; an invalid step fails alone; what `can_launch` refuses
is said before anything runs. Skipped without CUDA."""

from __future__ import annotations

import time

import pytest
import torch
from test_engine_gpu import BF16, DEV, make_blocks, make_engine

from corolla.engine.batcher import launch_steps
from corolla.engine.span_engine import StepRequest
from corolla.utils.tensor_bytes import TensorBytes


def _opened(engine, prompts):
    sessions = [engine.open_session(p.shape[0], 256) for p in prompts]
    for s, p in zip(sessions, prompts, strict=True):
        engine.step(s, p, 0)
    return sessions


@torch.no_grad()
def test_launched_forwards_equal_forwards_run_one_after_another() -> None:
    engine = make_engine(make_blocks())
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
    started = time.perf_counter()
    pending = [engine.launch_decode(requests(sessions, f)) for f in plan]  # three launches before any wait
    got = {j: pending[j].wait() for j in (2, 0, 1)}  # waited out of order
    wall_s = time.perf_counter() - started
    for j in range(len(plan)):
        for out, ref in zip(got[j], expected[j], strict=True):
            assert out.device.type == "cpu" and out.shape == ref.shape
            assert torch.equal(out, ref), j
    # each forward's own device time (CUDA events from its first copy in to its last copy out): measured, and the
    # queued forwards' times do not overlap (a forward's clock starts when the device reaches it, not at its launch:
    # their sum fits in the wall time from the first launch to the last wait)
    device_s = [p.device_s for p in pending]
    assert all(d is not None and d > 0 for d in device_s), device_s
    assert sum(device_s) <= wall_s, (device_s, wall_s)
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
    assert isinstance(out_a, TensorBytes) and out_a.shape == (1, 1, 512)  # a launched step's bytes
    assert isinstance(err_b, ValueError) and "start position" in str(err_b)
    assert launch_steps(engine, [StepRequest(a, torch.randn(1, 3, 512, dtype=BF16), 1)]) is None  # a prefill
    assert launch_steps(engine, [StepRequest(a, x, 1), StepRequest(a, x, 2)]) is None  # one session twice
    assert launch_steps(engine, [StepRequest(a, x.to(DEV), 1)]) is None  # inputs on the device
    assert a.length_tokens == 1  # nothing declined ran
    with pytest.raises(ValueError, match="launch_decode"):
        engine.launch_decode([StepRequest(a, x, 1), StepRequest(a, x, 2)])
    a.close()
    b.close()
