"""`RemoteSequential`: a range of remote blocks used like a local `nn.Module` — forward/backward as a torch autograd
function through the swarm (re-planned on failure; with `ClientConfig.verify_fraction`, sampled spans' outputs and
gradients are voted on by other servers; a span's outputs that the next span's float16 server cannot hold are put to
a replica of it first, `verification.range_dispute`), or step-by-step inside an inference session."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import torch
from torch import nn

from corolla.client import background_loop
from corolla.client.calls.output_checks import InputsOutOfRange
from corolla.client.calls.remote_forward_backward import (
    NO_PROMPTS,
    run_remote_backward,
    run_remote_forward,
    span_prompts,
)
from corolla.client.calls.retries import RetryBudget
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session.inference_session import InferenceSession
from corolla.client.verification.range_dispute import Produced, producer_failure
from corolla.client.verification.step_verifier import StepVerifier
from corolla.protocol.records import RemoteSpanInfo
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_TOKENS_IN_BATCH = 1024  # rows per sub-batch = max(1024 // seq_len, 1); sub-batches run concurrently


async def _retry(budget: RetryBudget, peer_id: str | None, error: Exception, blocks: tuple[int, int]) -> None:
    """Bans the server that failed (a bad output is the failure of the server that produced it) and sleeps; raises
    NoHonestServerError when the call's retry budget is spent."""
    logger.warning("remote_sequential.span_failed(peer=...%s, error=%r)", (peer_id or "?")[-6:], error)
    delay_s = await asyncio.to_thread(budget.on_failure, error, peer_id, blocks)
    await asyncio.sleep(delay_s)


async def sequential_forward(
    manager: RemoteSequenceManager,
    inputs: torch.Tensor,
    prompts: torch.Tensor,
    start: int,
    end: int,
    verifier: StepVerifier | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[RemoteSpanInfo]]:
    """Runs blocks `[start, end)`; returns (outputs, the input of every span used, those spans). With a `verifier`
    (`ClientConfig.verify_fraction` > 0), sampled spans' outputs are voted on by other servers of their blocks."""
    hidden, span_inputs, spans = inputs, [], []
    block, route, budget = start, None, RetryBudget(manager)
    while block < end:
        span = None
        try:
            if not route:
                route = await asyncio.to_thread(manager.make_sequence, block, end, mode="max_throughput")
            span = route[0]
            # prompts are indexed relative to `start` of the whole call; spans relative to the manager
            own_prompts = span_prompts(prompts, start, span)
            outputs = await run_remote_forward(manager, span, hidden, own_prompts)
            if verifier is not None and verifier.sample([span.peer_id]):
                await verifier.verify(span, hidden, outputs, prompts=own_prompts)
            manager.on_request_success(span.peer_id)
            budget.on_success()
            span_inputs.append(hidden)
            spans.append(span)
            hidden, block, route = outputs, span.end, route[1:]
        except Exception as e:
            route = None
            failed = span.peer_id if span is not None else None
            blocks = (block, span.end if span is not None else end)
            if isinstance(e, InputsOutOfRange) and e.peer_id == failed and spans:
                # the spans before, nearest first, each with the outputs it gave: the last one's `hidden`, past the
                # float16 server's range, maybe a liar's or carried on from one's by the spans between (0186)
                gave = [*span_inputs[1:], hidden]
                producers = [
                    Produced(spans[k], span_inputs[k], gave[k], span_prompts(prompts, start, spans[k]))
                    for k in range(len(spans) - 1, -1, -1)
                ]
                found = await producer_failure(manager, producers, e)
                if found is not None:  # that span fails in its place, and it and the spans after run again
                    k = len(spans) - 1 - found[0]
                    upstream = spans[k]
                    e, failed, blocks = found[1], upstream.peer_id, (upstream.start, upstream.end)
                    hidden, block = span_inputs[k], upstream.start
                    del spans[k:], span_inputs[k:]
            await _retry(budget, failed, e, blocks)
    return hidden, span_inputs, spans


async def sequential_backward(
    manager: RemoteSequenceManager,
    grad_outputs: torch.Tensor,
    span_inputs: list[torch.Tensor],
    spans: list[RemoteSpanInfo],
    prompts: torch.Tensor,
    start: int,
    verifier: StepVerifier | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Back-propagates through `spans` in reverse; a failed span (an error, or gradients outvoted by other servers
    when the `verifier` samples it) is re-run forward on fresh servers first."""
    span_inputs, spans = list(span_inputs), list(spans)
    grad_prompts: dict[int, torch.Tensor] = {}  # first block of a span -> grad of its prompts
    budget = RetryBudget(manager)
    while spans:
        span, inputs = spans[-1], span_inputs[-1]
        try:
            own_prompts = span_prompts(prompts, start, span)
            grad_inputs, span_grad_prompts = await run_remote_backward(manager, span, inputs, grad_outputs, own_prompts)
            if verifier is not None and verifier.sample([span.peer_id]):
                await verifier.verify_backward(
                    span, inputs, grad_outputs, grad_inputs, span_grad_prompts, prompts=own_prompts
                )
            manager.on_request_success(span.peer_id)
            if span_grad_prompts is not None:
                grad_prompts[span.start] = span_grad_prompts
            grad_outputs = grad_inputs
            spans.pop()
            span_inputs.pop()
            budget.on_success()
        except Exception as e:
            await _retry(budget, span.peer_id, e, (span.start, span.end))
            # fresh servers for this span's blocks (and their intermediate inputs); prompts re-sliced from span.start
            _, new_inputs, new_spans = await sequential_forward(
                manager, inputs, span_prompts(prompts, start, span), span.start, span.end, verifier
            )
            spans[-1:], span_inputs[-1:] = new_spans, new_inputs
    if not prompts.numel():
        return grad_outputs, None
    parts = [grad_prompts[b] for b in sorted(grad_prompts)]
    if sum(p.shape[0] for p in parts) != prompts.shape[0]:
        raise ConnectionError("servers returned deep-prompt gradients for only some blocks")
    return grad_outputs, torch.cat(parts, dim=0)


class _RemoteSequentialFunction(torch.autograd.Function):
    """inputs [B, T, H], prompts [num_blocks, B|1, P, H] or empty -> outputs [B, T, H]."""

    @staticmethod
    def forward(ctx, inputs: torch.Tensor, prompts: torch.Tensor, manager: RemoteSequenceManager, start: int, end: int):
        rows = max(MAX_TOKENS_IN_BATCH // max(inputs.shape[1], 1), 1)
        batches = inputs.detach().cpu().split(rows)
        prompts_cpu = prompts.detach().cpu()
        per_row_prompts = prompts_cpu.numel() > 0 and prompts_cpu.shape[1] == inputs.shape[0] and inputs.shape[0] > 1
        prompt_batches = prompts_cpu.split(rows, dim=1) if per_row_prompts else [prompts_cpu] * len(batches)

        verifier = StepVerifier(manager) if manager.config.verify_fraction > 0 else None

        async def _run():
            return await asyncio.gather(
                *(
                    sequential_forward(manager, x, p, start, end, verifier)
                    for x, p in zip(batches, prompt_batches, strict=True)
                )
            )

        results = background_loop.run(_run())
        ctx.manager, ctx.start, ctx.end, ctx.verifier = manager, start, end, verifier
        ctx.results, ctx.prompt_batches, ctx.per_row_prompts, ctx.rows = results, prompt_batches, per_row_prompts, rows
        ctx.device = inputs.device
        return torch.cat([outputs for outputs, _, _ in results], dim=0).to(device=inputs.device, dtype=inputs.dtype)

    @staticmethod
    def backward(ctx, grad_outputs: torch.Tensor):
        grads = grad_outputs.detach().cpu().split(ctx.rows)

        async def _run():
            return await asyncio.gather(
                *(
                    sequential_backward(ctx.manager, g, span_inputs, spans, p, ctx.start, ctx.verifier)
                    for g, (_, span_inputs, spans), p in zip(grads, ctx.results, ctx.prompt_batches, strict=True)
                )
            )

        results = background_loop.run(_run())
        grad_inputs = torch.cat([g for g, _ in results], dim=0).to(ctx.device)
        grad_prompts = None
        if ctx.needs_input_grad[1] and results[0][1] is not None:
            parts = [p for _, p in results]
            grad_prompts = torch.cat(parts, dim=1) if ctx.per_row_prompts else torch.stack(parts).sum(dim=0)
            grad_prompts = grad_prompts.to(ctx.device)
        return grad_inputs, grad_prompts, None, None, None


class RemoteSequential(nn.Module):
    """Blocks `[start, end)` of a sequence manager's model, run remotely.

    `forward(inputs [B, T, H], prompts=None)` is differentiable wrt inputs and deep prompts
    (`[end - start, B|1, P, H]`); inside `with seq.inference_session(max_length=...)` it steps that session instead.
    """

    def __init__(self, manager: RemoteSequenceManager, start: int = 0, end: int | None = None):
        super().__init__()
        end = manager.num_blocks if end is None else end
        if not 0 <= start < end <= manager.num_blocks:
            raise ValueError(f"block range [{start}, {end}) is outside [0, {manager.num_blocks})")
        self.manager, self.start, self.end = manager, start, end
        self.active_session: InferenceSession | None = None

    def forward(self, inputs: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        if inputs.ndim != 3:
            raise ValueError(f"inputs must be [batch, tokens, hidden], got shape {list(inputs.shape)}")
        if self.active_session is not None:
            return self.active_session.step(inputs, prompts)
        if prompts is None:
            prompts = NO_PROMPTS.to(inputs.dtype)
        elif prompts.ndim != 4 or prompts.shape[0] != len(self) or prompts.shape[1] not in (1, inputs.shape[0]):
            raise ValueError(
                f"deep prompts must be [num_blocks={len(self)}, batch or 1, prefix, hidden], got {list(prompts.shape)}"
            )
        return _RemoteSequentialFunction.apply(inputs, prompts, self.manager, self.start, self.end)

    def inference_session(self, max_length: int) -> InferenceSession:
        """A session over these blocks; while it is open (as a context manager) `forward` steps it."""
        session = InferenceSession(self.manager, max_length, start=self.start, end=self.end)
        session.on_enter.append(lambda: setattr(self, "active_session", session))
        session.on_exit.append(lambda: setattr(self, "active_session", None))
        return session

    @property
    def position(self) -> int:
        return self.active_session.position if self.active_session is not None else 0

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, index: int | slice) -> RemoteSequential:
        if isinstance(index, int):
            if not -len(self) <= index < len(self):
                raise IndexError(f"block {index} is outside a sequence of {len(self)}")
            index %= len(self)
            return RemoteSequential(self.manager, self.start + index, self.start + index + 1)
        first, last, step = index.indices(len(self))
        if step != 1:
            raise ValueError("RemoteSequential slices must be contiguous (step 1)")
        return RemoteSequential(self.manager, self.start + first, self.start + last)

    def __iter__(self) -> Iterator[RemoteSequential]:
        return (self[i] for i in range(len(self)))

    def extra_repr(self) -> str:
        return f"blocks={self.start}:{self.end}, uids={self.manager.block_uids[self.start]}..{self.manager.block_uids[self.end - 1]}"
