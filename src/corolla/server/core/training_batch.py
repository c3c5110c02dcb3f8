"""Training work (`rpc_forward`, `rpc_backward`) of all clients as runtime tasks of one block each, merged across
clients: works at the same block, phase, length and adapter run as one block call (rows concatenated; deep prompts
zero-padded, which adds exactly 0). A backward recomputes its blocks' inputs unless the same client's forward kept
them (`training_activations`), then runs one backward work per block from the last down. A request's works follow
each other in the device thread (`BlockChain`); block calls are the runtime's background launched batches (decisions
0027, 0045, 0057)."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from typing import Any

import torch

from corolla.server.backend import SpanBackend
from corolla.server.core.gather import ewma
from corolla.server.core.runtime import PRIORITY_BACKWARD, PRIORITY_FORWARD, KindStats, Runtime, Task, resolve
from corolla.server.core.training_activations import KeptActivations, device_free_bytes
from corolla.server.core.training_graphs import TrainingGraphs
from corolla.server.metrics import ServerMetrics
from corolla.server.sizing import autograd_reserve_bytes
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

PHASE_FORWARD = "forward"
PHASE_BACKWARD = "backward"
# the runtime's task kinds of forward and backward works (each with its own merge limit)
KIND_TRAINING_FORWARD = "training_forward"
KIND_TRAINING_BACKWARD = "training_backward"
TRAINING_KINDS = (KIND_TRAINING_FORWARD, KIND_TRAINING_BACKWARD)
# the most tokens (rows x length) of one merged block task, by phase: an inference step that arrives meanwhile waits for
# at most one such task, so this bounds what training adds to a concurrent session's step (one request larger than
# this still runs, alone; the backward's limit: docs/decisions/0027)
FORWARD_MERGE_TOKENS = 2048
BACKWARD_MERGE_TOKENS = 2048
# forward activations kept for backwards: at most this many times the memory the server's sizing leaves free for
# autograd (`sizing.autograd_reserve_bytes`), and on a GPU only while that reserve stays free beside them
KEPT_RESERVE_MULTIPLE = 4


@dataclass(eq=False, slots=True)
class BlockWork:
    """One request's work on one block: its rows, its deep prompt and, for a backward, the gradient of its output."""

    phase: str  # PHASE_FORWARD or PHASE_BACKWARD
    index: int  # the block
    adapter: str
    hidden: torch.Tensor  # [B, T, H] the block's input
    prompt: torch.Tensor | None  # [B|1, P, H] the block's deep prompt
    grad_output: torch.Tensor | None = None  # [B, T, H], backward only

    @property
    def rows(self) -> int:
        return int(self.hidden.shape[0])


class BlockChain:
    """One request's block works in order, advanced in the thread that ran the last one (the device thread): a
    finished work queues the request's next one at once, so consecutive blocks need no round trip through the event
    loop (where an inference step would slip in before every block); the request's future resolves once, at the end.

    A forward: one forward work per block (`keep_inputs`: every block's input kept in `inputs`, else the last only).
    A backward: forward works for all blocks but the last (each block's input, kept in `inputs`), unless a forward
    kept them (`kept`: the inputs of the blocks after the first), then one backward work per block from the last
    down."""

    def __init__(
        self, phase: str, indices: list[int], prompts: list[torch.Tensor | None], adapter: str,
        hidden: torch.Tensor, grad_output: torch.Tensor | None = None, *, keep_inputs: bool = False,
        kept: list[torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        self.indices, self.prompts, self.adapter = indices, prompts, adapter
        self.inputs: list[torch.Tensor] = [hidden, *(kept or ())]  # [B, T, H] each
        self.keep_inputs = keep_inputs
        self.grad = grad_output  # [B, T, H] the gradient of the next backward work's output
        self.grad_prompts: list[torch.Tensor | None] = [None] * len(indices)
        # (phase, position in `indices`) of every work, in order
        if phase == PHASE_FORWARD:
            forwards = len(indices)
        else:
            assert kept is None or len(kept) == len(indices) - 1, "kept inputs of another span"
            forwards = 0 if kept is not None else len(indices) - 1
        self.plan = [(PHASE_FORWARD, i) for i in range(forwards)]
        if phase == PHASE_BACKWARD:
            self.plan.extend((PHASE_BACKWARD, i) for i in reversed(range(len(indices))))
        self.done = 0  # works finished
        self.is_forward = phase == PHASE_FORWARD
        self.current: BlockWork | None = None  # the work queued in the runtime, not run yet
        # the work it ended at (its last, or a failed one) and its answer or error, delivered by that work's `on_done`
        self.ended_at: BlockWork | None = None
        self.answer: Any = None
        self.error: BaseException | None = None
        self.future: asyncio.Future | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # when the request arrived (`time.monotonic()`): its works rank there among the training works (`Task.ranks_at`),
        # so that the clients' transfers overlap other clients' block calls (docs/decisions/0045)
        self.arrived_s = 0.0

    def next_work(self) -> BlockWork:
        phase, i = self.plan[self.done]
        if phase == PHASE_FORWARD:
            return BlockWork(phase, self.indices[i], self.adapter, self.inputs[-1], self.prompts[i])
        return BlockWork(phase, self.indices[i], self.adapter, self.inputs[i], self.prompts[i], self.grad)

    def advance(self, result: Any) -> bool:
        """Takes the current work's result; True while works remain."""
        phase, i = self.plan[self.done]
        self.done += 1
        if phase == PHASE_FORWARD:
            if self.is_forward and not self.keep_inputs:
                self.inputs[-1] = result  # [B, T, H]
            elif self.keep_inputs and self.done < len(self.plan):
                # a block input kept beyond this request: its own memory, not a view of a merged call's output (which
                # would hold every merged request's rows as long as this one is kept); in the device thread, so the
                # copy follows the call on its stream
                self.inputs.append(_owning(result))
            else:
                self.inputs.append(result)
        else:
            self.grad, self.grad_prompts[i] = result
            del self.inputs[i:]  # no later work reads this block's input
        return self.done < len(self.plan)

    def result(self) -> Any:
        """The request's answer: the span's output [B, T, H], or (gradient of the inputs [B, T, H], of the deep prompts
        [n_blocks, B|1, P, H] or None)."""
        if self.is_forward:
            return self.inputs[-1]
        if self.prompts[0] is None:
            return self.grad, None
        return self.grad, torch.stack([g for g in self.grad_prompts if g is not None])

    def kept_inputs(self) -> list[torch.Tensor]:
        """A finished `keep_inputs` forward's inputs of the blocks after the first ([B, T, H] each): a backward's
        `kept`."""
        assert self.is_forward and self.keep_inputs and self.done == len(self.plan)
        return self.inputs[1:-1]


class TrainingBatcher:
    """Runs forwards and backwards of a span as merged block tasks on `runtime` (see the module docstring)."""

    def __init__(
        self, backend: SpanBackend, runtime: Runtime, metrics: ServerMetrics | None = None, *,
        kept: KeptActivations | None = None,
    ) -> None:  # fmt: skip
        self.backend = backend
        self._runtime = runtime
        self.metrics = metrics
        self._merge_id = id(self)
        self._cuda = backend.device.type == "cuda"
        # the last block call queued on the device: its kind, and events before and after it on the stream
        self._in_flight: tuple[str, torch.cuda.Event, torch.cuda.Event] | None = None
        # per kind, learned for `estimate`: the thread's seconds running (on a GPU: launching) a block call, and on a
        # GPU the device's seconds on one
        self._launch_s: dict[str, float] = {}
        self._device_s: dict[str, float] = {}
        # where the device thread's time on training goes (benchmarks): block calls, seconds spent running (on a GPU:
        # launching) them, seconds waiting for the call before each
        self.num_calls = 0
        self.call_s = 0.0
        self.wait_s = 0.0
        # and requests answered, seconds from queuing a request's first work to its answer
        self.num_requests = 0
        self.chain_s = 0.0
        # forwards' block inputs kept for their backwards (default: bounded by the sizing's autograd reserve)
        self.kept = kept if kept is not None else default_kept_activations(backend)
        # on a GPU, block calls with no deep prompt and no adapter replay CUDA graphs (None: every call eager); not for
        # a span over several devices (tensor parallel: a capture on one device's stream would miss the others' work)
        self.graphs = TrainingGraphs(backend) if self._cuda and _one_device(backend) else None
        self.set_merge_tokens(FORWARD_MERGE_TOKENS, BACKWARD_MERGE_TOKENS)

    def set_merge_tokens(self, forward_tokens: int, backward_tokens: int) -> None:
        """The most tokens of one merged forward and backward block call (1: every work alone, as the benchmark's
        unmerged A/B runs)."""
        register = self._runtime.register_batch_executor
        for kind, tokens in ((KIND_TRAINING_FORWARD, forward_tokens), (KIND_TRAINING_BACKWARD, backward_tokens)):
            # no sessions' steps: the gather rule is the inference steps' (a training call's next work is queued
            # at its launch, not pushed back by a session)
            register(kind, self._execute, max_merged_tokens=tokens, launcher=self._launch, gathered=False,
                     estimate=functools.partial(self.estimate, kind))  # fmt: skip

    def estimate(self, kind: str) -> float | None:
        """The runtime's `BackgroundEstimate` for `kind`: the seconds a block call launched now would take, its launch
        and (on a GPU) its device time as learned; None while the call before is still on the device."""
        in_flight = self._in_flight
        if in_flight is not None and not in_flight[2].query():
            return None
        launch_s = self._launch_s.get(kind)
        if launch_s is None:
            return float("inf")
        return launch_s + (self._device_s.get(kind, float("inf")) if self._cuda else 0.0)

    async def forward(
        self, block_indices: tuple[int, ...], hidden: torch.Tensor, prompts: torch.Tensor | None, adapter: str,
        owner: str = "",
    ) -> torch.Tensor:  # fmt: skip
        """`SpanBackend.forward`'s result ([B, T, H]), each block a runtime task merged with other requests'; the
        block inputs are kept for `owner`'s backward of the same `hidden` and `prompts` (as received)."""
        backend = self.backend
        indices = backend.validate_block_indices(block_indices)
        received, received_prompts = hidden, _present(prompts)
        hidden = backend.check_hidden(hidden)
        per_block = backend.split_prompts(prompts, len(indices), hidden.shape[0])
        backend.adapter_context(adapter)  # ValueError for an unknown adapter, before anything is queued
        if hidden.shape[1] == 0:
            return hidden.clone()
        keep = len(indices) > 1 and self.kept.max_bytes > 0
        chain = BlockChain(PHASE_FORWARD, indices, per_block, adapter, hidden, keep_inputs=keep)
        output = await self._answer(chain)
        if keep:
            self.kept.put(owner, tuple(indices), adapter, received, received_prompts, chain.kept_inputs())
        self._count(PHASE_FORWARD, output)
        return output

    async def backward(
        self,
        block_indices: tuple[int, ...],
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor,
        prompts: torch.Tensor | None,
        adapter: str,
        owner: str = "",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gradient of the blocks' output (weighted by `grad_outputs`) w.r.t. `inputs` [B, T, H] and, with deep
        prompts, w.r.t. them [n_blocks, B|1, P, H]; each block's forward and backward a runtime task merged with other
        requests' (the forwards skipped where `owner`'s forward of the same inputs and prompts kept its block inputs)."""
        backend = self.backend
        received, received_prompts = inputs, _present(prompts)
        indices, inputs, grad_outputs, per_block = backend.check_backward(block_indices, inputs, grad_outputs, prompts)
        backend.adapter_context(adapter)  # ValueError for an unknown adapter, before anything is queued
        if inputs.shape[1] == 0:  # nothing flows back: zeros
            present = [p for p in per_block if p is not None]  # all or none (`split_prompts`)
            return torch.zeros_like(inputs), torch.zeros_like(torch.stack(present)) if present else None
        kept = None
        if len(indices) > 1:
            kept = self.kept.take(owner, tuple(indices), adapter, received, received_prompts)
        chain = BlockChain(PHASE_BACKWARD, indices, per_block, adapter, inputs, grad_outputs, kept=kept)
        grads = await self._answer(chain)
        self._count(PHASE_BACKWARD, inputs)
        return grads

    async def _answer(self, chain: BlockChain) -> Any:
        """The chain's result (`BlockChain.result`), its time on the server counted."""
        started = time.perf_counter()
        answer = await self._start(chain)
        self.num_requests += 1
        self.chain_s += time.perf_counter() - started
        return answer

    def _start(self, chain: BlockChain) -> asyncio.Future:
        """Queues the chain's first work; the future of its result (resolved in this loop)."""
        chain.loop = asyncio.get_running_loop()
        chain.future = chain.loop.create_future()
        chain.arrived_s = time.monotonic()
        self._runtime.queue(self._task(chain))  # ValueError (too large) or RuntimeStopped here, to the caller
        return chain.future

    def _task(self, chain: BlockChain) -> Task:
        work = chain.current = chain.next_work()
        rows, length = work.hidden.shape[:2]
        if work.phase == PHASE_FORWARD:
            priority, kind = PRIORITY_FORWARD, KIND_TRAINING_FORWARD
        else:
            priority, kind = PRIORITY_BACKWARD, KIND_TRAINING_BACKWARD
        backend, graphs = self.backend, self.graphs
        return self._runtime.task(
            lambda: run_block_works(backend, [work], graphs)[0], priority=priority, size_tokens=rows * length,
            kind=kind, merge_key=(self._merge_id, work.phase, work.index, length, work.adapter),
            payload=(chain, work), on_done=lambda _, error: self._done(chain, work, error), ranks_at=chain.arrived_s,
        )  # fmt: skip

    def _continue(self, chain: BlockChain, work: BlockWork, result: Any, error: BaseException | None) -> None:
        """In the device thread, once the chain's `work` ran (`_execute`): queues the chain's next work at once, or,
        at its last work or an error, leaves the chain's answer for that work's `on_done`."""
        chain.current = None
        future = chain.future
        assert future is not None
        if future.done():  # the caller gave up (cancelled): the rest is not run
            chain.ended_at = work
            return
        if error is None:
            try:
                if chain.advance(result):
                    self._runtime.queue(self._task(chain))
                    return
                chain.answer = chain.result()
            except Exception as e:  # the runtime stopped meanwhile
                error = e
        chain.error, chain.ended_at = error, work

    def _done(self, chain: BlockChain, work: BlockWork, error: BaseException | None) -> None:
        """A work's `on_done`, once the runtime is through with its call: resolves the chain's future where the chain
        ended at this work (its answer or error), or where the runtime failed the work without running it (stopped,
        or a launch that failed before `_execute`)."""
        if chain.current is work:  # never ran
            chain.current = None
            result = None
            error = error if error is not None else RuntimeError("training work dropped by the runtime")
        elif chain.ended_at is work:
            result, error = chain.answer, chain.error
        else:  # the chain went on past this work
            return
        future, loop = chain.future, chain.loop
        assert future is not None and loop is not None
        try:
            loop.call_soon_threadsafe(resolve, future, result if error is None else error)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            logger.debug("training.deliver_dropped: event loop closed")

    def _launch(self, tasks: list[Task]) -> LaunchedWorks:
        """The runtime's launcher for training block calls: runs `_execute` at once, so that the call's launch hides
        behind the device time of the batch launched before (docs/decisions/0027)."""
        return LaunchedWorks(self._execute(tasks))

    def _execute(self, tasks: list[Task]) -> list[None]:
        """The runtime's batch executor: tasks of one merge key (phase, block, length, adapter) as one block call.
        If the merged call fails, each work runs alone, so that one request's failure stays its own. Each chain goes
        on right here (its next work queued as soon as this call is launched, with no round trip through the runtime's
        results); the runtime's results are placeholders."""
        payloads: list[tuple[BlockChain, BlockWork]] = [task.payload for task in tasks]
        works = [work for _, work in payloads]
        kind = tasks[0].kind
        before = None
        if self._cuda:
            before = torch.cuda.Event(enable_timing=True)
            before.record(torch.cuda.current_stream(self.backend.device))
        started = time.perf_counter()
        results: list[Any]
        try:
            results = run_block_works(self.backend, works, self.graphs)
        except Exception as e:
            if len(works) == 1:
                logger.warning(f"training.call_failed(phase={works[0].phase}, block={works[0].index}, error={e!r})")
                results = [e]
            else:
                logger.warning(f"training.merged_failed(works={len(works)}, error={e!r}): running each alone")
                results = []
                for work in works:
                    try:
                        results.extend(run_block_works(self.backend, [work], self.graphs))
                    except Exception as error:
                        results.append(error)
        launched = time.perf_counter()
        self._launch_s[kind] = ewma(self._launch_s.get(kind), launched - started)
        if before is not None:
            self._bound_in_flight(kind, before)
        self.num_calls += 1
        self.call_s += launched - started
        self.wait_s += time.perf_counter() - launched
        metrics = self.metrics
        if metrics is not None:
            now = time.monotonic()
            for task in tasks:  # (its seconds and steps: the runtime's batch counts)
                metrics.queue_wait(now - task.submitted_at)
        for (chain, work), result in zip(payloads, results, strict=True):
            if isinstance(result, BaseException):
                self._continue(chain, work, None, result)
            else:
                self._continue(chain, work, result, None)
        return [None] * len(tasks)

    def _bound_in_flight(self, kind: str, before: torch.cuda.Event) -> None:
        """Leaves at most this block call (of `kind`, queued after `before`) on the device: waits for the one before
        it, and learns that one's device seconds. The device runs this call while the thread launches the next, and
        an inference step queued next waits behind one block call at most."""
        after = torch.cuda.Event(enable_timing=True)
        after.record(torch.cuda.current_stream(self.backend.device))
        if self._in_flight is not None:
            last_kind, last_before, last_after = self._in_flight
            last_after.synchronize()
            device_s = last_before.elapsed_time(last_after) / 1e3
            self._device_s[last_kind] = ewma(self._device_s.get(last_kind), device_s)
        self._in_flight = (kind, before, after)

    def _count(self, phase: str, hidden: torch.Tensor) -> None:
        if self.metrics is not None:
            self.metrics.tokens(phase, int(hidden.shape[0] * hidden.shape[1]))


class LaunchedWorks:
    """A launched training block call (`runtime.PendingBatch`): nothing left to wait for (`_execute` already waited
    for the call before it, so the device holds at most this one, and passed its results on to the chains)."""

    def __init__(self, results: list[None]) -> None:
        self._results = results

    def wait(self) -> list[None]:
        return self._results

    @property
    def device_s(self) -> float | None:
        return None


def training_stats(stats: dict[str, KindStats]) -> KindStats:
    """The runtime's totals (`Runtime.stats()`) of the forward and backward works together."""
    return sum((stats.get(kind, KindStats()) for kind in TRAINING_KINDS), KindStats())


def default_kept_activations(backend: SpanBackend) -> KeptActivations:
    """The store of a server's training batcher (`KEPT_RESERVE_MULTIPLE`)."""
    reserve = autograd_reserve_bytes(backend.config)
    device = backend.device
    if device.type != "cuda":
        return KeptActivations(KEPT_RESERVE_MULTIPLE * reserve)
    return KeptActivations(
        KEPT_RESERVE_MULTIPLE * reserve, floor_bytes=reserve, free_bytes=lambda: device_free_bytes(device)
    )


def _one_device(backend: SpanBackend) -> bool:
    """Whether every parameter and buffer of the span's blocks is on one device (a CUDA span's)."""
    devices = {tensor.device for block in backend.blocks.values() for tensor in (*block.parameters(), *block.buffers())}
    return len(devices) <= 1


def _owning(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a copy of it where it is a view into a larger storage."""
    return tensor if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size() else tensor.clone()


def _present(prompts: torch.Tensor | None) -> torch.Tensor | None:
    """Deep prompts as a request brought them, None where it brought none (absent or empty)."""
    return None if prompts is None or prompts.numel() == 0 else prompts


def run_block_works(backend: SpanBackend, works: list[BlockWork], graphs: TrainingGraphs | None = None) -> list[Any]:
    """Works of one phase, block, length and adapter as one block call: per work, its output [B, T, H] (forward) or
    (gradient of its input [B, T, H], of its prompt [B|1, P, H] or None) (backward). A lone work runs exactly as
    `SpanBackend.block_forward`/`block_backward` run it; a call with no deep prompt and no adapter replays its CUDA graph
    where `graphs` has one (the same kernels)."""
    first = works[0]
    graphs = graphs if not first.adapter else None
    with backend.adapter_context(first.adapter):
        if len(works) == 1:
            if first.phase == PHASE_FORWARD:
                return [_block_forward(backend, graphs, first.index, first.hidden, first.prompt)]
            assert first.grad_output is not None
            return [_block_backward(backend, graphs, first.index, first.hidden, first.grad_output, first.prompt)]
        rows = [work.rows for work in works]
        hidden = torch.cat([work.hidden for work in works])  # [sum B, T, H]
        prompt = _merged_prompt(works)  # [sum B, P_max, H] or None
        if first.phase == PHASE_FORWARD:
            return list(_block_forward(backend, graphs, first.index, hidden, prompt).split(rows))
        grad_output = torch.cat([work.grad_output for work in works if work.grad_output is not None])
        grad_input, grad_prompt = _block_backward(backend, graphs, first.index, hidden, grad_output, prompt)
        grad_prompts = [None] * len(works) if grad_prompt is None else grad_prompt.split(rows)
        return [
            (grad, _own_prompt_grad(work, grad_rows))
            for work, grad, grad_rows in zip(works, grad_input.split(rows), grad_prompts, strict=True)
        ]


def _block_forward(
    backend: SpanBackend, graphs: TrainingGraphs | None, index: int, hidden: torch.Tensor, prompt: torch.Tensor | None
) -> torch.Tensor:
    """`SpanBackend.block_forward`, replayed as a CUDA graph where it has none of a prompt and `graphs` captures it."""
    output = graphs.forward(index, hidden) if graphs is not None and prompt is None else None
    return output if output is not None else backend.block_forward(index, hidden, prompt)


def _block_backward(
    backend: SpanBackend, graphs: TrainingGraphs | None, index: int, hidden: torch.Tensor, grad_output: torch.Tensor,
    prompt: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """`SpanBackend.block_backward`, replayed as a CUDA graph where it has none of a prompt and `graphs` captures it."""
    grad = graphs.backward(index, hidden, grad_output) if graphs is not None and prompt is None else None
    return (grad, None) if grad is not None else backend.block_backward(index, hidden, grad_output, prompt)


def _merged_prompt(works: list[BlockWork]) -> torch.Tensor | None:
    """The works' prompts as one [sum B, P_max, H]: each expanded to its rows, zero-padded to the longest (zeros
    where a work has none); None if no work has one."""
    present = [work.prompt for work in works if work.prompt is not None]
    if not present:
        return None
    length = max(int(p.shape[1]) for p in present)
    parts = []
    for work in works:
        part = present[0].new_zeros(work.rows, length, present[0].shape[2])  # [B, P_max, H]
        if work.prompt is not None:
            part[:, : work.prompt.shape[1]] = work.prompt  # [B|1, P, H] broadcast over the rows
        parts.append(part)
    return torch.cat(parts)


def _own_prompt_grad(work: BlockWork, grad_rows: torch.Tensor | None) -> torch.Tensor | None:
    """A work's share of the merged prompt's gradient ([B, P_max, H] rows) in its own prompt's shape [B|1, P, H]."""
    if work.prompt is None or grad_rows is None:
        return None
    grad = grad_rows[:, : work.prompt.shape[1]]  # [B, P, H]
    return grad.sum(dim=0, keepdim=True) if work.prompt.shape[0] == 1 else grad
