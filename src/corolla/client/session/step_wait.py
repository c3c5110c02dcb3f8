"""`StepWait`: one step's wait policy, the same for the client loop's waiter (`SpanSession.next_response`) and a
stepping thread's (`FramedSocketStream.exchange`; decision 0233). Pure: told when its waiter asked to wake and when
it woke, it says when to wake next and what is due without the reply (`Due`: timeout, stall, ping, late).

The step's time is the server's, not the client's: a waiter that asked to wake at t and woke at t + x (a GC pause, a
starved CPU) did not look at the server for x, which is credited (`lost_s`), so the pause is not charged to the late
budget nor counted in what the span delivers. The credit is at most the wall time the waiter was not running past
what it asked for, which no server can lengthen. A waiter sleeps `WAKE_EVERY_S` at most, so that a pause is seen
too; a busy waiter (polling, pinging) is credited nothing, and a ping that overslept its timeout (`ping_overslept`)
proves nothing and is asked again."""

from __future__ import annotations

import math
from typing import Literal

from corolla.client.session.stalls import StepClock

# timeout: past `request_timeout_s` (or `max_wait_s` once a ping went unanswered); stall: at the step's deadline (ping
# once: silent, fail over where another server holds the blocks, else wait; answering, it may run late until the late
# budget is spent, decision 0144); ping: every `ping_period_s`; late: the budget ran out (leave the server where it
# may). A waiter without pings (the same-host socket) gets only `late`, at the deadline plus the budget left, and
# `timeout`.
Due = Literal["timeout", "late", "stall", "ping"]
PINGS = ("stall", "ping")  # what is due that asks for a ping of the server
# a failed ping that took longer than its timeout by more than this overslept (its loop paused): it is asked again
PING_SLACK_S = 0.25
# a reply found at a wake past the time asked for by more than this came when exactly is not known (`overslept`)
OVERSLEEP_SLACK_S = 0.01
# a waiter sleeps at most this long at a time: a pause of its own that ends before the next thing due (one past the
# deadline, while the late budget runs) is credited but for this much
WAKE_EVERY_S = 0.25
PING_TRIES = 3  # pings asked in a row while each failed late (`ping_overslept`): then the last one stands


def ping_overslept(took_s: float, timeout_s: float) -> bool:
    """Whether a ping that failed after `took_s` ended late for the client's own reasons: past its timeout by more
    than `PING_SLACK_S` (its timer could not fire at the timeout: the loop was not running; the answer may have come
    meanwhile)."""
    return took_s > timeout_s + PING_SLACK_S


class StepWait:
    """One step's wait, from `started_s` (`time.monotonic()`, as every time here). `stall_deadline_s`: the step's
    deadline (None: none, only the timeouts); `pings`: whether its waiter pings the server (at the deadline and every
    `ping_period_s`). The waiter sleeps until `wake_at()` at the latest (or its reply), then tells `woke(asked_s,
    now_s)` and, with no reply, asks `due()` (what to do now: None, go back to sleep) and reports a ping's answer with
    `pinged`."""

    def __init__(
        self,
        clock: StepClock,
        started_s: float,
        stall_deadline_s: float | None,
        *,
        timeout_s: float,
        ping_period_s: float,
        max_wait_s: float | None = None,
        pings: bool = True,
    ) -> None:
        self.clock, self.started_s, self.stall_deadline_s = clock, started_s, stall_deadline_s
        self.lost_s = 0.0  # the waiter's oversleeps (and a late ping's, `ping_overslept`): wall time not the step's
        self.at_s = 0.0  # the step's time at the last wake (its wall time less `lost_s`)
        self.now_s = started_s  # the wall time of the last wake
        # the last wake came past the time asked for (by over `OVERSLEEP_SLACK_S`): a reply found then came at the
        # step's time `at_s` at the latest, when exactly is not known (`SpanSession.time_step` charges it nothing, and
        # measures nothing by it), unless it was read before that time (`replied`)
        self.overslept = False
        self._timeout_s, self._max_wait_s = timeout_s, max_wait_s
        # what is due, in the step's time (inf: never)
        self._period_s = ping_period_s if pings and ping_period_s > 0 else math.inf
        self._next_ping_s = self._period_s
        self._stall_s = stall_deadline_s if pings and stall_deadline_s is not None else math.inf
        self._late_s = math.inf  # once a `stall` ping was answered (or from the start without pings)
        if not pings and stall_deadline_s is not None:
            self._late_s = self._late_after(stall_deadline_s)
        self._asked: tuple[float, float] = (math.nan, math.nan)  # (wall time, step time) `wake_at` last gave
        self._lost_before_s = 0.0  # `lost_s` before the last wake's oversleep (`replied`)

    def _late_after(self, deadline_s: float) -> float:
        """The step's time at which the late budget runs out: its deadline plus what is left of the budget then."""
        return deadline_s + max(0.0, self.clock.late_left_s(self.started_s + self.lost_s + deadline_s))

    def wake_at(self, now_s: float) -> float:
        """The wall time the waiter must wake at the latest, without a reply: when the next thing is due, and within
        `WAKE_EVERY_S`; or `now_s` where something is due already (a waiter busy past it, e.g. pinging, asked for no
        sleep: it is credited nothing)."""
        now_at_s = now_s - self.started_s - self.lost_s
        at_s = min(self._timeout_s, self._late_s, self._stall_s, self._next_ping_s, now_at_s + WAKE_EVERY_S)
        wall_s = self.started_s + self.lost_s + at_s
        self._asked = (wall_s, at_s) if wall_s > now_s else (now_s, math.nan)
        return self._asked[0]

    def woke(self, asked_s: float, now_s: float) -> float:
        """After a sleep the waiter asked to end at `asked_s` (the reply may have ended it sooner), at `now_s`: credits
        the oversleep past `asked_s` (the step's time stops there: exactly, where that was a time `wake_at` gave, so
        what was due then is due now); returns the step's time now."""
        wall_s, at_s = self._asked
        over_s = 0.0 if asked_s == wall_s and math.isnan(at_s) else now_s - asked_s  # (nan: no sleep asked for)
        self.now_s, self.overslept = now_s, over_s > OVERSLEEP_SLACK_S
        self._lost_before_s = self.lost_s
        if over_s > 0:
            self.lost_s += over_s
            if asked_s == wall_s:
                self.at_s = at_s
                return at_s
        self.at_s = now_s - self.started_s - self.lost_s
        return self.at_s

    def replied(self, read_s: float) -> None:
        """The reply found at the last wake was read (by its reader, beside the waiter) at wall time `read_s`: where
        that wake overslept but the reply was read before the time it asked for, the loop was busy after the reply
        came, not before (a loaded client: the waiter's wake ran late behind other work), and the step's time is
        the reply's: `read_s` less what was credited before (`overslept` no more). Read later, it stays unknown."""
        wall_s, _ = self._asked
        if self.overslept and read_s <= wall_s:
            self.at_s = read_s - self.started_s - self._lost_before_s
            self.overslept = False

    def due(self) -> Due | None:
        """What is due at the last wake (each once, but `timeout`); None: nothing, sleep again."""
        at_s = self.at_s
        if at_s >= self._timeout_s:
            return "timeout"
        if at_s >= self._late_s:
            self._late_s = math.inf  # (not moved: the only server of its blocks now, kept and waited for)
            return "late"
        if at_s >= self._stall_s:
            self._stall_s = math.inf
            return "stall"
        if at_s >= self._next_ping_s:
            self._next_ping_s = at_s + self._period_s
            return "ping"
        return None

    def pinged(self, due: Due, alive: bool) -> bool:
        """After the ping `due` asked for (`stall` or `ping`): whether the server's silence is to be judged (at the
        step's deadline, or unanswered: `SpanSession` records it, fails over or waits). Answered at the deadline, the
        server may run late until the late budget is spent; unanswered, the wait ends at `max_wait_s`."""
        if due == "stall" and alive and self.stall_deadline_s is not None:
            self._late_s = self._late_after(self.stall_deadline_s)
        if not alive and self._max_wait_s is not None:
            self._timeout_s = min(self._timeout_s, self._max_wait_s)
        return due == "stall" or not alive
