"""Verification on a replica's spare rows (`ShadowVerifier`): a sampled span session is mirrored, from its position 0,
to a replica of the span over a second `rpc_inference` stream (a "shadow session", its first request marked
`protocol.shadow.SHADOW_KEY`), and each of the replica's outputs is compared with the server's within the dtype's
tolerance. Each position is recomputed once against the shadow's own KV cache (linear in the session's length,
decision 0042), its steps sent `SHADOW_BATCH_ROWS` at a time as one request that a corolla replica runs as spare
rows of its merged decode forwards (0066); a disagreement goes to a third replica (`stretches.StretchReferees`).
`DEFAULT_SHADOW_FRACTION` catches a server lying on 1% of its steps within 1,000 of them in >= 99% of careers (0062);
the liar cannot tell which sessions are mirrored. The rules in full (deep prompts, beam reorders, lag, verdicts):
docs/contracts.md, "Verification by shadow sessions"."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import uuid
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from corolla.client import background_loop
from corolla.client.calls.remote_forward_backward import NO_HYPO_IDS, NO_PROMPTS
from corolla.client.routing.findings import Finding
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session.span_session import SpanSession
from corolla.client.verification.stretches import StretchReferees
from corolla.protocol.records import RemoteSpanInfo
from corolla.protocol.shadow import SHADOW_KEY
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DEFAULT_SHADOW_FRACTION = 0.75  # sessions mirrored: catches a 1%-liar within 1,000 steps in >= 99% (measured)
SHADOW_CHUNK_TOKENS = 64  # the most tokens (x batch) of one shadow step: a replica's longest shadow forward
SHADOW_BATCH_ROWS = 16  # mirrored positions (x batch) sent to the replica together (module docstring)
MAX_SHADOW_LAG_STEPS = 4096  # mirrored steps a slow replica may have queued; past it the shadow is given up
FINISH_TIMEOUT_S = 30.0  # the longest a session's close waits for its shadows to catch up (the rest is not checked)

# "disputed" / "referee_disputed": outvoted by replicas short of a witness's standing, avoided only (decision 0190)
ShadowState = Literal[
    "mirroring", "agreed", "caught", "referee_lied", "disputed", "referee_disputed", "undecided", "failed", "dropped"
]


@dataclass
class Mirrored:
    """One step of the span session as sent: its inputs [B, T, H] for positions [first, first + T), the outputs
    the server returned for them (as it sent them), the beam reorder it applied first (`hypo_ids` [B]: row i of
    the cache continues row hypo_ids[i]; None: none) and the span's deep prompts sent with it (`prompts`
    [blocks, B|1, P, H], P <= T, only with first == 0; None: none)."""

    inputs: torch.Tensor
    claimed: torch.Tensor
    first: int
    hypo_ids: torch.Tensor | None = None
    prompts: torch.Tensor | None = None


class HeldSteps:
    """Mirrored steps of consecutive positions not sent yet, the one request they will make: each step's inputs and
    the server's outputs [B, T, H] (copies), for positions [first, first + length), the first step's beam reorder
    and deep prompts (the steps after it have none: `continues`)."""

    def __init__(self, first: int, hypo_ids: torch.Tensor | None, prompts: torch.Tensor | None) -> None:
        self.inputs: list[torch.Tensor] = []
        self.claimed: list[torch.Tensor] = []
        self.first, self.length, self.batch = first, 0, 0
        self.hypo_ids, self.prompts = hypo_ids, prompts

    def continues(self, first: int, batch: int, hypo_ids: torch.Tensor | None, prompts: torch.Tensor | None) -> bool:
        """Whether a step at `first` of `batch` rows may go in this request: the next positions of the same rows,
        with no beam reorder (applied before its first position) and no deep prompts."""
        return first == self.first + self.length and hypo_ids is None and prompts is None and batch == self.batch

    def add(self, inputs: torch.Tensor, outputs: torch.Tensor) -> int:
        """Copies a step's inputs and outputs [B, T, H] in as the next T positions (a clone each: cheaper than a copy
        into a slice of a buffer, and one `cat` per request); -> the rows held (positions x batch)."""
        self.inputs.append(inputs.clone())
        self.claimed.append(outputs.clone())
        self.length += outputs.shape[1]
        self.batch = outputs.shape[0]
        return self.length * self.batch

    @property
    def steps(self) -> int:
        return len(self.claimed)

    def request(self) -> Mirrored:
        """The held steps as one mirrored step [B, length, H]."""
        if len(self.claimed) == 1:
            return Mirrored(self.inputs[0], self.claimed[0], self.first, self.hypo_ids, self.prompts)
        inputs, claimed = torch.cat(self.inputs, dim=1), torch.cat(self.claimed, dim=1)
        return Mirrored(inputs, claimed, self.first, self.hypo_ids, self.prompts)


@dataclass(eq=False)
class Shadow:
    """One span session's mirror on `replica`: its own stream (`session`), the requests waiting for it, its state."""

    span: RemoteSpanInfo  # the server under test
    replica: RemoteSpanInfo
    session: SpanSession
    # requests for the worker in order, each with the mirrored steps it holds; None: the end
    queue: asyncio.Queue[tuple[Mirrored, int] | None] = field(default_factory=asyncio.Queue)
    queued: int = 0  # mirrored steps not yet taken by the worker, held ones included (the lag; any thread reads it)
    held: HeldSteps | None = None  # the request being filled (`hold`)
    lock: threading.Lock = field(default_factory=threading.Lock)  # `held`, `queued` and the order of puts
    state: ShadowState = "mirroring"
    positions_compared: int = 0
    max_error: float = 0.0
    task: concurrent.futures.Future[None] | None = None
    replayed: torch.Tensor | None = None  # [B, capacity, H]: the inputs replayed, as the replica's cache holds them
    sent_length: int = 0  # positions [0, sent_length) in the replica's cache
    prompts: torch.Tensor | None = None  # [blocks, B|1, P, H]: the deep prompts in the caches (sent at position 0)

    def hold(
        self,
        inputs: torch.Tensor,
        outputs: torch.Tensor,
        first: int,
        hypo_ids: torch.Tensor | None,
        prompts: torch.Tensor | None,
    ) -> None:
        """Takes a mirrored step (its inputs and the server's outputs [B, T, H] for positions [first, first + T)) into
        the request being filled, which goes to the worker once it holds `SHADOW_BATCH_ROWS` rows; a step that does
        not continue it sends it first (a step of that many rows or more then goes as a request of its own)."""
        batch = outputs.shape[0]
        with self.lock:
            self.queued += 1
            held = self.held
            if held is not None and not held.continues(first, batch, hypo_ids, prompts):
                self._send_held()
                held = None
            if held is None:
                held = self.held = HeldSteps(first, hypo_ids, prompts)
            if held.add(inputs, outputs) >= SHADOW_BATCH_ROWS:
                self._send_held()

    def send_held(self) -> None:
        """Sends the request being filled now (any thread)."""
        with self.lock:
            self._send_held()

    def end_queue(self, *, send_held: bool) -> None:
        """Ends the worker's queue after what was put (any thread), the request being filled sent first or dropped."""
        with self.lock:
            if send_held:
                self._send_held()
            self.held = None
            self._put(None)

    def _send_held(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            self._put((held.request(), held.steps))

    def _put(self, item: tuple[Mirrored, int] | None) -> None:
        """Queues `item` for the worker, in order, from any thread (the client loop's own calls included: a
        callback that runs before the loop's next task step, as `settle` expects)."""
        background_loop.get_loop().call_soon_threadsafe(self.queue.put_nowait, item)

    def record(self, step: Mirrored) -> None:
        """Writes the replayed `step`'s inputs as positions [first, first + T) (a rollback overwrites from `first`, a
        beam reorder reorders the rows before it, as the servers' caches; the buffer grows by doubling) and keeps the
        deep prompts in effect (a reorder reorders per-row prompts; a step from position 0 brings them)."""
        if step.hypo_ids is not None and self.prompts is not None and self.prompts.shape[1] > 1:
            self.prompts = self.prompts[:, step.hypo_ids]  # row i now holds row hypo_ids[i]'s prompted states
        if step.first == 0:
            self.prompts = step.prompts
        inputs, buf = step.inputs, self.replayed
        end = step.first + inputs.shape[1]
        if buf is None or buf.shape[1] < end or buf.shape[0] != inputs.shape[0]:
            grown = inputs.new_empty(inputs.shape[0], max(2 * end, SHADOW_CHUNK_TOKENS), inputs.shape[2])
            if buf is not None:
                grown[:, : step.first] = buf[:, : step.first]
            self.replayed = buf = grown
        if step.hypo_ids is not None:
            buf[:, : step.first] = buf[step.hypo_ids, : step.first]  # (the right side is a copy)
        buf[:, step.first : end] = inputs
        self.sent_length = end

    def replayed_inputs(self) -> torch.Tensor:
        """The inputs replayed for positions [0, sent_length) [B, sent_length, H] (a new tensor)."""
        assert self.replayed is not None, "recorded before the comparison"
        return self.replayed[:, : self.sent_length].clone()


class ShadowVerifier:
    """Per inference session. `after_step(span_session, outputs, first)` mirrors a span step to its shadow (drawn at
    the span session's first step); `finish()` lets every shadow catch up and closes it; `findings` lists what was
    caught, `undecided` the disagreements nobody could settle."""

    def __init__(self, manager: RemoteSequenceManager, *, rng: random.Random | None = None):
        self.manager = manager
        self.rng = rng or random.Random()
        self.referees = StretchReferees(manager, rng=self.rng)
        self._drawn: dict[int, tuple[SpanSession, Shadow | None]] = {}  # id(span session) -> (it, its shadow)
        self._lock = threading.Lock()  # draws: a span session's first step, in the caller's thread or on the loop
        self.findings: list[Finding] = []
        self.undecided: list[Finding] = []

    @property
    def fraction(self) -> float:
        return self.manager.config.verify_shadow_fraction

    @property
    def shadows(self) -> list[Shadow]:
        return [shadow for _, shadow in list(self._drawn.values()) if shadow is not None]

    @property
    def num_positions_verified(self) -> int:
        return sum(shadow.positions_compared for shadow in self.shadows)

    def after_step(
        self,
        span_session: SpanSession,
        outputs: torch.Tensor,
        first: int,
        hypo_ids: torch.Tensor | None = None,
        prompts: torch.Tensor | None = None,
    ) -> None:
        """After `span_session`'s server answered positions [first, first + T) with `outputs` [B, T, H], having
        reordered its cache by `hypo_ids` [B] first (beam search; None: no reorder), given the span's deep prompts
        `prompts` [blocks, B|1, P, H] with the request (None or empty: none)."""
        if self.fraction <= 0:
            return
        if prompts is not None and prompts.numel() == 0:
            prompts = None
        drawn = self._drawn.get(id(span_session))  # (a dict's get is atomic: the lock only where it draws)
        if drawn is None:
            with self._lock:
                drawn = self._drawn.get(id(span_session))
                if drawn is None:
                    drawn = self._drawn[id(span_session)] = (span_session, self._draw(span_session, first))
        shadow = drawn[1]
        if shadow is None or shadow.state != "mirroring":
            return
        if prompts is not None and first > 0:
            self._end(shadow, "dropped", "deep prompts after position 0 (placed differently by Petals and corolla)")
            return
        history = span_session.history  # [B, n, H]: what the server's cache holds, these inputs included
        end = first + outputs.shape[1]
        if history is None or history.shape[1] < end:
            self._end(shadow, "dropped", "the span's inputs are not all known")
            return
        if shadow.queued >= MAX_SHADOW_LAG_STEPS:
            self._end(shadow, "dropped", f"the replica is {shadow.queued} steps behind")
            return
        kept_prompts = None if prompts is None else prompts.detach().clone()  # (tuned prompts change as they train)
        shadow.hold(history[:, first:end], outputs.detach(), first, hypo_ids, kept_prompts)  # (copied there)

    def _draw(self, span_session: SpanSession, first: int) -> Shadow | None:
        """A shadow for a span session whose first step sent from position 0 (whole sessions), with probability
        `fraction`, on a random unbanned replica; None otherwise."""
        span = span_session.span
        if first != 0 or not (self.fraction >= 1 or self.rng.random() < self.fraction):
            return None
        replicas = self.referees.replicas(span, {span.peer_id})
        if not replicas:
            logger.info(
                "shadows.no_replica(blocks=%d:%d, server=...%s): the session is not verified",
                span.start, span.end, span.peer_id[-6:],
            )  # fmt: skip
            return None
        replica = replicas[0]
        shadow = Shadow(span, replica, SpanSession(self.manager, replica, span_session.max_length))
        shadow.task = asyncio.run_coroutine_threadsafe(self._run(shadow), background_loop.get_loop())
        return shadow

    def _end(self, shadow: Shadow, state: ShadowState, reason: str) -> None:
        if shadow.state == "mirroring":
            shadow.state = state
            logger.info(
                "shadows.end(blocks=%d:%d, server=...%s, replica=...%s, state=%s): %s", shadow.span.start,
                shadow.span.end, shadow.span.peer_id[-6:], shadow.replica.peer_id[-6:], state, reason,
            )  # fmt: skip
        shadow.end_queue(send_held=False)

    async def _run(self, shadow: Shadow) -> None:
        """The shadow's worker (on the client loop): opens its stream, replays the mirrored requests in order (each
        up to `SHADOW_BATCH_ROWS` rows of consecutive positions: `Shadow.hold`), and compares; a disagreement is
        decided 2:1 and ends it, as does a replica failing (no verdict: a failed referee is not a liar)."""
        queue = shadow.queue
        try:
            await self.open_stream(shadow)
            while True:
                item = await queue.get()
                try:
                    if item is None:
                        break
                    step, steps = item
                    with shadow.lock:
                        shadow.queued -= steps
                    if shadow.state == "mirroring":
                        await self._check(shadow, step, steps)
                finally:
                    queue.task_done()
        except Exception as e:
            if isinstance(e, (AssertionError, asyncio.CancelledError)):
                raise
            self._end(shadow, "failed", f"the replica failed: {e!r}")
        finally:
            if shadow.state == "mirroring":
                shadow.state = "agreed"
            while not queue.empty():  # (nothing waits for what is left)
                queue.get_nowait()
                queue.task_done()
            await self.close_stream(shadow)

    async def _check(self, shadow: Shadow, step: Mirrored, steps: int = 1) -> None:
        """Replays `step` (the request of `steps` mirrored steps) on the shadow's replica and compares its outputs with
        the server's."""
        if step.first > shadow.sent_length:
            raise ConnectionError(f"the shadow lacks positions [{shadow.sent_length}, {step.first})")
        recomputed = await self.replay(shadow, step)
        shadow.record(step)
        agrees, error = self.referees.compare(step.claimed, recomputed, (shadow.span, shadow.replica))
        shadow.positions_compared += step.claimed.shape[1]
        shadow.max_error = max(shadow.max_error, error)
        if not agrees:
            await self._disagreement(shadow, step, recomputed, error)
        elif shadow.replica.peer_id not in self.manager.disputes.co_witnesses(shadow.span.peer_id):
            # its steps verified, each of both: the standing a witness needs (co-witnesses vouch for nothing: 0190)
            for _ in range(steps):
                self.manager.bans.record_verified(shadow.span.peer_id, agreed=True)
                self.manager.bans.record_verified(shadow.replica.peer_id, agreed=True)

    async def open_stream(self, shadow: Shadow) -> None:
        """Opens the shadow's stream to its replica."""
        await shadow.session.open()

    async def close_stream(self, shadow: Shadow) -> None:
        """Ends the shadow's session on its replica (a failed one without waiting for it)."""
        await shadow.session.close(drain=shadow.state == "agreed")

    async def replay(self, shadow: Shadow, step: Mirrored) -> torch.Tensor:
        """The replica's outputs [B, T, H] for the mirrored step, sent in chunks of `SHADOW_CHUNK_TOKENS` (a
        rollback overwrites the shadow's cache from `step.first`, as it did the server's; a beam reorder goes with
        the first chunk, as it went to the server, and so do deep prompts, that chunk then at least their P tokens
        long: a Petals server adds them to its request's first P positions, a corolla server to positions [0, P))."""
        session = shadow.session
        batch, length, _ = step.inputs.shape
        chunk = max(1, SHADOW_CHUNK_TOKENS // batch)
        prompts = NO_PROMPTS if step.prompts is None else step.prompts
        outputs = []
        start = 0
        while start < length:
            first_chunk = start == 0
            end = start + (max(chunk, prompts.shape[2]) if first_chunk and prompts.numel() else chunk)
            position = step.first + start
            extra = {SHADOW_KEY: True} if session.position == 0 and position == 0 else {}
            out, _ = await session.step(
                step.inputs[:, start:end], position, position=position,
                prompts=prompts if first_chunk else NO_PROMPTS,
                hypo_ids=step.hypo_ids if step.hypo_ids is not None and first_chunk else NO_HYPO_IDS,
                step_id=str(uuid.uuid4()), extra=extra,
            )  # fmt: skip
            outputs.append(out)
            start = end
        return torch.cat(outputs, dim=1)

    async def _disagreement(self, shadow: Shadow, step: Mirrored, recomputed: torch.Tensor, error: float) -> None:
        """The replica's answer differs from the server's: a third replica decides on the stretch [0, b)."""
        span = shadow.span
        inputs = shadow.replayed_inputs()  # [B, b, H]: every input replayed, this step's last
        finding = Finding(
            span.peer_id, (span.start, span.end), inputs, step.claimed, step.first, shadow.prompts, max_error=error
        )
        thirds = self.referees.replicas(span, {span.peer_id, shadow.replica.peer_id})
        verdict = await self.referees.decide(span, shadow.replica, recomputed, finding, thirds)
        if verdict == "caught":
            self.findings.append(finding)
            await asyncio.to_thread(self.manager.findings.record_caught, finding)  # (disk: off the client loop)
        elif verdict == "referee_lied":  # the shadow's replica outvoted: its answers are the finding against it
            against = replace(finding, peer_id=shadow.replica.peer_id, claimed=recomputed)
            await asyncio.to_thread(self.manager.findings.record_caught, against)
        elif verdict == "undecided":
            self.undecided.append(finding)
        self._end(shadow, verdict, f"max error {error:.3g}")

    async def settle(self, *, flush: bool = True) -> None:
        """On the client loop: waits until every shadow has replayed every step mirrored so far (benchmarks;
        tests); `flush=False`: every step but those held for the next request (`Shadow.hold`)."""
        shadows = [shadow for shadow in self.shadows if shadow.state == "mirroring"]  # (an ended one takes no more)
        if flush:
            for shadow in shadows:
                shadow.send_held()
        await asyncio.sleep(0)  # requests are put by callbacks queued before this task's next step: they run first
        for shadow in shadows:
            await shadow.queue.join()

    async def finish(self) -> None:
        """Lets every shadow replay what is left, then ends them (waits for their verdicts)."""
        shadows = self.shadows
        for shadow in shadows:
            shadow.end_queue(send_held=shadow.state == "mirroring")
        tasks = [asyncio.wrap_future(s.task) for s in shadows if s.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
