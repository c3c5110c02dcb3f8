"""A span judged by what it delivers, not by what its server announces (decisions 0189, 0193): step deadlines
(`stalls`) catch a server that holds a step, not one that answers every step just under the deadline's floor (a liar
announcing 1e6 blocks/s, or an honest server under load), which held a session at a crawl beside a faster chain.
`judge` prices a `Workload` on the span's server at its `Pace` (measured, else its announced figures discounted by
`ANNOUNCED_DISCOUNT`, plus RTT) and on the best other chain of its blocks, and moves when the span is over
`SLOW_RATIO` x the chain and the saving beats the move's price by `SAVING_MARGIN`; `MovePacer` keeps moved blocks
from moving back and forth (0196, 0214). `judge` reads its client through `DeliveryView` (the client's
`RemoteSequenceManager`, or `benchmarks.sim`'s simulated client: 0195). The rule in full: docs/contracts.md,
"Delivery"."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from corolla.client.routing.announced_pace import announced_token_s
from corolla.client.routing.observed_steps import ANNOUNCED_DISCOUNT, ObservedSteps
from corolla.client.session.stalls import SLOW_AVOID_S, SLOW_LINK_BYTES_PER_S, STALL_MIN_S
from corolla.protocol.records import RemoteSpanInfo
from corolla.swarm.route_planning import block_time_s, make_min_latency_route
from corolla.utils.errors import MissingBlocksError

JUDGE_MIN_STEPS = 4  # decode steps a span's delivery is judged on at least (one slow step is a hiccup)
# its delivered step: the mean of the decode steps it answered in the last this many seconds (or its last
# `JUDGE_WINDOW_STEPS` where fewer), less the slowest (decision 0201: every step between two judgments counts)
JUDGE_WINDOW_S = 8.0
JUDGE_WINDOW_STEPS = 8
JUDGE_PERIOD_S = 1.0  # a span is judged at most this often (a GPU's 10 ms steps: once in ~100, its cost flat)
SLOW_RATIO = 2.0  # a span moves only if its step is over this x the other server's expected step
SAVING_MARGIN = 2.0  # and the time saved over the session's rest is over this x the move's price
HORIZON_STEPS = 256  # steps of the session's rest counted at most (its max_length may be far beyond its use)
MOVE_FIXED_S = STALL_MIN_S  # a move's price beyond the replay: the new stream, a race's round
MOVE_PERIOD_S = SLOW_AVOID_S  # blocks moved move again only a period later; the server left is avoided as long


class DeliveryView(Protocol):
    """What `judge` reads of its client: the servers it knows (`spans`), its RTTs to them, what it measured of them
    (`observed_steps`) and the ones it skips now (`excluded_peers`: banned or avoided)."""

    @property
    def spans(self) -> Sequence[RemoteSpanInfo]: ...

    @property
    def client_rtts_s(self) -> Mapping[str, float]: ...

    @property
    def observed_steps(self) -> ObservedSteps: ...

    def excluded_peers(self) -> set[str]: ...


@dataclass(frozen=True)
class Workload:
    """What a span's server is to run for the session: a long step of `step_tokens` about to be sent (a new turn's
    prompt; 0: none, the judgment follows a decode step), then `decode_steps` one-token steps (the session's rest, at
    most `HORIZON_STEPS`); a move replays `history_positions` first (`history_nbytes` of inputs)."""

    step_tokens: int
    decode_steps: int
    history_positions: int
    history_nbytes: int


@dataclass(frozen=True)
class Pace:
    """What a server is expected to deliver to this client: a decode step over n of its blocks takes
    `decode_fixed_s + n * decode_block_s`, a long step of t tokens `long_fixed_s + t * n * token_block_s`."""

    decode_block_s: float
    decode_fixed_s: float
    token_block_s: float
    long_fixed_s: float

    def decode_s(self, blocks: int) -> float:
        return self.decode_fixed_s + blocks * self.decode_block_s

    def long_s(self, blocks: int, tokens: int) -> float:
        return self.long_fixed_s + tokens * blocks * self.token_block_s

    def work_s(self, blocks: int, work: Workload) -> float:
        """The workload's steps over `blocks` of this server (the replay aside)."""
        long_s = self.long_s(blocks, work.step_tokens) if work.step_tokens > 0 else 0.0
        return work.decode_steps * self.decode_s(blocks) + long_s

    def replay_s(self, blocks: int, work: Workload) -> float:
        """What a move's replay of the history adds over `blocks` of this server (sent with the long step, if any,
        else as a long step of its own) and its bytes both ways over a slow link."""
        if work.history_positions <= 0:
            return 0.0
        fixed_s = self.long_fixed_s if work.step_tokens <= 0 else 0.0
        bytes_s = 2 * work.history_nbytes / SLOW_LINK_BYTES_PER_S
        return fixed_s + work.history_positions * blocks * self.token_block_s + bytes_s


@dataclass(frozen=True)
class Outpaced:
    """A verdict: `peer_id`'s span delivers `delivered_s` a step of the kind it crawls on; `route` (that step
    expected `other_s` there) would save `saving_s` over the workload for a move of `price_s`. `promised_s`: the
    decode step (one row and token) `route` is expected to deliver over the span's blocks, what the move is paid for
    (`MovePacer` holds the blocks a period only while they deliver it within `SLOW_RATIO`)."""

    peer_id: str
    delivered_s: float
    route: tuple[RemoteSpanInfo, ...]
    other_s: float
    saving_s: float
    price_s: float
    promised_s: float


class MovePacer:
    """Shared by one inference session's spans: blocks that moved for delivery move so again only `MOVE_PERIOD_S`
    later, per blocks, not per session (decision 0196), and only while they keep the move's promise (0214:
    `Outpaced.promised_s`; blocks delivering over `SLOW_RATIO` x that, like a fresh identity that won the race's trial
    and crawls after, are not held)."""

    def __init__(self) -> None:
        # blocks [start, end) left -> (when, the decode step promised there, one row and token over those blocks)
        self._moved: dict[tuple[int, int], tuple[float, float]] = {}

    def may_move(self, now_s: float, blocks: tuple[int, int], delivered_s: float | None) -> bool:
        """Whether `blocks`, whose span delivers `delivered_s` a decode step now (None: not known), may move: no
        overlapping blocks moved within the period, or each such move's promise is broken (per block: a chain's
        hop is held to its share)."""
        start, end = blocks
        for (s, e), (at_s, promised_s) in self._moved.items():
            if now_s - at_s >= MOVE_PERIOD_S or e <= start or end <= s:
                continue
            if delivered_s is not None and delivered_s / (end - start) > SLOW_RATIO * promised_s / (e - s):
                continue  # the move's promise broken: the period does not hold these blocks
            return False
        return True

    def moved(self, now_s: float, blocks: tuple[int, int], promised_s: float) -> None:
        self._moved = {b: m for b, m in self._moved.items() if now_s - m[0] < MOVE_PERIOD_S}
        self._moved[blocks] = (now_s, promised_s)

    def promised(self, blocks: tuple[int, int], step_s: float) -> None:
        """The server that took `blocks` after their move showed `step_s` a step (a race's trial, one row): it is
        held to that where it is over the verdict's promise (a server is held to what it showed, not to a claim it
        never made)."""
        moved = self._moved.get(blocks)
        if moved is not None:
            self._moved[blocks] = (moved[0], max(moved[1], step_s))


def client_rtt_s(manager: DeliveryView, peer_id: str) -> float:
    """The client's RTT to `peer_id` (0 where it has none)."""
    rtt_s = manager.client_rtts_s.get(peer_id, 0.0)
    return rtt_s if math.isfinite(rtt_s) else 0.0


def delivered_under(manager: DeliveryView, span: RemoteSpanInfo, step_s: float, now_s: float) -> bool | None:
    """Whether this client saw `span`'s server deliver a decode step over `span`'s blocks (one row and token) under
    `step_s` lately (`ObservedSteps`, `OBSERVED_TTL_S`; its figure leaves the RTT out, decision 0196); None where it
    measured none."""
    block_s = manager.observed_steps.block_s(span.peer_id, now_s)
    return None if block_s is None else block_s * span.length + client_rtt_s(manager, span.peer_id) < step_s


def observed_block_s(manager: DeliveryView, peer_id: str, delivered_s: float, num_blocks: int) -> float:
    """What a span's delivered decode step (`delivered_s` over `num_blocks`) says of its server for `ObservedSteps`:
    the step less the client's RTT to it (a step's, not a block's: decision 0196), per block."""
    return (delivered_s - client_rtt_s(manager, peer_id)) / num_blocks


def step_wait_s(span: RemoteSpanInfo, decode_block_s: float) -> float:
    """What a decode step sent to `span`'s server waits for the step in progress there, at `decode_block_s` a block:
    its announced busy share (`busy_fraction`; 0 without one, a stock Petals peer) of half a step over its whole
    announced span, not over the blocks the client would use: the server merges its sessions' rows over all of its
    blocks (decision 0205). A span's own delivered step holds its wait already."""
    info = span.server_info
    busy = info.busy_fraction or 0.0
    if info.start_block is not None and info.end_block is not None:
        blocks = info.end_block - info.start_block
    else:
        blocks = span.length
    return min(max(busy, 0.0), 1.0) * 0.5 * max(blocks, span.length) * decode_block_s


def pace_of(
    manager: DeliveryView,
    span: RemoteSpanInfo,
    now_s: float,
    *,
    step_s: float | None = None,
    token_s: float | None = None,
) -> Pace:
    """`span`'s server as this client expects it: its decode step `step_s` and long step's seconds a token `token_s`
    over `span`'s blocks where given (the span's own clock, RTT included), else what this client measured there
    lately (`observed_block_s`: without the RTT) plus its RTT, else its record's figures x `ANNOUNCED_DISCOUNT` plus
    its RTT (a record without a decode figure: the routes' default rate, as they price it; without a prefill figure:
    its decode step a token, a pessimist's figure); plus, for a server not in use, `step_wait_s`."""
    rtt_s = client_rtt_s(manager, span.peer_id)
    observed = manager.observed_steps
    decode_block_s, decode_fixed_s = (None, 0.0) if step_s is None else (step_s / span.length, 0.0)
    if decode_block_s is None:
        decode_block_s, decode_fixed_s = observed.block_s(span.peer_id, now_s), rtt_s
    if decode_block_s is None:
        decode_block_s = ANNOUNCED_DISCOUNT * block_time_s(span)
    if step_s is None:
        decode_fixed_s += step_wait_s(span, decode_block_s)
    token_block_s = None if token_s is None else token_s / span.length
    token_block_s = token_block_s if token_block_s is not None else observed.token_block_s(span.peer_id, now_s)
    long_fixed_s = 0.0
    if token_block_s is None:
        info = span.server_info
        announced = announced_token_s(1, info.forward_rps, info.inference_rps)
        token_block_s = decode_block_s if announced is None else ANNOUNCED_DISCOUNT * announced
        long_fixed_s = rtt_s
    return Pace(decode_block_s, decode_fixed_s, token_block_s, long_fixed_s)


def judge(
    manager: DeliveryView,
    span: RemoteSpanInfo,
    own: Pace,
    work: Workload,
    now_s: float,
) -> Outpaced | None:
    """Outpaced where another chain of `span`'s blocks (one server or several, not banned, avoided or pending) runs
    `work` so much faster than `span`'s server at its pace `own` that moving there pays (the module's rule), else
    None. The chain is the min-latency route over the blocks with each block priced at its server's share of the
    workload and `SAVING_MARGIN` x its share of the replay: the route that best pays for the move."""
    decode_steps = min(work.decode_steps, HORIZON_STEPS)
    work = Workload(work.step_tokens, max(0, decode_steps), work.history_positions, work.history_nbytes)
    if work.decode_steps <= 0 and work.step_tokens <= 0:
        return None
    excluded = manager.excluded_peers() | {span.peer_id}
    others = [
        other
        for other in manager.spans
        if other.peer_id not in excluded
        and other.start < span.end
        and span.start < other.end
        and not manager.observed_steps.pending(other.peer_id, now_s)  # another session just moved there: wait
    ]
    paces = {other.peer_id: pace_of(manager, other, now_s) for other in others}

    def block_cost_s(other: RemoteSpanInfo) -> float:
        pace = paces[other.peer_id]
        per_token = work.step_tokens + SAVING_MARGIN * work.history_positions
        return work.decode_steps * pace.decode_block_s + per_token * pace.token_block_s

    def entry_cost_s(other: RemoteSpanInfo) -> float:
        pace = paces[other.peer_id]
        fixed_s = work.decode_steps * pace.decode_fixed_s + (pace.long_fixed_s if work.step_tokens > 0 else 0.0)
        return fixed_s + SAVING_MARGIN * pace.replay_s(0, work)  # (a replay's fixed part and bytes)

    try:
        route = make_min_latency_route(
            others, span.start, span.end, client_rtts_s=dict.fromkeys(paces, 0.0), block_cost_s=block_cost_s,
            hop_rtt_s=lambda _a, _b: 0.0, entry_cost_s=entry_cost_s,
        )  # fmt: skip
    except MissingBlocksError:
        return None
    route_work_s = sum(paces[hop.peer_id].work_s(hop.length, work) for hop in route)
    price_s = MOVE_FIXED_S + sum(paces[hop.peer_id].replay_s(hop.length, work) for hop in route)
    saving_s = own.work_s(span.length, work) - route_work_s
    # a crawl, not a loaded server's hiccup: over `SLOW_RATIO` x the chain on a kind of step the workload holds
    crawls: list[tuple[float, float]] = []
    if work.step_tokens > 0:
        mine_s = own.long_s(span.length, work.step_tokens)
        theirs_s = sum(paces[hop.peer_id].long_s(hop.length, work.step_tokens) for hop in route)
        crawls += [(mine_s, theirs_s)] if mine_s > SLOW_RATIO * theirs_s else []
    if work.decode_steps > 0:
        mine_s = own.decode_s(span.length)
        theirs_s = sum(paces[hop.peer_id].decode_s(hop.length) for hop in route)
        crawls += [(mine_s, theirs_s)] if mine_s > SLOW_RATIO * theirs_s else []
    if not crawls or not saving_s > SAVING_MARGIN * price_s:
        return None
    delivered_s, other_s = crawls[0]
    promised_s = sum(paces[hop.peer_id].decode_s(hop.length) for hop in route)
    return Outpaced(span.peer_id, delivered_s, tuple(route), other_s, saving_s, price_s, promised_s)
