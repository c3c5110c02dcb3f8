"""Simulated clients: each conversation opens an inference session on a chain chosen by the policy's routing (the
real function), reserves KV on every hop, prefills, then decodes in chunks of tokens whose time per token comes from
the hops' current batches and the RTTs (servers push hidden states to the next hop: (n + 1) one-way delays per
token); a lost server is detected, the chain re-routed and the history replayed, with Petals' client backoff. With a
`DeliveryJudge` (decision 0195), each session times every hop's decode steps as its client would and, under the
`judged` rule, leaves a hop whose server another would outpace (decision 0189): the hop's blocks re-routed without it,
its history replayed there; a loris's hold (`SimServer.hold_step_s`) slows the steps through it."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.sim.client_book import FAKE_DIAL_S, is_fake
from benchmarks.sim.clock import Event, EventLoop
from benchmarks.sim.delivery_judge import DeliveryJudge, SessionDelivery
from benchmarks.sim.metrics import Metrics
from benchmarks.sim.server_model import SimServer
from benchmarks.sim.shadows import ShadowBook, SimShadow
from benchmarks.sim.view import SwarmView
from benchmarks.sim.workload import Conversation
from corolla.client.session.delivery import MOVE_PERIOD_S, Outpaced
from corolla.protocol.records import ServerState
from corolla.swarm.cache_refusals import AVOID_S, reroute_delay_s
from corolla.utils.errors import MissingBlocksError

CHUNK_TOKENS = 32  # decode is simulated in chunks of this many tokens at a time per token fixed at the chunk's start
CHUNK_MAX_S = 8.0  # and of at most this long (at least a token): a slow chain's steps are timed as often
LORIS_STUCK_S = 60.0  # a session whose chain held a loris this long in a row counts as stuck on it
MIN_BACKOFF_S, MAX_BACKOFF_S = 1.0, 60.0  # Petals' client defaults (min_backoff, max_backoff)
NEW_SERVER_S = 600.0  # a server's first minutes online, where the load it gets is counted (`Report.new_server_share`)
MAX_WAIT_S = 300.0  # a user gives up after this long without a chain (assumption; Petals retries forever)
BAN_TIMEOUT_S = 15.0  # Petals' ban_timeout: a server that refused or failed is skipped this long (first ban)


@dataclass(eq=False)
class SimSession:
    sid: int
    conversation: Conversation
    slot: int | None  # the closed-loop client that opened it
    turn: int = 0
    phase: str = "idle"  # idle (before a turn / thinking), prefill, decode, done
    route: list[tuple[SimServer, int, int]] | None = None
    net_s: float = 0.0
    context: int = 0  # tokens whose KV the session has (history)
    kv_on_route: int = 0  # of those, tokens the current chain holds
    remaining: int = 0  # output tokens left in this turn
    turn_start_s: float = 0.0
    event: Event | None = None
    chunk_start_s: float = 0.0
    chunk_tokens: int = 0
    tpot_s: float = 0.0
    visit_rate: float = 0.0  # 1 / tpot_s while it decodes: what it adds to each of its servers' visit_rate
    record_ttft: bool = True
    attempts: int = 0
    wait_start_s: float | None = None
    retried: bool = False
    banned: dict[str, float] = field(default_factory=dict)  # peer id -> time its ban ends (its client's bans)
    full: bool = False  # an attempt of its current wait found every block covered but the servers out of cache
    cache_refusals: int = 0  # cache refusals in a row (corolla's client re-routes the first few at once)
    dial_s: float = 0.0  # a failed dial's time before the next attempt (a made-up server's)
    counted: bool = True  # opened after the warm-up: its outcome goes into the metrics
    opened_s: float = 0.0
    hop_rtts_s: list[float] = field(default_factory=list)  # its client's RTT to each hop's server
    hop_steps_s: list[float] = field(default_factory=list)  # a decode step of the current chunk at each hop, timed
    delivery: SessionDelivery = field(default_factory=SessionDelivery)  # judged by what its hops deliver
    loris_since_s: float | None = None  # since when its chain holds a loris
    on_loris: bool = False  # its chain held a loris
    stuck: bool = False  # its chain held a loris over LORIS_STUCK_S in a row
    shadows: list[SimShadow | None] = field(default_factory=list)  # by hop of `route`: its shadow (`shadows`)


class ClientDriver:
    """Runs every session; `route_fn(session, spans)` is the routing policy call (raises MissingBlocksError)."""

    def __init__(
        self,
        loop: EventLoop,
        view: SwarmView,
        metrics: Metrics,
        route_fn: Callable[[SimSession], list[tuple[str, int, int]]],
        rng: random.Random,
        think_s: Callable[[], float],
        on_session_end: Callable[[SimSession], None],
        sessions_per_client: int = 1,
        view_age_max_s: float = 60.0,
        on_cache_refusal: Callable[[SimSession, str], bool] | None = None,
        on_failure: Callable[[SimSession, str], None] | None = None,
        delivery: DeliveryJudge | None = None,
        shadows: ShadowBook[SimSession] | None = None,
    ):
        self.loop, self.view, self.metrics, self.route_fn, self.rng = loop, view, metrics, route_fn, rng
        self.think_s, self.on_session_end = think_s, on_session_end
        self.sessions: dict[int, SimSession] = {}
        self.sessions_per_client = sessions_per_client
        self.view_age_max_s = view_age_max_s  # the clients' view is re-read this often: a gone server is out of it then
        self.bans: dict[int, dict[str, float]] = {}  # by closed-loop client: as the real client, one ban list each
        # corolla's client (`swarm.cache_refusals`): a server out of cache is avoided for AVOID_S, the client re-reads
        # the records (this callback) and re-routes at once; None: Petals' (a ban, then the back-off schedule)
        self.on_cache_refusal = on_cache_refusal
        self.on_failure = on_failure  # a server failed a session's call (gone, or made up): its client's book learns
        self.delivery = delivery  # sessions time their hops' steps (and judge them: `delivery_judge`)
        self.shadows = shadows  # hops mirrored on replicas (`shadows`); None: no verification
        self._next_sid = 0

    def start(self, conversation: Conversation, slot: int | None = None) -> SimSession:
        session = SimSession(self._next_sid, conversation, slot)
        if slot is not None:
            session.banned = self.bans.setdefault(slot // self.sessions_per_client, {})
        session.counted = self.loop.now_s >= self.metrics.measure_from_s
        session.opened_s = self.loop.now_s
        self._next_sid += 1
        self.sessions[session.sid] = session
        self._count(session, "sessions_started")
        self._open_turn(session)
        return session

    def _count(self, session: SimSession, counter: str) -> None:
        if session.counted:
            setattr(self.metrics, counter, getattr(self.metrics, counter) + 1)

    # --- turns ---

    def _open_turn(self, session: SimSession) -> None:
        session.turn_start_s, session.record_ttft = self.loop.now_s, True
        prompt, output = session.conversation.turns[session.turn]
        session.remaining = output - 1  # the prefill yields the first token
        self._prefill(session, prompt)

    def _prefill(self, session: SimSession, new_tokens: int) -> None:
        if session.route is None and not self._reroute(session):
            session.event = None
            self._backoff(session, lambda: self._prefill(session, new_tokens))
            return
        assert session.route is not None
        tokens = session.context - session.kv_on_route + new_tokens
        duration = session.net_s
        for server, start, end in session.route:
            _, step_s, busy = server.batch()
            duration += server.perf.prefill_s(end - start, tokens) + busy * 0.5 * step_s
        session.phase = "prefill"
        session.event = self.loop.after(duration, self._first_token, session, new_tokens)

    def _first_token(self, session: SimSession, new_tokens: int) -> None:
        session.event = None
        if session.record_ttft:
            self.metrics.add_ttft(self.loop.now_s, self.loop.now_s - session.turn_start_s)
        session.context += new_tokens + (1 if session.record_ttft else 0)
        session.kv_on_route = session.context
        session.phase = "decode"
        assert session.route is not None
        for server, _, _ in session.route:
            server.rows += 1
            server.context_tokens += session.context
        self._next_chunk(session)

    def _next_chunk(self, session: SimSession) -> None:
        if session.remaining <= 0:
            self._end_turn(session)
            return
        assert session.route is not None
        own = session.visit_rate
        hops_s = [
            self._hop_s(server, end - start, own, rtt_s)
            for (server, start, end), rtt_s in zip(session.route, session.hop_rtts_s, strict=True)
        ]
        tpot = session.net_s + sum(hops_s)
        rate = 1.0 / tpot if tpot > 0 else 0.0
        for server, _, _ in session.route:
            server.visit_rate += rate - own
        session.visit_rate = rate
        if self.shadows is not None:
            self.shadows.pace(session)
        tokens = min(CHUNK_TOKENS, session.remaining, max(1, int(CHUNK_MAX_S / tpot)) if tpot > 0 else CHUNK_TOKENS)
        if self.delivery is not None:  # what the client times at each hop: its step there and the RTT to it
            session.hop_steps_s = [hop_s + rtt_s for hop_s, rtt_s in zip(hops_s, session.hop_rtts_s, strict=True)]
            tokens = self.delivery.chunk_tokens(session, tokens)
        session.tpot_s, session.chunk_tokens, session.chunk_start_s = tpot, tokens, self.loop.now_s
        session.event = self.loop.after(tokens * tpot, self._chunk_done, session)

    @staticmethod
    def _hop_s(server: SimServer, blocks_used: int, own_rate: float, client_rtt_s: float) -> float:
        """A decode token's time at `server` (`SimServer.hop_s`); a loris answers the client no sooner than its hold
        after the client sent the step."""
        hop_s = server.hop_s(blocks_used, own_rate)
        return max(hop_s, server.hold_step_s - client_rtt_s) if server.hold_step_s else hop_s

    def _credit(self, session: SimSession, tokens: int) -> None:
        if tokens <= 0:
            return
        self.metrics.add_tokens(self.loop.now_s, tokens, session.tpot_s)
        assert session.route is not None
        now, measure_from = self.loop.now_s, self.metrics.measure_from_s
        for server, _, _ in session.route:
            if now >= measure_from:
                self.metrics.server_tokens += tokens
                first = server.first_online_s
                if first is not None and first >= measure_from and now - first < NEW_SERVER_S:
                    self.metrics.new_server_tokens += tokens
            server.tokens_served += tokens
            server.context_tokens += tokens
        if self.shadows is not None:
            self.shadows.credit(session, tokens, now)
        session.context += tokens
        session.kv_on_route = session.context
        session.remaining -= tokens

    def _chunk_done(self, session: SimSession) -> None:
        session.event = None
        self._credit(session, session.chunk_tokens)
        if self.delivery is not None:  # (after a turn's last token too: the move then comes before the next turn)
            verdict = self.delivery.judge_chunk(session, self.loop.now_s)
            if verdict is not None and self._move_hop(session, *verdict):
                return
        self._next_chunk(session)

    def _move_hop(self, session: SimSession, index: int, verdict: Outpaced) -> bool:
        """Decisions 0189 and 0193's move: the client avoids the hop's server `MOVE_PERIOD_S` (where it may), puts
        the verdict's chain over the hop's blocks (`_replacement`: or 0163's race) and replays the session's history
        there; False (no move, nothing changed) where the client may not avoid the server or the chain has no
        room."""
        assert self.delivery is not None and session.route is not None
        now, need = self.loop.now_s, session.conversation.total_tokens
        old, start, end = session.route[index]
        if not self.delivery.may_avoid(session, old.peer_id, now):
            return False
        before = session.banned.get(old.peer_id)
        session.banned[old.peer_id] = max(before or now, now + MOVE_PERIOD_S)
        chain, trial_s = self._replacement(session, start, end, verdict)
        hops = [(self.view.servers[peer], a, b) for peer, a, b in chain if self._serves(peer, a, b)]
        if not chain or len(hops) < len(chain) or not all(self._room(server, a, b, need) for server, a, b in hops):
            if before is None:
                del session.banned[old.peer_id]
            else:
                session.banned[old.peer_id] = before
            self._count(session, "delivery_moves_refused")
            return False
        self._leave_batches(session)
        old.reserve(start, end, -need)
        if all(server is not old for i, (server, _, _) in enumerate(session.route) if i != index):
            old.sessions.discard(session.sid)
        for server, a, b in hops:
            server.sessions.add(session.sid)
            self._admit(server, a, b, need)
        region = session.conversation.region
        rtts = [self.view.client_rtts_s[region][server.peer_id] for server, _, _ in hops]
        if self.shadows is not None:  # the hop's span session ends; the new hops' are drawn as new ones
            self.shadows.end(session, index)
            session.shadows[index : index + 1] = [None] * len(hops)
        session.route[index : index + 1] = hops
        session.hop_rtts_s[index : index + 1] = rtts
        if self.shadows is not None:
            self.shadows.draw(session, index, len(hops))
        session.delivery.new_hops(index, len(hops))
        session.net_s = self._net_s(region, session.route)
        self._route_changed(session)
        new_peers = [server.peer_id for server, _, _ in hops]
        if self.delivery.moved(session, old.peer_id, (start, end), verdict, new_peers, trial_s, now):
            self._count(session, "delivery_moves_back")
        self._count(session, "delivery_moves")
        # the history replayed on the new hops (a stream opened there: one RTT each), then decoding goes on
        replay_s = sum(rtts)
        for server, a, b in hops:
            _, step_s, busy = server.batch()
            replay_s += server.perf.prefill_s(b - a, session.context) + busy * 0.5 * step_s
        session.phase, session.record_ttft = "prefill", False
        session.event = self.loop.after(replay_s, self._first_token, session, 0)
        return True

    def _replacement(
        self, session: SimSession, start: int, end: int, verdict: Outpaced
    ) -> tuple[list[tuple[str, int, int]], float | None]:
        """The chain a move puts over blocks `[start, end)`: the verdict's, or where it is one server and two or more
        cover the blocks alone, 0163's race, won by the first to answer a decode step (a loris holds it) among those
        with room; and the race winner's trial step (None: no race)."""
        assert self.delivery is not None
        racers = self.delivery.racers(session, start, end, verdict, self.loop.now_s)
        if len(verdict.route) > 1 or len(racers) < 2:
            return [(hop.peer_id, hop.start, hop.end) for hop in verdict.route], None
        need, rtts = session.conversation.total_tokens, self.view.client_rtts_s[session.conversation.region]
        fits = [
            self.view.servers[peer]
            for peer in racers
            if self._serves(peer, start, end) and self._room(self.view.servers[peer], start, end, need)
        ]
        if not fits:
            return [], None
        trials_s = {s.peer_id: self._hop_s(s, end - start, 0.0, rtts[s.peer_id]) + rtts[s.peer_id] for s in fits}
        winner = min(trials_s, key=trials_s.__getitem__)
        return [(winner, start, end)], trials_s[winner]

    def _route_changed(self, session: SimSession) -> None:
        """Keeps the time the session's chain holds a loris in a row (`LORIS_STUCK_S`)."""
        on_loris = any(server.hold_step_s for server, _, _ in session.route or ())
        if on_loris and session.loris_since_s is None:
            if not session.on_loris:
                session.on_loris = True
                self._count(session, "sessions_on_loris")
            session.loris_since_s = self.loop.now_s
        elif not on_loris and session.loris_since_s is not None:
            self._off_loris(session)

    def _off_loris(self, session: SimSession) -> None:
        assert session.loris_since_s is not None
        if self.loop.now_s - session.loris_since_s > LORIS_STUCK_S and not session.stuck:
            session.stuck = True
            self._count(session, "sessions_stuck_on_loris")
        session.loris_since_s = None

    def finish(self) -> None:
        """At the run's end: the sessions still open count their time and their lorises."""
        for session in self.sessions.values():
            self._session_time(session)
            if session.loris_since_s is not None:
                self._off_loris(session)

    def _session_time(self, session: SimSession) -> None:
        if session.counted:
            self.metrics.session_s += self.loop.now_s - max(session.opened_s, self.metrics.measure_from_s)

    def _leave_batches(self, session: SimSession) -> None:
        assert session.route is not None
        for server, _, _ in session.route:
            server.rows -= 1
            server.context_tokens -= session.context
            server.visit_rate = max(server.visit_rate - session.visit_rate, 0.0) if server.rows else 0.0
        session.visit_rate = 0.0
        if self.shadows is not None:
            self.shadows.pace(session)

    def _end_turn(self, session: SimSession) -> None:
        self._leave_batches(session)
        session.phase = "idle"
        session.turn += 1
        if session.turn < len(session.conversation.turns):
            session.event = self.loop.after(self.think_s(), self._open_turn, session)
        else:
            self._close(session, completed=True)

    def _close(self, session: SimSession, *, completed: bool) -> None:
        self._release(session)
        self._session_time(session)
        session.phase = "done"
        if completed:
            self._count(session, "sessions_completed")
        elif session.full:  # it never got a chain with room: the swarm was full, nothing failed
            self._count(session, "sessions_turned_away")
        else:
            self._count(session, "sessions_failed")
            if self.view.covered():
                self._count(session, "sessions_failed_covered")
        del self.sessions[session.sid]
        self.on_session_end(session)

    # --- routing, refusals, failures ---

    def _release(self, session: SimSession) -> None:
        need = session.conversation.total_tokens
        route = session.route or ()
        for server, start, end in route:  # (a server may hold two hops of a chain after a move: `_move_hop`)
            if session.sid in server.sessions:
                server.reserve(start, end, -need)
        for server, _, _ in route:
            server.sessions.discard(session.sid)
        if self.shadows is not None:
            self.shadows.end_all(session)
        session.route, session.kv_on_route = None, 0
        self._route_changed(session)

    def _reroute(self, session: SimSession) -> bool:
        """Chooses a chain and reserves KV on it; False (to back off) if blocks are missing or servers refuse."""
        need = session.conversation.total_tokens
        # as Petals' client: a refusal or a failed call is one failed attempt (ban, then the retry schedule)
        try:
            chain = self.route_fn(session)
        except MissingBlocksError:
            session.cache_refusals = 0
            return False
        gone = next((peer for peer, start, end in chain if not self._serves(peer, start, end)), None)
        if gone is not None:  # the client's view is older than the server's departure or move: the call fails
            self._count(session, "refusals")
            # as the real client (`RemoteSequenceManager.on_request_failure`): the failed server is banned and dropped
            # from the client's view until it re-reads the records, which no longer hold it (or hold its new span)
            session.banned[gone] = self.loop.now_s + max(BAN_TIMEOUT_S, self.view_age_max_s)
            session.cache_refusals = 0
            if is_fake(gone):  # nobody answers its dial
                self._count(session, "fake_tries")
                session.dial_s = FAKE_DIAL_S
            if self.on_failure is not None:
                self.on_failure(session, gone)
            return False
        hops = [(self.view.servers[peer], start, end) for peer, start, end in chain]
        refusing = next((server for server, start, end in hops if not self._room(server, start, end, need)), None)
        if refusing is not None:
            self._count(session, "refusals")  # out of cache
            session.full = True  # for this whole wait: a user who gives up after it was turned away by a full swarm
            if self.on_cache_refusal is None:
                session.banned[refusing.peer_id] = self.loop.now_s + BAN_TIMEOUT_S
            else:
                session.cache_refusals += 1
                if self.on_cache_refusal(session, refusing.peer_id):  # its client avoids it (`may_avoid`), re-reads
                    session.banned[refusing.peer_id] = self.loop.now_s + AVOID_S
            return False
        session.full, session.cache_refusals = False, 0
        for server, start, end in hops:
            server.sessions.add(session.sid)
            self._admit(server, start, end, need)
        region = session.conversation.region
        session.route, session.net_s, session.kv_on_route = hops, self._net_s(region, hops), 0
        session.hop_rtts_s = [self.view.client_rtts_s[region][server.peer_id] for server, _, _ in hops]
        session.delivery.new_hops(0, len(hops), len(session.delivery.clocks))
        session.attempts, session.wait_start_s = 0, None
        self._route_changed(session)
        if self.shadows is not None:
            session.shadows = [None] * len(hops)
            self.shadows.draw(session, 0, len(hops))
        return True

    def _room(self, server: SimServer, start: int, end: int, need: int) -> bool:
        """Whether a session's `need` tokens fit on blocks [start, end) of `server`, its shadows yielding."""
        if self.shadows is None:
            return server.kv_free_tokens(start, end) >= need
        return self.shadows.room(server, start, end, need)

    def _admit(self, server: SimServer, start: int, end: int, need: int) -> None:
        """Reserves a session's `need` tokens on blocks [start, end) of `server`, ending the shadows that yield them."""
        if self.shadows is not None:
            self.shadows.make_room(server, start, end, need)
        server.reserve(start, end, need)

    def _net_s(self, region: str, hops: list[tuple[SimServer, int, int]]) -> float:
        """A token's time on the wire through `hops` from and back to a client in `region`: servers push hidden
        states to the next hop, so one way to the first, between each pair, and back from the last."""
        rtt = self.view.rtt
        net = self.view.client_rtts_s[region][hops[0][0].peer_id] / 2
        net += self.view.client_rtts_s[region][hops[-1][0].peer_id] / 2
        for (a, _, _), (b, _, _) in zip(hops, hops[1:], strict=False):
            net += rtt.rtt_s(a.peer_id, a.region, b.peer_id, b.region) / 2
        return net

    def _serves(self, peer: str, start: int, end: int) -> bool:
        server = self.view.servers.get(peer)
        return server is not None and server.state == ServerState.ONLINE and server.start <= start and end <= server.end

    def _backoff(self, session: SimSession, retry: Callable[[], None]) -> None:
        now = self.loop.now_s
        if session.wait_start_s is None:
            session.wait_start_s = now
        if now - session.wait_start_s >= MAX_WAIT_S:
            self._close(session, completed=False)
            return
        session.phase = "idle"
        # Petals' get_retry_delay: 0 for the first retry, then min(1 s x 2^(attempt - 1), 60 s)
        delay = 0.0 if session.attempts == 0 else min(MIN_BACKOFF_S * 2 ** (session.attempts - 1), MAX_BACKOFF_S)
        if session.cache_refusals:  # corolla's client after a cache refusal (`RetryBudget.on_failure`)
            delay = reroute_delay_s(session.cache_refusals, delay)
        delay, session.dial_s = delay + session.dial_s, 0.0
        session.attempts += 1
        for peer in [peer for peer, until in session.banned.items() if until <= now]:
            del session.banned[peer]
        session.event = self.loop.after(delay, retry)

    def on_server_lost(self, server: SimServer, detect_s: float) -> None:
        """`server` stopped serving: every session holding KV there notices after `detect_s`, re-routes, replays;
        the shadows it ran end."""
        if self.shadows is not None:
            self.shadows.replica_lost(server)
        for sid in sorted(server.sessions):
            session = self.sessions[sid]
            phase = session.phase
            if session.event is not None:
                session.event.cancel()
                session.event = None
            if phase == "decode":
                done = int((self.loop.now_s - session.chunk_start_s) / session.tpot_s) if session.tpot_s > 0 else 0
                self._credit(session, min(done, session.chunk_tokens))
                self._leave_batches(session)
            self._release(session)
            session.banned[server.peer_id] = self.loop.now_s + detect_s + BAN_TIMEOUT_S
            self._count(session, "retries")
            if not session.retried:
                session.retried = True
                self._count(session, "sessions_retried")
            session.phase = "idle"
            if phase == "prefill":  # the turn's prompt was not processed: start the turn again
                session.event = self.loop.after(detect_s, self._open_turn, session)
            elif phase == "decode":
                session.event = self.loop.after(detect_s, self._resume, session)
            else:  # thinking: the next turn finds the chain gone and re-routes
                session.event = self.loop.after(detect_s + self.think_s(), self._open_turn, session)

    def _resume(self, session: SimSession) -> None:
        session.record_ttft = False
        self._prefill(session, 0)
