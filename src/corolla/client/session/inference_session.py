"""`InferenceSession`: one inference stream per server span of the chain (`span_session.SpanSession`); keeps every
span's inputs so that when a server fails, a replacement chain for its span replays them and rebuilds the KV cache.
Steps run in the caller's thread when every span is on a local stream, else on the client's background loop, where
failures are retried on replacement chains within a `RetryBudget`. With a `PrefixChain`, a fresh session starts
after the shortest prefix its chain already holds; a span rebuilt without that prefix's inputs restarts the chain."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import torch

from corolla.client import background_loop
from corolla.client.calls.output_checks import BadServerOutput, InputsOutOfRange, OutputsDisputed, comparison_rtol
from corolla.client.calls.remote_forward_backward import NO_HYPO_IDS, span_prompts
from corolla.client.calls.retries import PushedReplyRejected, RetryBudget, has_alternative
from corolla.client.prefix.prefix_chain import PrefixChain, speaks_prefix_keys
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session.delivery import SLOW_RATIO, MovePacer
from corolla.client.session.forwarding import StepForwarding, push_went_stale, refusal_after_push
from corolla.client.session.handoff import HandoffLog, hand_off_draining_spans, needs_handoff
from corolla.client.session.replacement_race import (
    TRIAL_TOKENS,
    RaceEvent,
    RaceLost,
    TrialDisagrees,
    check_trial,
    first_round_width,
    race,
    race_candidates,
    round_s,
    trial_error,
)
from corolla.client.session.shadows import FINISH_TIMEOUT_S, ShadowVerifier
from corolla.client.session.span_session import SpanSession, SpanUnreachable, steps_in_flight
from corolla.client.session.stalls import StallEvent
from corolla.client.session.unheard_pairs import UnheardPair, lost_pair_verdict, names, refute_once, retries_of
from corolla.client.transport.link_probe import LINK_KNOCK_LIMIT_S, wait_until_answering
from corolla.client.verification.pair_referee import referee_pair
from corolla.client.verification.range_dispute import Produced, producer_failure
from corolla.client.verification.step_verifier import StepVerifier
from corolla.client.verification.witnesses import UNCHECKED, WATCH_S, Rechecked, outvote, refuted, trusted
from corolla.protocol.prefix import PREFIX_BLOCK_TOKENS
from corolla.protocol.records import DECODE_MAX_TOKENS, RemoteSpanInfo
from corolla.utils.errors import MissingBlocksError
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

# two racers that agreed with each other against a left server's outputs: their peer ids, their outputs [B, n, H]
OutvotingPair = tuple[list[str], torch.Tensor, Rechecked]  # the pair, its outputs, what an outsider said
# a pair seated in a race: its peer ids, its referees' recheck (asked as it was seated) and that recheck to ask again
SeatedPair = tuple[list[str], asyncio.Future[Rechecked], Callable[[], Awaitable[Rechecked]]]
# judgements of lost race pairs still running when their session closed (`InferenceSession.close`): held until done
_JUDGING_AFTER_CLOSE: set[asyncio.Future[None]] = set()


class InferenceSession:
    """Autoregressive inference over blocks `[start, end)` of the manager's sequence, `max_length` tokens at most.

    Use as a context manager; `step(hidden [B, T, H])` returns the last block's outputs `[B, T, H]`. Setting
    `position` rolls back (the next step overwrites the servers' caches from there). `prefix` (one sequence) keys the
    positions by their token ids (`step(..., token_ids=)`), so that servers can keep and reuse them.
    """

    def __init__(
        self,
        manager: RemoteSequenceManager,
        max_length: int,
        *,
        start: int = 0,
        end: int | None = None,
        prefix: PrefixChain | None = None,
    ):
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.manager, self.max_length = manager, max_length
        self.start, self.end = start, manager.num_blocks if end is None else end
        self._spans: list[SpanSession] = []
        self._position = 0
        self._batch_size: int | None = None  # fixed by the first step (servers allocate caches for it)
        self._zero_prompts: torch.Tensor | None = None  # deep prompts given at position 0, needed for replays
        # the chain's outputs [B, <= TRIAL_TOKENS, H] at its first positions (a race for the last span checks its
        # trials against them: `_race_replacement`); None where not all known (a prefix reused)
        self._first_outputs: torch.Tensor | None = None
        self._closed = False
        self.output_ids: torch.Tensor | None = None  # tokens generated so far (kept by generate())
        self.num_steps_here = 0  # steps run in the caller's thread over socket streams (no client-loop hop)
        # step ids, next_servers; none in a client that verifies (its checks would blame a push's target for it)
        self.forwarding = StepForwarding(
            manager.config.server_forwarding and not manager.config.verifies, manager.push_suspects
        )
        self.num_pushed_steps = 0  # span steps whose server answered the copy pushed by the previous server
        # spans moved off draining servers with their KV cache
        self.handoffs = HandoffLog(manager, max_length, self._new_span_session)
        self.verifier = StepVerifier(manager)  # cross-checks a `verify_fraction` of steps on other servers
        self.shadows = ShadowVerifier(manager)  # mirrors sampled span sessions to replicas (client.session.shadows)
        self.stall_events: list[StallEvent] = []  # silent hops checked, and what was done (client.session.stalls)
        self.race_events: list[RaceEvent] = []  # what its replacement races did (client.session.replacement_race)
        self._judging: set[asyncio.Future[None]] = set()  # judgements of race pairs that lost their round (0238)
        self.pacer = MovePacer()  # its spans' moves for what they deliver, one a period (client.session.delivery)
        self.on_enter: list[Callable[[], None]] = []  # hooks of the module that opened this session
        self.on_exit: list[Callable[[], None]] = []
        self.prefix = prefix  # the token ids of its positions and their chain hashes (None: no prefix keys)
        self.reused_tokens = 0  # leading positions its first step took from the servers' prefix caches
        self.prefix_hits: list[int] = []  # what each server of the first chain held (the probe's answers)
        self.num_restarts = 0  # chain restarts from position 0 (a span rebuilt without a reused prefix's inputs)

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    @property
    def route(self) -> list[tuple[RemoteSpanInfo, str | None]]:
        """The chain in use now: each span's `RemoteSpanInfo` and transport (`local`/`p2p`/None), in block order."""
        return [(s.span, s.transport) for s in list(self._spans)]

    @property
    def position(self) -> int:
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        if not 0 <= value <= self._position:
            raise ValueError(f"can only roll back to a position in [0, {self._position}], got {value}")
        self._position = value

    def step(
        self,
        inputs: torch.Tensor,
        prompts: torch.Tensor | None = None,
        hypo_ids: torch.Tensor | None = None,
        *,
        token_ids: torch.Tensor | None = None,
        may_reuse: bool = False,
    ) -> torch.Tensor:
        """Runs `inputs` [B, T, H] (positions `[position, position + T)`); returns the outputs [B, T, H].

        `token_ids` [1, T] are the ids of these positions (keys for the servers' prefix caches; without them the
        session stops keying). With `may_reuse`, a fresh session's first step skips the prefix its chain already
        holds (`reused_tokens`, whole blocks, at least one position computed): it then returns the outputs of its
        last `T - reused_tokens` positions only."""
        if self._closed:
            raise RuntimeError("inference session is closed")
        if inputs.ndim != 3:
            raise ValueError(f"inputs must be [batch, tokens, hidden], got shape {list(inputs.shape)}")
        batch_size, num_tokens, _ = inputs.shape
        if self._batch_size is not None and batch_size != self._batch_size:
            raise ValueError(f"this session's batch size is {self._batch_size}, got inputs of batch {batch_size}")
        if self._position + num_tokens > self.max_length:
            raise ValueError(
                f"session max_length={self.max_length} exceeded: position {self._position} + {num_tokens} new tokens"
            )
        if prompts is not None and prompts.numel() > 0:
            if prompts.ndim != 4 or prompts.shape[0] != self.num_blocks or prompts.shape[1] not in (1, batch_size):
                raise ValueError(
                    f"deep prompts must be [num_blocks={self.num_blocks}, batch or 1, prefix, hidden], got {list(prompts.shape)}"
                )
            if prompts.shape[2] > num_tokens:
                raise ValueError(f"deep prompt length {prompts.shape[2]} exceeds the {num_tokens} tokens of this step")
            prompts = prompts.detach().cpu()
        else:
            prompts = None
        if hypo_ids is not None:
            if hypo_ids.dtype != torch.int64 or hypo_ids.shape != (batch_size,):
                raise ValueError(f"hypo_ids must be int64 [{batch_size}], got {hypo_ids.dtype} {list(hypo_ids.shape)}")
            hypo_ids = hypo_ids.cpu()
        if self._position == 0:
            self._zero_prompts = prompts
        self._batch_size = batch_size
        cpu_inputs = inputs.detach().cpu()
        chain = self.prefix
        if chain is not None and chain.active:
            if token_ids is None or hypo_ids is not None or batch_size != 1 or token_ids.shape != (1, num_tokens):
                chain.active = False  # keys could no longer name these positions
            else:
                chain.set(self._position, token_ids[0].tolist())
        if may_reuse and self._position == 0 and not self._spans and chain is not None and chain.active:
            prompt_length = 0 if prompts is None else prompts.shape[2]
            reused = background_loop.run(self._open_reusing(cpu_inputs, prompt_length))
            if reused:
                cpu_inputs, prompts, self._position = cpu_inputs[:, reused:], None, reused
        if cpu_inputs.shape[1] > DECODE_MAX_TOKENS and self._spans:  # a new turn's prompt: priced where it goes
            self._judge_long_step(cpu_inputs.shape[1])
        may_verify = prompts is None and self._zero_prompts is None  # (not with deep prompts: see StepVerifier)
        verify = may_verify and self.verifier.sample()
        # a watched server's steps are verified on the client loop, whatever the sample (decision 0190)
        watching = may_verify and self.verifier.watches([s.span.peer_id for s in list(self._spans)])
        with steps_in_flight():
            here = hypo_ids is None and not verify and not watching
            outputs = self._step_here(cpu_inputs, prompts) if here else None
            if outputs is None:
                outputs = background_loop.run(self._step(cpu_inputs, prompts, hypo_ids, verify=verify))
        if needs_handoff(self.handoffs, self._spans):  # a server drains: move its span's cache elsewhere (no replay)
            background_loop.run(hand_off_draining_spans(self.handoffs, self._spans))
        if self._position < TRIAL_TOKENS:
            self._keep_first_outputs(outputs)
        self._position += cpu_inputs.shape[1]
        return outputs.to(inputs.device)

    def _judge_long_step(self, num_tokens: int) -> None:
        """Before a long step of `num_tokens` (a new turn's prompt) on the chain in use: a span whose server this
        client saw crawl on long steps is left for a chain that runs the step and the session's rest faster, replay
        included (`SpanSession.judge_delivery`, decision 0193); at most one move (the session's pacer)."""
        now_s = time.monotonic()
        for span_session in list(self._spans):
            if span_session.judge_delivery(now_s, num_tokens):
                return

    def _keep_first_outputs(self, outputs: torch.Tensor) -> None:
        """Keeps the chain's `outputs` [B, T, H] of the step at `_position` (< `TRIAL_TOKENS`) among its first
        outputs, after the earlier ones (a rollback's later ones dropped)."""
        start, kept = self._position, self._first_outputs
        new = outputs[:, : TRIAL_TOKENS - start].clone()  # (not a view: a prompt's whole outputs would stay alive)
        if start == 0:
            self._first_outputs = new
        elif kept is not None and kept.shape[1] >= start:  # (its rows were reordered as the step began: `_step`)
            self._first_outputs = torch.cat([kept[:, :start], new], dim=1)
        else:
            self._first_outputs = None

    async def _open_reusing(self, inputs: torch.Tensor, prompt_length: int) -> int:
        """Opens the chain (preferring the one that held this prefix last time: `client.prefix.prefix_chain`) and asks its
        servers which prefix of `inputs`' positions they hold; every span then starts at the shortest hit, which
        this returns (0 when a server does not take prefix keys, or when anything fails: the step then runs as
        without a cache, on the usual retry path)."""
        chain = self.prefix
        assert chain is not None
        routes, new_tokens = self.manager.prefix_routes, self.max_length - len(chain)
        # priced as new routes are: a server seen slower than it announces costs what it delivered (decisions 0189,
        # 0218: on long steps too, the prompt being one)
        view = self.manager.observed_steps.priced(self.manager.spans, time.monotonic(), inputs.shape[1])
        route = routes.route_for(view, chain, self.start, self.end, new_tokens=new_tokens)
        if route is not None:  # planned here, not by make_sequence: still this client's load on those servers
            self.manager.note_routed(route)
        try:
            await self._replace_spans(0, self.start, None, route=route, step_tokens=inputs.shape[1])
            spans = list(self._spans)
            if not spans or not all(speaks_prefix_keys(s.span.server_info) for s in spans):
                return 0
            if inputs.shape[1] - 1 < PREFIX_BLOCK_TOKENS:
                return 0  # no whole block to ask about
            # one round trip for the chain: every server is probed at once
            hits = list(await asyncio.gather(*(s.probe(inputs.shape[1] - 1, inputs) for s in spans)))
        except Exception as e:
            if isinstance(e, (AssertionError, asyncio.CancelledError)):
                raise
            logger.info("inference_session.prefix_probe_failed(error=%r): opening the chain as without a cache", e)
            await asyncio.gather(*(s.close(drain=False) for s in self._spans), return_exceptions=True)
            self._spans = []
            return 0
        reused = min(hits)
        if reused < prompt_length:  # deep prompts go with position 0: all of them or none
            reused = 0
        for index, span_session in enumerate(spans):
            span_session.reuse(reused, inputs[:, :reused] if index == 0 else None)  # the embeddings: a restart's source
        self.reused_tokens, self.prefix_hits = reused, hits
        logger.debug("inference_session.prefix_reused(tokens=%d, hits=%s)", reused, hits)
        return reused

    def _restart_before(self, index: int) -> None:
        """Spans `[0, index)` send from position 0 again, so that span `index` gets every input it lacks."""
        if not self._spans or self._spans[0].history is None:
            raise AssertionError("the chain's first span always holds its inputs (the embeddings): cannot restart")
        for earlier in self._spans[:index]:
            earlier.position = 0
        self.num_restarts += 1
        logger.info("inference_session.restart(before_span=%d): rebuilding a reused prefix's inputs", index)

    def _step_here(self, inputs: torch.Tensor, prompts: torch.Tensor | None) -> torch.Tensor | None:
        """The step in this thread when every span of the chain is on a socket stream (the local socket, or p2p
        where servers could not push to each other anyway: one span, or no forwarding): no hop to the
        client loop and back, each an idle thread's wake-up. None when not possible or when a span fails: then the
        async path runs the step (spans already stepped are re-sent from the same position, which the servers
        overwrite; the failed span's stream is closed, so it is replaced and replayed)."""
        spans = self._spans
        if not spans or spans[0].span.start != self.start or spans[-1].span.end != self.end:
            return None
        if len(spans) > 1 and self.forwarding.enabled and any(s.local is None for s in spans):
            return None  # over p2p, pushes between servers save more than the hop (see client.session.forwarding)
        if any(a.span.end != b.span.start for a, b in zip(spans[:-1], spans[1:], strict=True)) or not all(
            s.can_step_here() for s in spans
        ):
            return None
        position, step_id = self._position, self.forwarding.take_step_id()
        hidden, hidden_from = inputs, position
        for span_index, span_session in enumerate(spans):
            if span_session.lacks_inputs(min(span_session.position, position), hidden_from):
                return None  # the async path restarts the chain
            span_prompts = self._prompts_for(span_session, prompts, position)
            try:
                hidden, hidden_from = span_session.step_here(
                    hidden,
                    hidden_from,
                    position=position,
                    prompts=span_prompts,
                    hypo_ids=NO_HYPO_IDS,
                    step_id=step_id,
                    extra=self.forwarding.request_extra(spans, span_index, position, step_id, allowed=False),
                )
            except Exception as e:
                logger.info(
                    "inference_session.local_step_failed(peer=...%s, error=%r): retrying through the client loop",
                    span_session.span.peer_id[-6:],
                    e,
                )
                return None
            self.manager.on_request_success(span_session.span.peer_id)
            if span_session.last_outputs is not None:
                self.shadows.after_step(span_session, span_session.last_outputs, hidden_from, prompts=span_prompts)
        self.num_steps_here += 1
        return hidden[:, position - hidden_from :]

    async def _step(
        self, inputs: torch.Tensor, prompts: torch.Tensor | None, hypo_ids: torch.Tensor | None, *, verify: bool = False
    ) -> torch.Tensor:
        position, step_id = self._position, self.forwarding.take_step_id()
        # a watched server's steps are verified whatever the sample (decision 0190); not with deep prompts (as `verify`)
        may_verify = prompts is None and self._zero_prompts is None
        may_forward = may_verify and hypo_ids is None  # see client.session.forwarding
        if hypo_ids is not None:
            for reordered in self._spans:
                reordered.reorder(hypo_ids)
            if self._first_outputs is not None:  # a race's reference for the last span: rows as the spans' now
                self._first_outputs = self._first_outputs[hypo_ids]
        hidden, hidden_from = inputs, position  # `hidden` holds the inputs of block `block` from `hidden_from` on
        # each span's inputs of this step by its index (`hidden`, `hidden_from`), to step it again where its outputs
        # are disputed (decision 0186): the spans before `index` that answered since the step (re)started
        step_inputs: dict[int, tuple[torch.Tensor, int]] = {}
        block, index, budget = self.start, 0, RetryBudget(self.manager)
        pending_replacement: SpanSession | None = None
        # won a race on the span's first positions and not yet answered the rest: if it stalls there, the next race
        # sends every racer the trial's positions, then the rest of the step (decisions 0176, 0184)
        trial_winner: SpanSession | None = None
        while block < self.end:
            span_session = self._spans[index] if index < len(self._spans) else None
            if span_session is not None and hidden_from > 0 and index > 0:
                replacing = span_session is pending_replacement
                if (replacing and span_session.history is None) or (
                    not replacing and span_session.lacks_inputs(min(span_session.position, position), hidden_from)
                ):
                    self._restart_before(index)  # then this span gets inputs from position 0
                    # a new step id: a server that answered this step before takes the same id for a re-send of it
                    # and would answer its old reply (the restart sends from position 0 instead)
                    step_id = self.forwarding.take_step_id()
                    block, index, hidden, hidden_from = self.start, 0, inputs, position
                    step_inputs.clear()
                    continue
            try:
                if span_session is None or span_session is pending_replacement:
                    # moved off a loris (decision 0163): raced among the span's servers, unless fewer than two hold it
                    # or it was left for a chain of several servers (judged by delivery, decision 0193)
                    move_to = None if span_session is None else span_session.move_to
                    if span_session is not None and span_session.too_slow and (move_to is None or len(move_to) == 1):
                        whole = span_session is trial_winner
                        raced = await self._race_replacement(index, span_session, budget, hidden, hidden_from, whole)
                        if raced is not None:
                            pending_replacement = None
                            if raced is True:  # won on a trial: its next step sends the rest
                                trial_winner = self._spans[index]
                            else:  # won on the whole step: verified as any step (a failure is the winner's own)
                                span_session = self._spans[index]
                                if verify or (may_verify and self.verifier.watches([span_session.span.peer_id])):
                                    await self._verify_last_step(span_session)
                                budget.on_success()
                                step_inputs[index], (hidden, hidden_from) = (hidden, hidden_from), raced
                                block, index = span_session.span.end, index + 1
                            continue
                    waited_s = 0.0 if budget.failing_since_s is None else time.monotonic() - budget.failing_since_s
                    route = None
                    if span_session is not None and span_session.move_to is not None:  # the chain judged faster
                        route, span_session.move_to = list(span_session.move_to), None  # (once: a failure replans)
                        self.manager.note_routed(route)
                    # (the new chain's first step: the history's positions replayed, then this step's)
                    await self._replace_spans(
                        index, block, span_session, route=route, waited_s=waited_s,
                        step_tokens=position + inputs.shape[1],
                    )  # fmt: skip
                    pending_replacement = None
                    continue
                span = span_session.span
                if span_session.too_slow:  # `step_here` moved off it (client.session.stalls): replaced, not blamed
                    pending_replacement = span_session
                    continue
                if push_went_stale(span_session, step_id, position):  # its stream may hold another answer: reopen
                    logger.info("inference_session.stale_push(blocks=%d:%d): reopening the span", span.start, span.end)
                    span_session.expected_push = None
                    pending_replacement = span_session
                    continue
                span_prompts = self._prompts_for(span_session, prompts, position)
                outputs, outputs_from = await span_session.step(
                    hidden,
                    hidden_from,
                    position=position,
                    prompts=span_prompts,
                    # (a trial's winner was sent the history as reordered: its cache has this step's rows already)
                    hypo_ids=hypo_ids if hypo_ids is not None and span_session is not trial_winner else NO_HYPO_IDS,
                    step_id=step_id,
                    extra=self.forwarding.request_extra(self._spans, index, position, step_id, allowed=may_forward),
                )
                self.num_pushed_steps += span_session.last_reply_pushed
                if span_session.last_outputs is not None:
                    self.shadows.after_step(
                        span_session, span_session.last_outputs, outputs_from, hypo_ids, span_prompts
                    )
                if verify or (may_verify and self.verifier.watches([span.peer_id])):
                    await self._verify_last_step(span_session)
                self.manager.on_request_success(span.peer_id)
                budget.on_success()
                if span_session is trial_winner:  # it answered the rest: a later stall races the trial again
                    trial_winner = None
                step_inputs[index], (hidden, hidden_from) = (hidden, hidden_from), (outputs, outputs_from)
                block, index = span.end, index + 1
            except Exception as e:
                if isinstance(e, (AssertionError, asyncio.CancelledError)):
                    raise
                replacing = span_session is None or span_session is pending_replacement
                failed = span_session.span.peer_id if span_session is not None and not replacing else None
                if isinstance(e, SpanUnreachable):
                    failed = e.peer_id
                if (
                    isinstance(e, InputsOutOfRange)
                    and failed == e.peer_id
                    and index - 1 in step_inputs
                    and hypo_ids is None
                    and (producer := await self._judge_upstream(index, step_inputs, e)) is not None
                ):  # an upstream's values, disputed: it fails in place of the float16 server
                    index, e = producer
                    span_session = self._spans[index]
                    failed, block = span_session.span.peer_id, span_session.span.start
                    hidden, hidden_from = step_inputs[index]
                    for dropped in [i for i in step_inputs if i >= index]:
                        del step_inputs[dropped]
                if failed is not None and span_session is not None and (pushed := refusal_after_push(span_session, e)):
                    e = pushed  # a stock server's refusal after pushes into it: maybe a push's doing, not its own
                if isinstance(e, PushedReplyRejected) and e.upstream is not None:  # the push or its target lied
                    suspended_s = self.manager.push_suspects.rejected(e.upstream, e.peer_id)
                    logger.info(
                        "inference_session.push_suspended(upstream=...%s, target=...%s, pair_s=%.0f)",
                        e.upstream[-6:], e.peer_id[-6:], suspended_s,
                    )  # fmt: skip
                if isinstance(e, BadServerOutput) and e.taints_history:
                    for later in self._spans[index + 1 :]:  # they may hold states built from its earlier lies
                        later.position = 0
                blocks = (block, span_session.span.end if span_session is not None else self.end)
                logger.warning("inference_session.span_failed(blocks=%d:%d, peer=...%s, error=%r)", *blocks,
                               (failed or "?")[-6:], e)  # fmt: skip
                delay_s = await asyncio.to_thread(budget.on_failure, e, failed, blocks)
                sole = span_session if span_session is not None and failed == span_session.span.peer_id else None
                if sole is not None and budget.kept_sole_server and sole.link_address is not None:
                    # the only server's link failed: dial it through p2pd again only once its listener answers, so
                    # that no dial fails near the end of the outage and libp2p's back-off never delays the return;
                    # re-plan at once if another server comes to cover the span (the view is re-read meanwhile)
                    limit_s = LINK_KNOCK_LIMIT_S if budget.left_s is None else budget.left_s
                    replica_appeared = functools.partial(has_alternative, self.manager, sole.span.peer_id, blocks)
                    with self.manager.link_down(sole.span.peer_id):
                        link = await wait_until_answering(sole.link_address, limit_s, replica_appeared)
                    delay_s = delay_s if link in ("up", "refused") else 0.0  # (up, refused: no outage, the usual pace)
                await asyncio.sleep(delay_s)
                pending_replacement = span_session  # replaced (and its history replayed) on the next iteration
        assert hidden_from <= position, "the last span always covers the new tokens"
        return hidden[:, position - hidden_from :]

    async def _judge_upstream(
        self, index: int, step_inputs: dict[int, tuple[torch.Tensor, int]], refused: InputsOutOfRange
    ) -> tuple[int, ConnectionError] | None:
        """Span `index`'s float16 server cannot hold the outputs of the span before it (`refused`, nothing sent):
        None where they are the model's own (a replica agrees with it, and with each span before it whose outputs
        were its inputs, as far as this step's spans go: `step_inputs`) or nothing can tell, so the float16 server is
        routed around (decision 0170); else (the index of the span a replica disputed, its failure in the float16
        server's place: `range_dispute.producer_failure`), and the spans after it replay from position 0: they may
        hold states built from its earlier outputs (decision 0186)."""
        zero = self._zero_prompts  # [blocks, B|1, P, H] of the whole chain, or None
        producers = []
        for before in range(index - 1, -1, -1):
            upstream = self._spans[before]
            if before not in step_inputs or upstream.history is None or upstream.last_outputs is None:
                break
            span = upstream.span
            prompts = None if zero is None else zero[span.start - self.start : span.end - self.start]
            producers.append(Produced(span, upstream.history, upstream.last_outputs, prompts))
        found = await producer_failure(self.manager, producers, refused)
        if found is None:
            return None
        disputed = index - 1 - found[0]
        for later in self._spans[disputed + 1 :]:
            later.position = 0
        return disputed, found[1]

    async def _race_replacement(
        self,
        index: int,
        failed: SpanSession,
        budget: RetryBudget,
        hidden: torch.Tensor,
        hidden_from: int,
        whole: bool,
    ) -> tuple[torch.Tensor, int] | Literal[True] | None:
        """Replaces `failed` (left for slowness) by the winner of a race among the servers that hold its blocks alone
        (`client.session.replacement_race`). Each is sent the span's first positions (of its history, then of this
        step's `hidden` [B, *, H], the span's inputs from `hidden_from`; all of the deep prompts' positions at least,
        sent with them; beams: the history as this step reordered it, no hypo ids: decision 0185) and the first to
        answer with outputs that agree with the span's earlier ones (the next span's inputs there, where it has them:
        `check_trial`), or two that agree with each other and not with those (the left server outvoted: decision
        0183), takes the session (True: its next step sends the rest); or, `whole` (`failed` won such a trial, then
        stalled on the rest: decisions 0176, 0184), each is sent the trial, then the rest of the history and this
        step's positions (a long step, judged as one; every position of its history checked as the trial's are,
        unless a pair outvoted the left server), the first to answer both wins, and its outputs are returned
        ([B, position + T, H], their first position 0; the caller verifies them as any sampled step). None where
        fewer than two such servers are in the view or the span's history is not all known (nothing raced), or where
        every racer failed and some disagreed (not blamed: the usual replacement follows); RaceLost where every racer
        failed otherwise (each blamed, banned or avoided as its failure called for)."""
        blocks = (failed.span.start, failed.span.end)
        history = failed.history if self._position > 0 else hidden[:, :0]
        if history is None or history.shape[1] < self._position:
            return None
        # (a span left for what it delivers on decode steps: no racer this client saw deliver no better than a move
        # there needed, decision 0201)
        verdict = next((e for e in reversed(self.stall_events) if e.peer_id == failed.span.peer_id), None)
        slower_than_s = None
        if failed.move_to is not None and verdict is not None and verdict.action == "outpaced":
            slower_than_s = verdict.detected_after_s / SLOW_RATIO if verdict.num_tokens <= DECODE_MAX_TOKENS else None
        candidates = race_candidates(self.manager, failed.span.peer_id, blocks, self.manager.rng, slower_than_s)
        if len(candidates) < 2:
            return None
        await failed.close(drain=False)
        history = history[:, : self._position].clone()  # [B, position, H]
        new = hidden[:, self._position - hidden_from :]  # [B, T, H]: this step's positions
        # deep prompts go with position 0 (a replay's request), and a trial holds them all (a step's first positions)
        prompts = self._prompts_for(failed, None, 0)  # [blocks, B or 1, P, H] or NO_PROMPTS
        trial_tokens = max(TRIAL_TOKENS, prompts.shape[2] if prompts.ndim == 4 else 0)
        first = torch.cat([history[:, :trial_tokens], new[:, : max(0, trial_tokens - history.shape[1])]], dim=1)
        # a whole step's inputs [B, position + T, H], one tensor for every racer: a racer holds no copy of the
        # history until it answered (up to `RACE_MAX` racers are started while none answers)
        whole_inputs = torch.cat([history, new], dim=1) if whole else None
        upstream = self._spans[index - 1].span.peer_id if index > 0 else None
        step_id = self.forwarding.take_step_id()
        # the span's outputs for the positions a racer answers before this step's (the trial's, or the whole history):
        # as the next span was sent them, or the chain's first ones for the last span. A whole step's are all checked
        # (free: the client holds them): a racer that computed the trial's positions only, and made the rest up,
        # would win the race on the whole step by its speed alone
        following = self._spans[index + 1].history if index + 1 < len(self._spans) else self._first_outputs
        # (not past this step's position: after a rollback the kept outputs there are the taken-back ones)
        known = self._position if whole else min(self._position, first.shape[1])
        expected = None if following is None else following[:, : min(known, following.shape[1])]
        disagreed: list[str] = []
        # racers whose trial disagreed with `expected`: (racer, its outputs there, their wire dtype); two of them that
        # agree with each other outvote the left server (decision 0183)
        dissent: list[tuple[SpanSession, torch.Tensor, torch.dtype]] = []
        pair_wait_s = round_s(first.nbytes)
        trial_s: dict[SpanSession, float] = {}  # each racer's trial step (a row's), once it answered
        failures: list[str] = []  # racers that failed so far (any way)
        a_racer_failed = asyncio.Event()
        # pairs seated and not judged yet (by the racer that seated each): the pair, its referees' recheck
        seated: dict[SpanSession, SeatedPair] = {}

        async def trial(racer: SpanSession) -> tuple[torch.Tensor, int, OutvotingPair | None]:
            await racer.open()
            racer.upstream_peer = upstream
            # a fresh session's first step, the trial's positions (beams: the history was reordered as the step
            # began, so a fresh cache needs no hypo ids)
            outputs, outputs_from = await racer.step(
                first, 0, position=0, prompts=prompts, hypo_ids=NO_HYPO_IDS, step_id=step_id
            )
            # (the server's time, as its later steps are timed: the client's own pauses are not, decision 0233)
            trial_s[racer] = racer.last_step_s / first.shape[0]
            pair: OutvotingPair | None = None
            rtol = 0.0
            if expected is not None:
                # the tolerance of the dtypes the two servers sent in (the client's copies are cast to its own: a
                # float32 client's would hold bfloat16 servers to float32's rounding)
                sent = (racer.last_outputs if racer.last_outputs is not None else outputs).dtype
                earlier = failed.last_outputs.dtype if failed.last_outputs is not None else expected.dtype
                rtol = comparison_rtol(self.manager.config.verify_rtol, (racer.span, failed.span), sent, earlier)
                mine = outputs[:, : min(first.shape[1], expected.shape[1])]
                try:
                    check_trial(racer.span.peer_id, mine, expected[:, : mine.shape[1]], rtol)
                except TrialDisagrees as disagrees:
                    pair = await second_of_a_pair(racer, mine, sent, disagrees)
            if whole_inputs is not None and first.shape[1] < whole_inputs.shape[1]:
                # the rest: a long step, held by a loris that answers only short ones (the trial), as the trial is by
                # one that answers only long ones; from the trial's end (not 0 where the step is the prompt's)
                rest_from = max(self._position, first.shape[1])
                rest, rest_start = await racer.step(
                    whole_inputs, 0, position=rest_from, prompts=self._prompts_for(racer, None, rest_from),
                    hypo_ids=NO_HYPO_IDS, step_id=self.forwarding.take_step_id(),
                )  # fmt: skip
                assert rest_start == outputs.shape[1], "the rest follows the trial"
                outputs, outputs_from = torch.cat([outputs, rest], dim=1), 0  # [B, position + T, H]
                if expected is not None and pair is None:  # (an outvoted server's outputs are only its word)
                    check_trial(racer.span.peer_id, outputs, expected, rtol)
            return outputs, outputs_from, pair

        async def second_of_a_pair(
            racer: SpanSession, mine: torch.Tensor, sent: torch.dtype, disagrees: TrialDisagrees
        ) -> OutvotingPair:
            """Raises `disagrees` unless `racer`'s outputs agree with an earlier dissenter's; then waits a round at
            most, while other racers may still answer (one agreeing with the left server's outputs would win: they
            break the tie), and returns the pair (the left server outvoted 2:1 if `racer` wins)."""
            for other, theirs, their_dtype in dissent:
                rtol = comparison_rtol(self.manager.config.verify_rtol, (racer.span, other.span), sent, their_dtype)
                if trial_error(mine, theirs) <= rtol:
                    pair = [other.span.peer_id, racer.span.peer_id]
                    self.race_events.append(RaceEvent(blocks, "seated", tuple(pair)))
                    # a pair short of standing may be one attacker's identities: its outputs rebuild the session only
                    # where every server outside it that answered confirms them (decision 0190 "Attacked", 0220: the
                    # attacker's third identity may be one of them); one with standing bans only so too (its standing
                    # is not lent to a fresh partner: decision 0208). Asked as it is seated, not after its round: a
                    # pair that loses the round is judged too (decision 0238, `_judge_lost_pairs`)
                    referees = None
                    if self.manager.config.witness_standing_steps > 0:  # (0: main's rule, every racer trusted)
                        exclude = {failed.span.peer_id, *pair}
                        # (kept to be asked again where the pair loses its round unheard: decision 0253)
                        ask = functools.partial(
                            referee_pair, self.manager, racer.span, first, prompts, mine, exclude, self.manager.rng
                        )
                        referees = asyncio.ensure_future(ask())
                        seated[racer] = (pair, referees, ask)
                    try:  # a round, while any other racer may still answer
                        until = asyncio.get_running_loop().time() + pair_wait_s
                        while len(failures) < len(racers) - 1:
                            left_s = until - asyncio.get_running_loop().time()
                            if left_s <= 0:
                                break
                            a_racer_failed.clear()
                            with contextlib.suppress(asyncio.TimeoutError):
                                await asyncio.wait_for(a_racer_failed.wait(), left_s)
                        # (shielded: where another racer wins meanwhile, the referees still judge the pair)
                        rechecked = UNCHECKED if referees is None else await asyncio.shield(referees)
                    except asyncio.CancelledError:  # the earlier outputs won: its trial proved nothing either
                        self.manager.unprove(racer.span.peer_id)
                        raise
                    seated.pop(racer, None)
                    self.race_events.append(RaceEvent(blocks, "judged", tuple(pair), rechecked.verdict))
                    if rechecked.verdict in ("refuted", "split"):  # never banned: outside identities' word against two
                        for peer in pair:
                            self.manager.unprove(peer)
                            # (split: a referee sided with the pair, which is not avoided)
                            if rechecked.verdict == "refuted":
                                refuted(self.manager, peer)  # standing lost (0208), avoided longer each time (0225)
                        raise OutputsDisputed(
                            racer.span.peer_id,
                            f"its trial at blocks {racer.span.start}:{racer.span.end}, positions 0:{mine.shape[1]}, "
                            f"agrees only with ...{other.span.peer_id[-6:]}'s, not with every outside referee's "
                            f"({rechecked.verdict})",
                        )
                    return pair, mine, rechecked
            dissent.append((racer, mine, sent))
            raise disagrees

        async def lost(racer: SpanSession, error: Exception) -> None:
            failures.append(racer.span.peer_id)
            a_racer_failed.set()
            if isinstance(error, TrialDisagrees):  # not blamed, and not seen on time either (it answered too soon)
                disagreed.append(racer.span.peer_id)
                self.manager.unprove(racer.span.peer_id)
                return
            await asyncio.to_thread(budget.on_failure, error, racer.span.peer_id, blocks)

        racers = [self._new_span_session(span) for span in candidates]
        # (after a move for delivery, the servers this client measured delivering what the move needs race a round
        # alone: a fresh identity answers a trial at once and crawls after, decision 0214)
        first_width = first_round_width(self.manager, candidates, slower_than_s)
        try:
            winner, (outputs, outputs_from, pair) = await race(
                racers, trial, lost, round_s=round_s(first.nbytes if whole_inputs is None else whole_inputs.nbytes),
                first_width=first_width,
            )  # fmt: skip
        except BaseException as e:
            for _, referees, _ in seated.values():  # no racer won: nothing to judge a pair against
                referees.cancel()
            if not isinstance(e, RaceLost) or not disagreed:
                raise
            logger.warning(
                "inference_session.race_disagreed(blocks=%d:%d, disagreed=%d of %d): replaced the usual way",
                *blocks, len(disagreed), len(racers),
            )  # fmt: skip
            return None
        if seated and pair is None:  # the winner's trial agreed with the left server's outputs: the pairs lost to it
            judging = asyncio.ensure_future(
                self._judge_lost_pairs(blocks, failed.span.peer_id, winner.span.peer_id, list(seated.values()))
            )
            self._judging.add(judging)
            judging.add_done_callback(self._judging.discard)
            judging.add_done_callback(_JUDGING_AFTER_CLOSE.discard)
        else:  # (another pair won: its own referees judged the same outputs)
            for _, referees, _ in seated.values():
                referees.cancel()
        if not whole and history.shape[1] > first.shape[1]:  # the trial wrote its positions; the next step sends
            winner.history = history  # the rest (from the history's end)
        self._spans[index] = winner
        self.race_events.append(RaceEvent(blocks, "won", (winner.span.peer_id,)))
        self._link_upstream(index, 1)
        # (its figure was taken without this session: other sessions judging their spans wait for a new one; the
        # delivery verdict marked the server it expected to win, which the race may not have picked, decision 0189)
        self.manager.observed_steps.moving_to(winner.span.peer_id, time.monotonic())
        if failed.move_to is not None:  # a move for delivery: what the winner showed is its promise too (0214)
            self.pacer.promised(blocks, trial_s[winner])
        if pair is not None:
            self._outvoted(index, failed.span, *pair)
        self.manager.note_routed([winner.span])
        self.manager.on_request_success(winner.span.peer_id)
        if winner.last_outputs is not None:
            self.shadows.after_step(winner, winner.last_outputs, 0)
        logger.info(
            "inference_session.race_won(blocks=%d:%d, peer=...%s, candidates=%d, %s_tokens=%d)",
            *blocks, winner.span.peer_id[-6:], len(racers), "whole" if whole else "trial", winner.position,
        )  # fmt: skip
        return (outputs, outputs_from) if whole else True

    async def _judge_lost_pairs(
        self,
        blocks: tuple[int, int],
        accused: str,
        winner: str,
        lost_pairs: list[SeatedPair],
    ) -> None:
        """Judges the pairs seated in a race that `winner` won, its trial agreeing with `accused`'s (the left server's)
        earlier outputs (decision 0238), each by its referees' recheck (asked as it was seated) and the winner's trial,
        one more outside server that disagreed: "split" where a referee confirmed the pair (nobody avoided, 0220);
        "refuted" where referees answered and none confirmed it (both lose their standing and are avoided, once each
        however many pairs it was in); "unheard" where none answered (0248): the winner's word alone, maybe the liar's
        second identity's, so nobody is avoided and a pair's own standings are kept, but one lent to a fresh partner is
        spent (held aside: `BanList.spend`) and such a pair watched; the referees of a pair holding a standing are
        then asked again after the race (`unheard_pairs`, 0253). In the background: the session's close waits for it
        as for its shadows, not for the later asks."""
        refuted_peers: set[str] = set()  # (shared with the pairs asked again: a peer refuted once per race)
        retries = retries_of(self.manager)  # (before any wait: taken while the client runs, ended by its shutdown)
        for pair, referees, ask in lost_pairs:
            try:
                rechecked = await referees
            except Exception as e:  # (`recheck` counts a referee's failure as silence: not expected)
                logger.warning("inference_session.lost_pair_unjudged(pair=%s, error=%r)", pair, e)
                continue
            verdict = lost_pair_verdict(rechecked)
            self.race_events.append(RaceEvent(blocks, "judged", tuple(pair), verdict))
            logger.info(
                "inference_session.lost_pair_judged(blocks=%d:%d, pair=%s, winner=...%s, referees=%s): %s",
                *blocks, names(pair), winner[-6:], rechecked.verdict, verdict,
            )  # fmt: skip
            if verdict == "refuted":
                refute_once(self.manager, pair, refuted_peers)
            elif verdict == "unheard":
                standing = [peer for peer in pair if trusted(self.manager, peer)]
                spent: list[tuple[str, int]] = []
                watch = None
                if len(standing) < 2:
                    # one identity's standing lent to a fresh partner: spent, or the liar's pair would lose race after
                    # race for free, its standing kept for the next fresh partner; two of their own keep theirs (an
                    # honest pair framed by the winner's word, 0226's rule: two standings spend nothing). Held aside:
                    # a referee heard later that confirms the pair gives it back (decision 0253)
                    spent = [(peer, self.manager.bans.spend(peer)) for peer in standing]
                    watch = self.manager.disputes.open(accused, pair, WATCH_S)  # their steps verified, nobody avoided
                if standing:  # (a fresh pair's verdict costs it a watch only: no slot of the client's retries)
                    unheard = UnheardPair(
                        blocks, tuple(pair), accused, winner, tuple(spent), watch, ask, self.race_events, refuted_peers
                    )
                    if not retries.start(self.manager, unheard):
                        for peer, spend_id in spent:  # (0248's verdict alone: spent for good)
                            self.manager.bans.forfeit(peer, spend_id)

    async def _verify_last_step(self, span_session: SpanSession) -> None:
        """Has other servers of the span re-run its last step (a sampled step: `StepVerifier`, BadServerOutput for
        its server where they outvote it); a race's winner on the whole step too, whose positions past the trial's
        nothing else checks."""
        if span_session.last_outputs is not None and span_session.history is not None:
            await self.verifier.verify(span_session.span, span_session.history, span_session.last_outputs)

    def _outvoted(
        self, index: int, liar: RemoteSpanInfo, pair: list[str], outputs: torch.Tensor, rechecked: Rechecked
    ) -> None:
        """Two racers for span `index` agreed with each other on its first positions' `outputs` [B, n, H] and not
        with what `liar` gave there before (decision 0183): outvoted 2:1 (`witnesses.outvote`: banned for good where
        a racer has a witness's standing and `rechecked` (`pair_referee`) did not refute the pair, spent by the ban:
        decision 0208; else avoided and the pair watched, its next steps verified: decision 0190; the pair's agreement
        with each other earns it no standing), and what was built from its outputs is
        rebuilt from the pair's: the next span's history there (then every later span sends from position 0), or the
        chain's kept first outputs."""
        where = f"its outputs at blocks {liar.start}:{liar.end}, positions 0:{outputs.shape[1]}, in a race"
        outvote(self.manager, liar.peer_id, pair, where, rechecked=rechecked)
        n = outputs.shape[1]
        if index + 1 < len(self._spans):
            following = self._spans[index + 1]
            history = following.history
            assert history is not None and history.shape[1] >= n, "a trial's reference is the next span's history"
            fixed = history.clone()
            fixed[:, :n] = outputs.to(fixed.dtype)
            following.history = fixed
            for later in self._spans[index + 1 :]:
                later.position = 0
        elif self._first_outputs is not None:
            kept = self._first_outputs
            self._first_outputs = torch.cat([outputs.to(kept.dtype), kept[:, n:]], dim=1)

    def _new_span_session(self, span: RemoteSpanInfo) -> SpanSession:
        """A session for `span` sharing this session's stall events and (where its server takes them) prefix keys."""
        session = SpanSession(self.manager, span, self.max_length)
        session.stall_events, session.pacer = self.stall_events, self.pacer
        if self.prefix is not None and speaks_prefix_keys(span.server_info):
            session.prefix = self.prefix
        return session

    def _link_upstream(self, index: int, count: int) -> None:
        """After `_spans[index : index + count]` were replaced: each span's upstream is the previous span's server."""
        chain = self._spans[max(0, index - 1) : index + count + 1]
        for previous, following in zip(chain, chain[1:], strict=False):
            following.upstream_peer = previous.span.peer_id

    def _prompts_for(self, span_session: SpanSession, prompts: torch.Tensor | None, position: int) -> torch.Tensor:
        """Deep prompts for a span's request of a step at `position`; a request replaying from position 0 (the span's
        cache is behind) needs the prompts of position 0."""
        source = self._zero_prompts if min(span_session.position, position) == 0 else prompts
        return span_prompts(source, self.start, span_session.span)

    async def _replace_spans(
        self,
        index: int,
        block: int,
        failed: SpanSession | None,
        *,
        route: list[RemoteSpanInfo] | None = None,
        waited_s: float = 0.0,
        step_tokens: int = 0,
    ) -> None:
        """Swaps `_spans[index]` (failed or missing) for a fresh chain covering the same blocks (`route`, else one
        planned now, `waited_s` after the step's first failure, for a first step of `step_tokens` positions); the
        first new session inherits the failed one's history so that its first step replays it."""
        end = failed.span.end if failed is not None else self.end
        if failed is not None:
            await failed.close(drain=False)
        try:
            if route is None:
                route = await asyncio.to_thread(
                    self.manager.make_sequence, block, end, mode="min_latency", cache_tokens_needed=self.max_length,
                    waited_s=waited_s, step_tokens=step_tokens,
                )  # fmt: skip
        except MissingBlocksError:
            # its link went down, so the view lost it too (its DHT records are out of reach): while it is not
            # banned (a network failure of the only server), keep trying the server we had
            if failed is None or self.manager.bans.is_banned(failed.span.peer_id) or failed.span.start != block:
                raise
            route = [failed.span]
            logger.info(
                "inference_session.retry_known_server(blocks=%d:%d, peer=...%s): missing from the view",
                block, end, failed.span.peer_id[-6:],
            )  # fmt: skip
        new_sessions: list[SpanSession] = []
        try:
            for span in route:
                new_sessions.append(session := self._new_span_session(span))
                await session.open()
        except BaseException:
            for session in new_sessions:
                await session.close(drain=False)
            if failed is not None:  # keep a placeholder so the retry loop replans this span again
                self._spans[index] = failed
            raise
        if failed is not None and failed.history is not None:
            new_sessions[0].history = failed.history[:, : self._position]
        if failed is not None and failed.too_slow:  # moved off a slow server: where to, as after a race
            for moved_to in new_sessions:
                self.manager.observed_steps.moving_to(moved_to.span.peer_id, time.monotonic())
        self._spans[index : index + 1 if failed is not None else index] = new_sessions
        self._link_upstream(index, len(new_sessions))
        logger.debug(
            "inference_session.route(blocks=%d:%d) %s",
            block, end,
            " => ".join(
                f"{s.span.start}:{s.span.end} via ...{s.span.peer_id[-6:]} ({s.transport})" for s in new_sessions
            ),
        )  # fmt: skip

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def _close_all() -> None:
            await asyncio.gather(*(session.close() for session in self._spans), return_exceptions=True)
            # the shadows catch up and lost race pairs are judged; a server that does not answer in time is not
            # waited for, but a pair's judgement goes on after the session (shielded): cancelled, it would let a
            # lying pair keep the standing it lent by one referee identity held past this wait (hrev18, 0245)
            judging = [asyncio.shield(judgement) for judgement in self._judging]
            try:
                await asyncio.wait_for(asyncio.gather(self.shadows.finish(), *judging), FINISH_TIMEOUT_S)
            except asyncio.TimeoutError:
                _JUDGING_AFTER_CLOSE.update(self._judging)  # (the loop keeps only weak references to tasks)
                logger.info(
                    "inference_session.verification_unfinished(shadows=%d, pairs_judging=%d)",
                    len(self.shadows.shadows), len(self._judging),
                )  # fmt: skip

        if self.prefix is not None and self._spans:  # the next turn of this conversation prefers this chain
            self.manager.prefix_routes.remember(self.prefix, [s.span for s in self._spans], self._position)
        config = self.manager.config
        background_loop.run(_close_all(), timeout_s=config.connect_timeout_s + FINISH_TIMEOUT_S + 5)
        self._spans = []

    def __enter__(self) -> InferenceSession:
        for hook in self.on_enter:
            hook()
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.close()
        finally:
            for hook in self.on_exit:
                hook()
