"""The replacement of a span moved off a server too slow to keep it (a loris: it answers pings and holds steps;
`client.session.stalls`, decision 0144) is raced, not planned by announced figures, which cost nothing (0163).

Racers: the servers covering the span alone, not banned or avoided, at most `RACE_MAX` (`race_candidates`): after a
move for delivery, those measured delivering what the move needs first, racing a round alone (0214); then those seen
answering a step on time; then the rest, each group shuffled. `RACE_WIDTH` start, `RACE_WIDTH` more every `round_s`
while none answered; each gets a fresh session whose first step replays the span's first `TRIAL_TOKENS` positions
under a step's usual rules (deadline, pings, late budget), and the first to answer keeps the session and is sent the
rest.

A trial must agree with the span's earlier outputs where the client holds them (`check_trial`), or a loris answering
made-up outputs at once would win. Two racers agreeing with each other and not with those outvote the left server
(0183), unless a racer agreeing with the earlier outputs answers within a round, and only where the servers outside
the pair, asked as it is seated, confirm its trial (`verification.pair_referee`; 0190, 0208). A pair that loses its
round is judged all the same (0238: refuted, split, or "unheard" where no referee answered, 0248), and an unheard
pair's referees are asked again after the race (`unheard_pairs`, 0253).

A winner moved off before it answered the rest is raced again on the whole step: each racer is sent the trial, then
the rest (a long step), and must answer both; every position of its history is checked as a trial's, and its new
positions are verified as any sampled step's (0176, 0184)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session import stalls
from corolla.client.session.delivery import delivered_under
from corolla.client.session.span_session import SpanSession
from corolla.client.verification.stretches import position_errors
from corolla.protocol.records import DECODE_MAX_TOKENS, RemoteSpanInfo

RACE_WIDTH = 8  # racers started at once, and added each round while none answered
RACE_MAX = 64  # racers of one race at most (the next race, if all of them fail, takes the servers left)
TRIAL_TOKENS = DECODE_MAX_TOKENS  # positions a racer's first step replays (the winner is sent the rest after)

R = TypeVar("R")

RaceAction = Literal["seated", "judged", "won", "rejudged"]


@dataclass(frozen=True)
class RaceEvent:
    """What a race for span `blocks` did, in order (an `InferenceSession`'s `race_events`, beside its stall events):
    `seated`, two racers (`peers`) whose trials agree with each other and not with the left server's earlier outputs
    formed a pair; `judged`, what servers outside the pair said of its trial (`verdict`: `witnesses.Recheck`, or, for
    a pair that lost its round, "split", "refuted" or "unheard": `InferenceSession._judge_lost_pairs`); `won`,
    the racer (`peers`, one) that took the session; `rejudged`, an unheard pair judged again by its referees asked
    after the race ("split", "refuted", or "unheard" still: `unheard_pairs.rejudge`, decision 0253)."""

    blocks: tuple[int, int]
    action: RaceAction
    peers: tuple[str, ...]
    verdict: str | None = None


class RaceLost(ConnectionError):
    """Every racer failed (each was blamed, banned or avoided as its failure called for): the span is raced again
    among the servers left, or replaced the usual way where fewer than two are."""


class TrialDisagrees(ConnectionError):
    """A racer's trial outputs disagree with the ones the span gave for those positions before: it does not win. Not
    blamed (the earlier outputs are a server's word too): where no racer agrees, the span is replaced the usual way."""


def trial_error(outputs: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest per-position relative L2 error (as `verification.stretches` measures it) of `outputs` [B, T, H]'s
    first n positions against `expected` [B, n <= T, H] (inf where the shapes do not match)."""
    first = outputs[:, : expected.shape[1]]
    return float(position_errors(first, expected).max()) if first.shape == expected.shape else math.inf


def check_trial(peer_id: str, outputs: torch.Tensor, expected: torch.Tensor | None, rtol: float) -> None:
    """TrialDisagrees unless the trial's `outputs` [B, T, H] agree position by position within `rtol` with
    `expected` [B, n <= T, H], the span's earlier outputs for its first n positions (None or n = 0: none known,
    nothing checked)."""
    if expected is None or expected.shape[1] == 0:
        return
    error = trial_error(outputs, expected)
    if not error <= rtol:
        raise TrialDisagrees(
            f"server ...{peer_id[-6:]}'s trial outputs disagree with the span's earlier ones (error {error:.3g}, "
            f"tolerance {rtol:.3g})"
        )


def race_candidates(
    manager: RemoteSequenceManager,
    failed_peer: str,
    blocks: tuple[int, int],
    rng: random.Random,
    slower_than_s: float | None = None,
) -> list[RemoteSpanInfo]:
    """The servers of the view that cover `blocks` alone, other than `failed_peer` and not banned or avoided, as spans
    of exactly `blocks`, in the module's order, at most `RACE_MAX`. `slower_than_s`: after a move for delivery, a
    decode step over `blocks` (one row and token) no racer may be known to deliver at or above (it would win the race
    with an at-once trial and crawl after, 0201): those seen that slow are left out, those seen under it go first."""
    start, end = blocks
    excluded = manager.excluded_peers() | {failed_peer}
    covering = [
        RemoteSpanInfo(s.peer_id, start, end, s.server_info)
        for s in manager.spans
        if s.start <= start and end <= s.end and s.peer_id not in excluded
    ]
    measured: list[RemoteSpanInfo] = []
    if slower_than_s is not None:
        now_s = time.monotonic()
        seen = {s.peer_id: delivered_under(manager, s, slower_than_s, now_s) for s in covering}
        covering = [s for s in covering if seen[s.peer_id] is not False]
        measured = [s for s in covering if seen[s.peer_id]]
    on_time, first = manager.answered_on_time(), {s.peer_id for s in measured}
    proven = [s for s in covering if s.peer_id in on_time and s.peer_id not in first]
    others = [s for s in covering if s.peer_id not in on_time and s.peer_id not in first]
    for group in (measured, proven, others):
        rng.shuffle(group)
    return (measured + proven + others)[:RACE_MAX]


def first_round_width(
    manager: RemoteSequenceManager, candidates: Sequence[RemoteSpanInfo], step_s: float | None
) -> int:
    """How many racers start a race (`race`'s `first_width`): after a move for delivery (`step_s`, as
    `race_candidates`' `slower_than_s`), the leading candidates measured delivering under it race a round alone where
    there are any (0214); else `RACE_WIDTH`."""
    if step_s is None:
        return RACE_WIDTH
    now_s = time.monotonic()
    measured = 0
    while measured < len(candidates) and delivered_under(manager, candidates[measured], step_s, now_s):
        measured += 1
    return min(measured, RACE_WIDTH) or RACE_WIDTH


def round_s(trial_nbytes: int) -> float:
    """How long a round of `RACE_WIDTH` racers runs before `RACE_WIDTH` more join: a decode step's floor plus the
    round's trials (request and reply, each about `trial_nbytes`) over a slow link. Not from any figure a racer
    announces (a loris would announce none: a 60 s deadline)."""
    return stalls.STALL_MIN_S + 2 * RACE_WIDTH * trial_nbytes / stalls.SLOW_LINK_BYTES_PER_S


async def race(
    racers: Sequence[SpanSession],
    trial: Callable[[SpanSession], Awaitable[R]],
    lost: Callable[[SpanSession, Exception], Awaitable[None]],
    *,
    round_s: float,
    first_width: int = RACE_WIDTH,
) -> tuple[SpanSession, R]:
    """Runs `trial(racer)` for the first `first_width` racers at once, and for `RACE_WIDTH` more every `round_s`
    while none has answered (or at once where all started ones failed); the first to return wins (returned with its
    result), the others are cancelled and closed. Each failure is handed to `lost` as it comes (which may raise: the
    race ends there); RaceLost when every racer failed. An AssertionError (a bug, not a server's failure) ends it."""
    loop = asyncio.get_running_loop()
    tasks: dict[asyncio.Future[R], SpanSession] = {}
    pending: set[asyncio.Future[R]] = set()
    winner: SpanSession | None = None

    def start_round(width: int = RACE_WIDTH) -> None:
        for racer in racers[len(tasks) : len(tasks) + width]:
            task = asyncio.ensure_future(trial(racer))
            tasks[task] = racer
            pending.add(task)

    try:
        start_round(first_width)
        next_round = loop.time() + round_s
        while pending:
            timeout_s = None if len(tasks) == len(racers) else max(0.0, next_round - loop.time())
            done, _ = await asyncio.wait(pending, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            pending.difference_update(done)
            won = [task for task in done if task.exception() is None]
            if won:
                winner = tasks[won[0]]
                return winner, won[0].result()
            for task in done:
                error = task.exception()
                if not isinstance(error, Exception) or isinstance(error, AssertionError):
                    raise error if error is not None else RaceLost("a racer ended without a result")
                await lost(tasks[task], error)
            if not pending or loop.time() >= next_round:
                start_round()
                next_round = loop.time() + round_s if len(tasks) < len(racers) else math.inf
        raise RaceLost(f"every one of {len(racers)} servers raced for the span failed")
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for racer in racers:
            if racer is not winner:
                await racer.close(drain=False)
