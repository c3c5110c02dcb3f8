"""Verification on a replica's spare rows (`ShadowVerifier`): a sampled span session is mirrored, as it runs, to a
replica of the span over a second `rpc_inference` stream (a "shadow session": the same span inputs at the same
positions, its first request marked `protocol.shadow.SHADOW_KEY`), and each of the replica's outputs is compared,
position by position within the dtype's tolerance (`output_checks.comparison_rtol`), with what the span's server returned
for it. A corolla replica runs a shadow's steps after every real step it has queued, its single-token rows merged
into the batched forwards it runs for its own sessions (a decode forward reads every weight once whatever its rows;
`server.core.engine_executor`); a stock Petals replica serves it as any session (the key is an unknown metadata
key to it). Each position is recomputed once, against the shadow's own KV cache: linear in the session's length,
not quadratic as recomputing stretches from position 0 was (docs/decisions/0042-shadow-sessions-built.md).

A disagreement is the shadow's replica against the server: `stretches.StretchReferees.decide` asks a third replica
to recompute the stretch [0, b) in one `rpc_forward` and bans whoever is outvoted 2:1 (with no third, nobody: a
lying replica cannot get an honest server banned). The `Finding` of a server caught goes to the client's
`FindingStore` (`RemoteSequenceManager.findings`), for its user to share; one nobody could decide is kept in
`undecided`.

Sampling is by whole span session: a position can be recomputed only with the KV of every position before it, so a
sampled session is mirrored from its position 0 (a span session that starts after a prefix its server reused from
its cache is not mirrored). Beam search's reorders are mirrored with their steps, and so are deep prompts (deep
prompt tuning: the span's slice of `[blocks, B|1, P, H]`, sent with the requests from position 0, in the
`rpc_inference` tensor where Petals takes them); a span session sent deep prompts with a step after position 0 is
no longer mirrored (a Petals server adds a step's prompts to that step's first positions, a corolla server to
positions [0, P): honest servers of both kinds would disagree, and no one-pass `rpc_forward` could decide). A server
corrupting a share q of its steps,
in sessions of L steps each shadowed with probability f, escapes N of its steps with probability about
(1 - f (1 - (1 - q)^L))^(N / L) (`escape_probability`: exact for lengths drawn uniformly from a range); measured
with this class (`python -m benchmarks.field.catch_rate`, 5,000 seeded careers, sessions of 17-257 steps): f = 0.75
catches a 1%-liar within 1,000 of its steps in >= 99% (`DEFAULT_SHADOW_FRACTION`; benchmarks/RESULTS.md). Lower
rates cost fewer rows (0.70: 6.7% fewer) for less margin: over those lengths a 1%-liar escapes with 0.36% at 0.75,
0.64% at 0.70, 1.08% at 0.65 (`escape_probability`), and the measured rate's 95% bound must stay under 1%
(docs/decisions/0062). Longer sessions need more: sessions of 1,000 steps, every one (f > 0.99). The liar cannot tell which
sessions are mirrored: the replica is another server, and the draw is the client's.

Cost to the client: each mirrored step is sent twice (to the server, then in the background to the replica; a token
never waits for its shadow). The replica gets a session's decode positions several at a time: the worker holds the
steps mirrored after the last request it sent until they make `SHADOW_BATCH_ROWS` rows (positions x batch; a beam
reorder, a rollback or the session's end sends what it holds first), then sends them as one request of consecutive
positions, which a corolla replica runs as that many spare rows of one merged decode forward
(`server.core.engine_executor`) and a Petals replica as a short prefill: one request, one reply, one comparison per
`SHADOW_BATCH_ROWS` positions instead of one per position (a replica's host work per shadowed step, not its device's,
was what shadows cost a busy replica: docs/decisions/0066). A lie is then caught up to that many of the session's
steps later, or at its end. A shadow's prefill goes in chunks of `SHADOW_CHUNK_TOKENS`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from corolla.client import background_loop
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
NO_TENSOR, NO_IDS = torch.empty(0), torch.empty(0, dtype=torch.int64)

ShadowState = Literal["mirroring", "agreed", "caught", "referee_lied", "undecided", "failed", "dropped"]


def escape_probability(lie_rate: float, steps: int, session_steps: Sequence[int], fraction: float) -> float:
    """The chance that a server corrupting each of its steps with probability `lie_rate` is not caught within `steps`
    of them when each of its sessions, of a length drawn uniformly from `session_steps`, is mirrored with probability
    `fraction` (exact, by recursion over the steps left; a lie counts as caught at once: the worker's hold for its
    next request is left out). A session of L steps escapes with 1 - f (1 - (1 - q)^L), the last one cut at the
    budget; sessions are independent."""
    keep = 1.0 - lie_rate
    escaped = [1.0] * (steps + 1)  # escaped[n]: the chance of escaping the next n steps, from a session's start
    for n in range(1, steps + 1):
        total = 0.0
        for length in session_steps:
            escaped_session = 1.0 - fraction * (1.0 - keep ** min(length, n))
            total += escaped_session * (escaped[n - length] if length < n else 1.0)
        escaped[n] = total / len(session_steps)
    return escaped[steps]


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


@dataclass(eq=False)
class Shadow:
    """One span session's mirror on `replica`: its own stream (`session`), the steps waiting for it, its state."""

    span: RemoteSpanInfo  # the server under test
    replica: RemoteSpanInfo
    session: SpanSession
    # mirrored steps in order; "flush": send what is held now (`settle`); None: the end (what is held is sent first)
    queue: asyncio.Queue[Mirrored | Literal["flush"] | None] = field(default_factory=asyncio.Queue)
    queued: int = 0  # steps put and not yet taken (the lag; any thread reads it)
    state: ShadowState = "mirroring"
    positions_compared: int = 0
    max_error: float = 0.0
    task: concurrent.futures.Future[None] | None = None
    sent: torch.Tensor | None = None  # [B, capacity, H]: the inputs replayed, positions [0, sent_length)
    sent_length: int = 0
    prompts: torch.Tensor | None = None  # [blocks, B|1, P, H]: the deep prompts in the caches (sent at position 0)

    def record(self, step: Mirrored) -> None:
        """Keeps `step`'s inputs as positions [first, first + T) (a rollback overwrites from `first`; a beam reorder
        reorders the rows before `first`, as the servers' caches, per-row prompts included; a step from position 0
        brings the prompts in effect; the buffer grows by doubling)."""
        end = step.first + step.inputs.shape[1]
        buf = self.sent
        if buf is None or buf.shape[1] < end:
            grown = step.inputs.new_empty(step.inputs.shape[0], max(2 * end, 16), step.inputs.shape[2])
            if buf is not None:
                grown[:, : step.first] = buf[:, : step.first]
            self.sent = buf = grown
        if step.hypo_ids is not None:
            buf[:, : step.first] = buf[step.hypo_ids, : step.first]  # (the right side is a copy)
            if self.prompts is not None and self.prompts.shape[1] > 1:
                self.prompts = self.prompts[:, step.hypo_ids]  # row i now holds row hypo_ids[i]'s prompted states
        if step.first == 0:
            self.prompts = step.prompts
        buf[:, step.first : end] = step.inputs
        self.sent_length = end


class ShadowVerifier:
    """Per inference session. `after_step(span_session, outputs, first)` mirrors a span step to its shadow (drawn at
    the span session's first step); `finish()` lets every shadow catch up and closes it; `findings` lists what was
    caught, `undecided` the disagreements nobody could settle."""

    def __init__(self, manager: RemoteSequenceManager, *, rng: random.Random | None = None):
        self.manager = manager
        self.rng = rng or random.Random()
        self.referees = StretchReferees(manager, rng=self.rng)
        self._drawn: dict[int, tuple[SpanSession, Shadow | None]] = {}  # id(span session) -> (it, its shadow)
        self._lock = threading.Lock()  # steps run in the caller's thread or on the client loop
        self.num_sessions = 0  # span sessions drawn
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
        if history is None or history.shape[1] < first + outputs.shape[1]:
            self._end(shadow, "dropped", "the span's inputs are not all known")
            return
        if shadow.queued >= MAX_SHADOW_LAG_STEPS:
            self._end(shadow, "dropped", f"the replica is {shadow.queued} steps behind")
            return
        inputs = history[:, first : first + outputs.shape[1]].clone()
        kept_prompts = None if prompts is None else prompts.detach().clone()  # (tuned prompts change as they train)
        step = Mirrored(inputs, outputs.detach().clone(), first, hypo_ids, kept_prompts)
        with self._lock:
            shadow.queued += 1
        background_loop.get_loop().call_soon_threadsafe(shadow.queue.put_nowait, step)  # in order, from any thread

    def _draw(self, span_session: SpanSession, first: int) -> Shadow | None:
        """A shadow for a span session whose first step sent from position 0 (whole sessions), with probability
        `fraction`, on a random unbanned replica; None otherwise."""
        self.num_sessions += 1
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
        background_loop.get_loop().call_soon_threadsafe(shadow.queue.put_nowait, None)

    async def _run(self, shadow: Shadow) -> None:
        """The shadow's worker (on the client loop): opens its stream, replays the mirrored steps in order,
        consecutive ones `SHADOW_BATCH_ROWS` rows at a time (module docstring), and compares; a disagreement is
        decided 2:1 and ends it, as does a replica failing (no verdict: a failed referee is not a liar)."""
        queue = shadow.queue
        held: list[Mirrored] = []  # steps of consecutive positions not sent yet
        held_rows = 0
        try:
            await self.open_stream(shadow)
            while True:
                step = await queue.get()
                try:
                    if not isinstance(step, Mirrored):  # the end or a flush: what is held goes now
                        if held and shadow.state == "mirroring":
                            await self._check(shadow, joined(held))
                        held, held_rows = [], 0
                        if step is None:
                            break
                        continue
                    with self._lock:
                        shadow.queued -= 1
                    if shadow.state != "mirroring":
                        continue
                    if held and not continues(held[-1], step):
                        await self._check(shadow, joined(held))
                        held, held_rows = [], 0
                        if shadow.state != "mirroring":
                            continue
                    held.append(step)
                    held_rows += step.inputs.shape[0] * step.inputs.shape[1]
                    if held_rows >= SHADOW_BATCH_ROWS:
                        await self._check(shadow, joined(held))
                        held, held_rows = [], 0
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

    async def _check(self, shadow: Shadow, step: Mirrored) -> None:
        """Replays `step` on the shadow's replica and compares its outputs with the server's."""
        if step.first > shadow.sent_length:
            raise ConnectionError(f"the shadow lacks positions [{shadow.sent_length}, {step.first})")
        recomputed = await self.replay(shadow, step)
        shadow.record(step)
        agrees, error = self.referees.compare(step.claimed, recomputed, (shadow.span, shadow.replica))
        shadow.positions_compared += step.claimed.shape[1]
        shadow.max_error = max(shadow.max_error, error)
        if not agrees:
            await self._disagreement(shadow, step, recomputed, error)

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
        prompts = NO_TENSOR if step.prompts is None else step.prompts
        outputs = []
        start = 0
        while start < length:
            first_chunk = start == 0
            end = start + (max(chunk, prompts.shape[2]) if first_chunk and prompts.numel() else chunk)
            position = step.first + start
            extra = {SHADOW_KEY: True} if session.position == 0 and position == 0 else {}
            out, _ = await session.step(
                step.inputs[:, start:end], position, position=position,
                prompts=prompts if first_chunk else NO_TENSOR,
                hypo_ids=step.hypo_ids if step.hypo_ids is not None and first_chunk else NO_IDS,
                step_id=str(uuid.uuid4()), extra=extra,
            )  # fmt: skip
            outputs.append(out)
            start = end
        return torch.cat(outputs, dim=1)

    async def _disagreement(self, shadow: Shadow, step: Mirrored, recomputed: torch.Tensor, error: float) -> None:
        """The replica's answer differs from the server's: a third replica decides on the stretch [0, b)."""
        assert shadow.sent is not None, "recorded before the comparison"
        span = shadow.span
        inputs = shadow.sent[:, : shadow.sent_length].clone()  # [B, b, H]: every input replayed, this step's last
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
        tests); `flush=False`: every step but those it holds for its next request (`SHADOW_BATCH_ROWS`)."""
        await asyncio.sleep(0)  # steps mirrored from this loop are put by callbacks that run first
        for shadow in self.shadows:
            if shadow.state == "mirroring":  # (an ended shadow's worker takes nothing more)
                if flush:
                    shadow.queue.put_nowait("flush")
                await shadow.queue.join()

    async def finish(self) -> None:
        """Lets every shadow replay what is left, then ends them (waits for their verdicts)."""
        shadows = self.shadows
        for shadow in shadows:
            background_loop.get_loop().call_soon_threadsafe(shadow.queue.put_nowait, None)
        tasks = [asyncio.wrap_future(s.task) for s in shadows if s.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def continues(last: Mirrored, step: Mirrored) -> bool:
    """Whether `step` may go in one request with `last` and the steps held before it: the next positions of the
    same rows, with no beam reorder (applied before its first position) and no deep prompts."""
    return (
        step.first == last.first + last.inputs.shape[1]
        and step.hypo_ids is None
        and step.prompts is None
        and step.inputs.shape[0] == last.inputs.shape[0]
    )


def joined(steps: list[Mirrored]) -> Mirrored:
    """Held steps of consecutive positions (`continues`) as one: [B, sum T, H], the first one's reorder and prompts."""
    if len(steps) == 1:
        return steps[0]
    first = steps[0]
    inputs = torch.cat([step.inputs for step in steps], dim=1)
    claimed = torch.cat([step.claimed for step in steps], dim=1)
    return Mirrored(inputs, claimed, first.first, first.hypo_ids, first.prompts)
