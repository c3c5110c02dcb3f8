"""Simulated clients judging their spans by what they deliver (decision 0189; simulated in decision 0195).

Each closed-loop client keeps the product's `ObservedSteps`, each of its sessions a `MovePacer` and, per hop of its
chain, a `StepClock` fed the decode steps the client times there (the hop's time at the server's current batch plus
the client's RTT to it, or a loris's held step: `client_model`). After each chunk of tokens the session's hops are
judged by the product's own rule, `client.session.delivery.judge`, over a `DeliveryView` of the simulated client
(`SimClientView`: its view of the records, its region's RTTs, its observations, the servers it skips now); routes read
the records through `ObservedSteps.priced`, as `RemoteSequenceManager.make_sequence` does. A run without one
(`SimConfig.delivery_rule` "announced") is the baseline: main before 0189, routes by the announced figures, no
judgment."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from benchmarks.sim.server_model import SimServer
from corolla.client.routing.observed_steps import ObservedSteps
from corolla.client.session.delivery import (
    JUDGE_MIN_STEPS,
    JUDGE_PERIOD_S,
    JUDGE_WINDOW_S,
    JUDGE_WINDOW_STEPS,
    SLOW_RATIO,
    MovePacer,
    Outpaced,
    Workload,
    delivered_under,
    judge,
    observed_block_s,
    pace_of,
)
from corolla.client.session.stalls import StepClock
from corolla.protocol.records import RemoteSpanInfo
from corolla.swarm.cache_refusals import may_avoid


class JudgedSession(Protocol):
    """What the judge reads and writes of a simulated session (`client_model.SimSession`, which holds a
    `SessionDelivery` and so imports this module: a protocol here, not an import back)."""

    banned: dict[str, float]  # peer id -> time its ban ends (its client's bans and avoidances)
    chunk_tokens: int
    context: int  # tokens whose KV the session has
    delivery: SessionDelivery
    hop_steps_s: list[float]  # a decode step of the current chunk at each hop
    route: list[tuple[SimServer, int, int]] | None


S = TypeVar("S", bound=JudgedSession)  # the simulator's session class


@dataclass
class SimClientView:
    """One simulated client as `delivery.judge` reads it (`DeliveryView`) at `now_s`: `banned` is its sessions'
    shared table of servers skipped until a time (bans and avoidances alike, as the simulated client keeps them)."""

    spans: Sequence[RemoteSpanInfo]
    client_rtts_s: Mapping[str, float]
    observed_steps: ObservedSteps
    banned: Mapping[str, float]
    now_s: float

    def excluded_peers(self) -> set[str]:
        return {peer for peer, until in self.banned.items() if until > self.now_s}


@dataclass
class SessionDelivery:
    """A session's judging state: a step clock per hop of its chain (in the chain's order) and the steps it took,
    when it was last judged, its pacer (one move a period) and the servers it left for delivery (a move back to one
    counts apart)."""

    clocks: list[StepClock] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    judged_at_s: float = -math.inf
    pacer: MovePacer = field(default_factory=MovePacer)
    left: set[str] = field(default_factory=set)

    def new_hops(self, index: int, count: int, replaced: int = 1) -> None:
        """`replaced` hops from `index` on became `count` fresh ones (a new chain: all of them)."""
        self.clocks[index : index + replaced] = [StepClock() for _ in range(count)]
        self.steps[index : index + replaced] = [0] * count


class DeliveryJudge(Generic[S]):
    """The simulated clients' side of decision 0189. `client_key(session)`: the client a session belongs to;
    `client_view(session)`: (the records it reads now, its RTTs); `max_length(session)`: the length it opened with."""

    def __init__(
        self,
        *,
        num_blocks: int,
        hidden_bytes_per_token: int,
        client_key: Callable[[S], Hashable],
        client_view: Callable[[S], tuple[Sequence[RemoteSpanInfo], Mapping[str, float]]],
        max_length: Callable[[S], int],
    ):
        self.num_blocks, self.hidden_bytes_per_token = num_blocks, hidden_bytes_per_token
        self.client_key, self.client_view, self.max_length = client_key, client_view, max_length
        self._observed: dict[Hashable, ObservedSteps] = {}

    def observed(self, session: S) -> ObservedSteps:
        key = self.client_key(session)
        table = self._observed.get(key)
        if table is None:
            table = self._observed[key] = ObservedSteps()
        return table

    def forget(self, session: S) -> None:
        """An open arrival's session ended: its client (the session alone) is gone."""
        self._observed.pop(self.client_key(session), None)

    def priced(self, session: S, spans: Sequence[RemoteSpanInfo], now_s: float) -> list[RemoteSpanInfo]:
        """`spans` as the session's client's routes price them (`ObservedSteps.priced`)."""
        return self.observed(session).priced(spans, now_s)

    def chunk_tokens(self, session: S, tokens: int) -> int:
        """At most `tokens`: a chunk ends where a fresh hop's clock reaches `JUDGE_MIN_STEPS` (the first judgment a
        real client makes there)."""
        fewest = min(session.delivery.steps, default=JUDGE_MIN_STEPS)
        return min(tokens, JUDGE_MIN_STEPS - fewest) if fewest < JUDGE_MIN_STEPS else tokens

    def judge_chunk(self, session: S, now_s: float) -> tuple[int, Outpaced] | None:
        """After a chunk of `session.chunk_tokens` decode steps of `session.hop_steps_s` each: the steps go into the
        hops' clocks, and (at most every `JUDGE_PERIOD_S`) each hop's delivered step is noted and
        judged; (the hop's index, the verdict) of the first hop whose server another would outpace, else None."""
        state = session.delivery
        records = min(session.chunk_tokens, JUDGE_WINDOW_STEPS)  # (the steps a chunk's judgment reads)
        for index, (clock, step_s) in enumerate(zip(state.clocks, session.hop_steps_s, strict=True)):
            for _ in range(records):
                clock.delivered(1, step_s, now_s)
            state.steps[index] += session.chunk_tokens
        if now_s - state.judged_at_s < JUDGE_PERIOD_S:
            return None
        state.judged_at_s = now_s
        assert session.route is not None
        observed = self.observed(session)
        view: SimClientView | None = None
        verdict: tuple[int, Outpaced] | None = None
        for index, ((server, start, end), clock) in enumerate(zip(session.route, state.clocks, strict=True)):
            delivered_s = clock.delivered_step_s(JUDGE_MIN_STEPS, JUDGE_WINDOW_STEPS, JUDGE_WINDOW_S, now_s)
            if delivered_s is None:
                continue
            if view is None:
                spans, rtts = self.client_view(session)
                view = SimClientView(spans, rtts, observed, session.banned, now_s)
            observed.note(server.peer_id, observed_block_s(view, server.peer_id, delivered_s, end - start), now_s)
            if verdict is not None or not state.pacer.may_move(now_s, (start, end), delivered_s) or server.info is None:
                continue
            span = RemoteSpanInfo(server.peer_id, start, end, server.info)
            position = session.context
            work = Workload(0, self.max_length(session) - position, position, position * self.hidden_bytes_per_token)
            outpaced = judge(view, span, pace_of(view, span, now_s, step_s=delivered_s), work, now_s)
            if outpaced is not None:
                verdict = (index, outpaced)
        return verdict

    def racers(self, session: S, start: int, end: int, verdict: Outpaced, now_s: float) -> list[str]:
        """The servers of the client's view covering blocks `[start, end)` alone, not skipped now nor seen
        delivering no better than the move needs: those a move's race would try
        (`replacement_race.race_candidates`)."""
        spans, rtts = self.client_view(session)
        view = SimClientView(spans, rtts, self.observed(session), session.banned, now_s)
        skipped = view.excluded_peers()
        slower_than_s = verdict.delivered_s / SLOW_RATIO
        return [
            s.peer_id
            for s in spans
            if s.start <= start
            and end <= s.end
            and s.peer_id not in skipped
            and delivered_under(view, RemoteSpanInfo(s.peer_id, start, end, s.server_info), slower_than_s, now_s)
            is not False
        ]

    def may_avoid(self, session: S, peer_id: str, now_s: float) -> bool:
        """Whether the session's client may avoid `peer_id` for a move (`RemoteSequenceManager.avoid(keep_region=
        False)`'s check: the rest of its view, less what it skips now, still covers every block)."""
        spans, rtts = self.client_view(session)
        skipped = {peer for peer, until in session.banned.items() if until > now_s}
        view = [span for span in spans if span.peer_id not in skipped]
        return may_avoid(view, peer_id, self.num_blocks, rtts, None)

    def moved(
        self,
        session: S,
        left: str,
        blocks: tuple[int, int],
        verdict: Outpaced,
        new_peers: Sequence[str],
        trial_s: float | None,
        now_s: float,
    ) -> bool:
        """The session left `left`'s `blocks` for delivery, for `new_peers` (its replacement, made; a race's winner
        whose trial step took `trial_s`: the move's promise too, as the real client's); True where it had left one of
        those before (a move back)."""
        state = session.delivery
        state.pacer.moved(now_s, blocks, verdict.promised_s)
        if trial_s is not None:
            state.pacer.promised(blocks, trial_s)
        observed = self.observed(session)
        for peer in new_peers:  # (as the real client: where the session went, not the verdict's route)
            observed.moving_to(peer, now_s)
        back = not state.left.isdisjoint(new_peers)
        state.left.add(left)
        return back
