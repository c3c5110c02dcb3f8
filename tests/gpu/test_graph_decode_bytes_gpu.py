"""Launched merged forwards staged from the steps' bytes (`StepRequest.hidden_bytes`, as a device channel hands them
over) on a real GPU: the same outputs as `decode_many` from tensors, for live rows filling a bucket and for fewer
(the bucket's padding rows staged on the host, no reset kernels), with a two-row session, several launches before
the first wait, and a later forward of fewer rows in the same staging set (no stale padding). Skipped without CUDA."""

from __future__ import annotations

import torch
from test_engine_gpu import BF16, make_blocks, make_engine

from corolla.engine.span_engine import StepRequest
from corolla.utils.tensor_bytes import TensorBytes


def _with_bytes(session, hidden: torch.Tensor, position: int, *, tensor: bool = True) -> StepRequest:
    """The step with its bytes, and a tensor viewing them or (`tensor=False`, as a device channel hands a step
    over) only their dtype and shape."""
    copy = bytearray(hidden.contiguous().view(torch.uint8).numpy().tobytes())
    if not tensor:
        return StepRequest(session, None, position, hidden_bytes=memoryview(copy), hidden_dtype=hidden.dtype,
                           hidden_shape=tuple(hidden.shape))  # fmt: skip
    view = torch.frombuffer(copy, dtype=hidden.dtype).view(hidden.shape)  # [B, 1, H]
    return StepRequest(session, view, position, hidden_bytes=memoryview(copy))


@torch.no_grad()
def test_forwards_staged_from_bytes_equal_forwards_from_tensors() -> None:
    engine = make_engine(make_blocks(layers=2))
    torch.manual_seed(7)
    prompts = [torch.randn(b, n, 512, dtype=BF16) for b, n in ((1, 5), (2, 33), (1, 70), (1, 9), (1, 12))]
    tokens = [[torch.randn(p.shape[0], 1, 512, dtype=BF16) for _ in range(3)] for p in prompts]
    # forwards: 6 rows (sessions 0-4, a bucket of 8: two padding rows), 3 rows (0, 1: bucket 4), 1 row (3)
    plan = [((0, 0), (1, 0), (2, 0), (3, 0), (4, 0)), ((0, 1), (1, 1)), ((3, 1),), ((2, 1), (4, 1), (0, 2))]

    def opened():
        sessions = [engine.open_session(p.shape[0], 256) for p in prompts]
        for s, p in zip(sessions, prompts, strict=True):
            engine.step(s, p, 0)
        return sessions

    sessions = opened()
    expected = []
    for forward in plan:
        reqs = [StepRequest(sessions[k], tokens[k][i], prompts[k].shape[1] + i) for k, i in forward]
        expected.append([o.clone() for o in engine.decode_many(reqs)])
    for s in sessions:
        s.close()
    sessions = opened()
    pending = []
    for forward in plan:
        # sessions 0, 2, 4 hand over bytes only (no tensor): the launch stages them without building one
        reqs = [_with_bytes(sessions[k], tokens[k][i], prompts[k].shape[1] + i, tensor=k % 2 == 1) for k, i in forward]
        for r in reqs:
            engine.check_inputs(r)
        pending.append(engine.launch_decode(reqs))  # all four launched before any wait
        assert all(r.hidden_tensor is None for (k, _), r in zip(forward, reqs, strict=True) if k % 2 == 0)
    for j, (handle, want) in enumerate(zip(pending, expected, strict=True)):
        got = handle.wait()
        for out, ref in zip(got, want, strict=True):
            assert out.device.type == "cpu" and out.shape == ref.shape
            assert torch.equal(out, ref), j
    for s in sessions:
        s.close()


@torch.no_grad()
def test_launched_steps_carry_their_outputs_bytes() -> None:
    from corolla.engine.batcher import launch_steps

    engine = make_engine(make_blocks(layers=2))
    sessions = [engine.open_session(b, 64) for b in (1, 2, 1)]
    reqs = [_with_bytes(s, torch.randn(s.batch_size, 1, 512, dtype=BF16), 0) for s in sessions]
    reqs.insert(1, StepRequest(sessions[0], torch.randn(1, 1, 512, dtype=BF16), 7))  # session 0 again: declined
    assert launch_steps(engine, reqs) is None
    reqs.pop(1)
    pending = launch_steps(engine, reqs)
    assert pending is not None
    outs = pending.wait()
    for r, out in zip(reqs, outs, strict=True):  # each a launched step's bytes, no tensor built (`TensorBytes`)
        assert isinstance(out, TensorBytes) and out.data is r.output_bytes and out.shape == r.shape
        assert out.dtype == BF16 and out.tensor().shape == (r.rows, 1, 512)
    for s in sessions:
        s.close()
