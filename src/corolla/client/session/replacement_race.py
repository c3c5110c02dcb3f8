"""The replacement of a span moved off a server too slow to keep it (a loris: it answers pings, holds steps;
`client.session.stalls`, decision 0144) is raced, not planned by what servers announce (decision 0163). Announced
figures cost nothing, and so do identities: K lorises announcing the best figures for one span were walked in turn
by the usual routing, each holding the session its step deadline plus the late budget (the extra delay grew with K).

Here the servers that cover the span alone (not banned, not avoided; those this client saw answer a step within its
deadline first, the others in random order: nothing a server announces orders them; at most `RACE_MAX`) are each
given a fresh session whose first step replays the span's first `TRIAL_TOKENS` positions (a decode step's size: a
slow uplink carries a few positions to each, not the whole history), `RACE_WIDTH` at once, `RACE_WIDTH` more every
round (`round_s`: the decode floor `STALL_MIN_S` plus the round's trial bytes over a slow link; a round's racers are
not dropped, any may still answer) while none answered; the first to answer keeps the session and is sent the rest,
the others are closed (an honest loser computed at most `TRIAL_TOKENS` positions). Each racer's step keeps
0144/0149's rules (its deadline, pings, the late budget, a move where another server covers the span), so a racer
that fails is banned or avoided as it would be on its own, and one slow within its deadline may still win. A trial's
outputs must agree with the ones the span gave for those positions before, where the client holds them (the next
span's inputs there; `check_trial`, the verification's tolerance): a loris answering the trial at once with outputs it
never computed would win every race, and hold the rest.

A trial is a short step, which a loris may answer at once and then hold the rest; where the winner of a trial is moved
off before it answered the rest, the session's next race sends every racer the whole step instead (a long step, under
its long-step deadline), which a server must compute to win (`InferenceSession`, decision 0176)."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import torch

from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session import stalls
from corolla.client.session.span_session import SpanSession
from corolla.client.verification.stretches import position_errors
from corolla.protocol.records import RemoteSpanInfo

RACE_WIDTH = 8  # racers started at once, and added each round while none answered
RACE_MAX = 64  # racers of one race at most (the next race, if all of them fail, takes the servers left)
TRIAL_TOKENS = stalls.DECODE_MAX_TOKENS  # positions a racer's first step replays (the winner is sent the rest after)

R = TypeVar("R")


class RaceLost(ConnectionError):
    """Every racer failed (each was blamed, banned or avoided as its failure called for): the span is raced again
    among the servers left, or replaced the usual way where fewer than two are."""


class TrialDisagrees(ConnectionError):
    """A racer's trial outputs disagree with the ones the span gave for those positions before: it does not win. Not
    blamed (the earlier outputs are a server's word too): where no racer agrees, the span is replaced the usual way."""


def check_trial(peer_id: str, outputs: torch.Tensor, expected: torch.Tensor | None, rtol: float) -> None:
    """TrialDisagrees unless the trial's `outputs` [B, T, H] agree position by position within `rtol` (the relative
    L2 error `verification.stretches` uses) with `expected` [B, n <= T, H], the span's earlier outputs for its first
    n positions (None or n = 0: none known, nothing checked)."""
    if expected is None or expected.shape[1] == 0:
        return
    first = outputs[:, : expected.shape[1]]
    error = float(position_errors(first, expected).max()) if first.shape == expected.shape else math.inf
    if not error <= rtol:
        raise TrialDisagrees(
            f"server ...{peer_id[-6:]}'s trial outputs disagree with the span's earlier ones (error {error:.3g}, "
            f"tolerance {rtol:.3g})"
        )


def race_candidates(
    manager: RemoteSequenceManager, failed_peer: str, blocks: tuple[int, int], rng: random.Random
) -> list[RemoteSpanInfo]:
    """The servers of the view that cover `blocks` alone, other than `failed_peer` and not banned or avoided, as
    spans of exactly `blocks`: those that answered a step of this client within its deadline first (not since
    avoided or failed), then the others, each group in random order; at most `RACE_MAX`."""
    start, end = blocks
    excluded = manager.bans.banned_peers() | manager.avoided_peers() | {failed_peer}
    covering = [s for s in manager.spans if s.start <= start and end <= s.end and s.peer_id not in excluded]
    on_time = manager.answered_on_time()
    proven = [s for s in covering if s.peer_id in on_time]
    others = [s for s in covering if s.peer_id not in on_time]
    rng.shuffle(proven)
    rng.shuffle(others)
    return [RemoteSpanInfo(s.peer_id, start, end, s.server_info) for s in (proven + others)[:RACE_MAX]]


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
) -> tuple[SpanSession, R]:
    """Runs `trial(racer)` for the first `RACE_WIDTH` racers at once, and for `RACE_WIDTH` more every `round_s`
    while none has answered (or at once where all started ones failed); the first to return wins (returned with its
    result), the others are cancelled and closed. Each failure is handed to `lost` as it comes (which may raise: the
    race ends there); RaceLost when every racer failed. An AssertionError (a bug, not a server's failure) ends it."""
    loop = asyncio.get_running_loop()
    tasks: dict[asyncio.Future[R], SpanSession] = {}
    pending: set[asyncio.Future[R]] = set()
    winner: SpanSession | None = None

    def start_round() -> None:
        for racer in racers[len(tasks) : len(tasks) + RACE_WIDTH]:
            task = asyncio.ensure_future(trial(racer))
            tasks[task] = racer
            pending.add(task)

    try:
        start_round()
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
