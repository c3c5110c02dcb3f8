"""Merging of queued steps, the server `Runtime`'s batch executor and launcher: `execute_steps` runs a set of step
requests of many sessions with as much merging as is correct; `launch_steps` launches a set of decode steps that one
CUDA-graph forward serves and finishes it later (`PendingSteps.wait`), so that the runtime can launch the next
forward before it sends this one's replies. How the server groups requests into tasks is its own
(`server.core.engine_executor`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from corolla.engine.graph_decode import PendingDecode
from corolla.engine.span_engine import SpanEngine, StepRequest
from corolla.utils.errors import AllocationFailed
from corolla.utils.logging import get_logger
from corolla.utils.tensor_bytes import TensorBytes

logger = get_logger(__name__)

# one request's output [B, T, H] (a tensor, or a launched step's bytes: `TensorBytes`), or what failed it alone
StepResult = torch.Tensor | TensorBytes | BaseException


def execute_steps(engine: SpanEngine, requests: Sequence[StepRequest]) -> list[StepResult]:
    """Runs a set of step requests with as much merging as is correct and returns one result per request, in order
    (a `ValueError` instance for an invalid request, without affecting the others). Single-token steps of distinct
    sessions share one batched forward; a session's later steps in the same set run in later rounds, in order."""
    results: list[StepResult | None] = [None] * len(requests)
    remaining = list(range(len(requests)))
    while remaining:
        seen: set[int] = set()
        this_round: list[int] = []
        later: list[int] = []
        for i in remaining:  # one step per session per round, keeping each session's order
            key = id(requests[i].session)
            (later if key in seen else this_round).append(i)
            seen.add(key)
        decode: list[int] = []
        prefill: list[int] = []
        for i in this_round:
            try:
                engine.validate(requests[i])
            except (ValueError, AllocationFailed) as e:  # this step only (a fragmented pool: `validate`)
                results[i] = e
                continue
            (decode if requests[i].is_decode else prefill).append(i)
        by_layers: dict[tuple[int, int], list[int]] = {}
        for i in decode:  # one batched forward per layer range (sessions may cover part of the span)
            by_layers.setdefault(requests[i].session.layers, []).append(i)
        for group in by_layers.values():
            try:
                grouped = [requests[i] for i in group]
                outs = engine.decode_many(grouped, validated=True)
                for i, out in zip(group, outs, strict=True):
                    results[i] = out
                attach_output_bytes(grouped, outs)  # CPU outputs: their replies encoded from bytes
            except Exception as e:  # a device failure fails this group's decode steps only
                logger.warning(f"batcher.decode_failed(steps={len(group)}, error={e!r})")
                for i in group:
                    results[i] = e
        for i in prefill:
            req = requests[i]
            try:
                results[i] = engine.step(req.session, req.hidden, req.position, req.hypo_ids, req.prompts)
            except Exception as e:
                results[i] = e
        remaining = later
    return results  # type: ignore[return-value]


def attach_output_bytes(requests: Sequence[StepRequest], outs: Sequence[torch.Tensor]) -> None:
    """Sets each request's `output_bytes` where the outputs are consecutive rows of one contiguous CPU buffer in
    request order (a merged forward's output split per request, as the eager/CPU decode returns it): one view of
    the buffer's bytes, sliced per request, so that its reply is encoded without a torch call per step, as a
    launched forward's is (`PendingSteps.wait`). Checked per output (address, contiguity, size) and against the
    buffer's end; any other layout sets nothing (the reply reads the tensor)."""
    if not outs or len(outs) != len(requests):
        return
    first = outs[0]
    if not first.is_cpu or first.dtype not in _BYTE_DTYPES or first.ndim != 3:
        return
    dtype = first.dtype
    row_bytes = first.shape[2] * first.element_size()  # one token of one sequence: H elements
    start = first.data_ptr()
    offsets = [0]  # each output's bytes from `start`: its request's [B, T, H], as the reply's record will say
    for req, out in zip(requests, outs, strict=True):
        if out.data_ptr() != start + offsets[-1] or not out.is_contiguous() or out.dtype != dtype:
            return
        offsets.append(offsets[-1] + req.rows * req.num_tokens * row_bytes)
    storage = first.untyped_storage()
    if start + offsets[-1] > storage.data_ptr() + storage.nbytes():
        return  # past the buffer: not one merged output
    itemsize = first.element_size()
    flat = first.detach().as_strided((offsets[-1] // itemsize,), (1,), first.storage_offset())  # all their elements
    if dtype == torch.bfloat16:
        flat = flat.view(torch.int16)  # numpy lacks bfloat16: its 16-bit words
    data = flat.numpy().data.cast("B")
    for i, req in enumerate(requests):
        req.output_bytes = data[offsets[i] : offsets[i + 1]]  # a reply checks this length against its record


# dtypes whose bytes numpy reads (bfloat16 as int16 words)
_BYTE_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})


class PendingSteps:
    """Step requests whose valid ones run in one launched forward: `wait()` gives one result per request, in order
    (a `ValueError` instance for an invalid request; a device failure fails the launched ones only): a launched
    request's output as its rows' bytes in the forward's one copy of the output (`TensorBytes`, also set as its
    `output_bytes`), no tensor built on the device thread (a reply is encoded from the bytes)."""

    def __init__(
        self,
        requests: Sequence[StepRequest],
        results: list[StepResult | None],
        launched: Sequence[int],
        pending: PendingDecode | None,
    ):
        self._requests = requests
        self._results = results
        self._launched = launched  # indices of the requests in the forward, in its row order
        self._pending = pending  # None: no valid request, nothing launched

    @property
    def device_s(self) -> float | None:
        """The forward's device seconds once waited for (`PendingDecode.device_s`); None where nothing launched."""
        return self._pending.device_s if self._pending is not None else None

    @property
    def rows(self) -> int:
        """The rows of the launched forward (its requests' B x T summed; 0 where nothing launched)."""
        return self._pending.rows if self._pending is not None else 0

    def wait(self) -> list[StepResult]:
        results = self._results
        pending = self._pending
        if pending is None:
            return results  # type: ignore[return-value]
        try:
            data = pending.output_bytes()  # [rows, H]: each launched request's output bytes, in row order
            row_bytes, dtype, requests = len(data) // pending.rows, pending.dtype, self._requests
            new = tuple.__new__  # `TensorBytes(out, dtype, shape)` without the NamedTuple's Python `__new__` per row
            start = 0
            for i in self._launched:
                req = requests[i]
                end = start + req.rows * req.num_tokens * row_bytes
                out = req.output_bytes = data[start:end]  # its [B, T, H] (the engine's dtype)
                results[i] = new(TensorBytes, (out, dtype, req.shape, True))
                start = end
        except Exception as e:  # a device failure fails this forward's steps only
            logger.warning(f"batcher.decode_failed(steps={len(self._launched)}, error={e!r})")
            for i in self._launched:
                results[i] = e
        return results  # type: ignore[return-value]


def launch_steps(engine: SpanEngine, requests: Sequence[StepRequest]) -> PendingSteps | None:
    """`execute_steps` in two phases where one launched forward serves the whole set (see `SpanEngine.can_launch`:
    decode steps of distinct sessions over one layer range on the CUDA-graph path); None (nothing done) otherwise.
    Invalid requests get their `ValueError` without joining the forward. A failing launch raises: every step of the
    set fails."""
    if not engine.can_launch(requests):
        return None
    results: list[StepResult | None] = [None] * len(requests)
    validate, refused = engine.validate, False
    for i, req in enumerate(requests):
        try:
            validate(req)
        except (ValueError, AllocationFailed) as e:
            results[i] = e
            refused = True
    if not refused:  # the usual forward: every request in it, as they came
        return PendingSteps(requests, results, range(len(requests)), engine.launch_decode(
            requests, validated=True, launchable=True))  # fmt: skip
    launched = [i for i, result in enumerate(results) if result is None]
    if not launched:
        return PendingSteps(requests, results, [], None)
    pending = engine.launch_decode([requests[i] for i in launched], validated=True, launchable=True)  # a subset
    return PendingSteps(requests, results, launched, pending)
