"""Stall and slowness detection for one hop of a chain: `StepClock` keeps a span's recent step times and derives the
deadline after which a step's silence is suspect (a multiple of the slowest recent decode step, or of the announced
step time, within `STALL_MIN_S` .. `STEP_MAX_S`; a long step's from its tokens at the announced prefill rate: 0149;
a KV hand-off's from its bytes), instead of waiting for `request_timeout_s`. It also keeps the span's late budget:
seconds its steps ran past their deadlines while the server answered pings, leaking back at `LATE_LEAK`; once it is
spent and another server holds the blocks, the session moves (`ServerTooSlow`) and the server is avoided for
`SLOW_AVOID_S`, not banned (decision 0144). The figures: docs/contracts.md."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Literal

from corolla.protocol.records import DECODE_MAX_TOKENS

STALL_FACTOR = 4.0  # a step this many times slower than the span's slowest recent step is suspect
STALL_MIN_S = 1.0  # never suspect sooner: a busy CPU, a GC pause or a batch on the server can take this long
STEP_TIMES_KEPT = 16  # recent step times a deadline is derived from
# answered decode steps kept for what a span delivers (`StepClock.delivered_step_s`'s window holds this many at most,
# ~26 KB a span session: 2 s of a GPU's 8 ms steps, past the judgment's 1 s period)
DELIVERED_KEPT = 256
LATE_BUDGET_S = 8.0  # a span's steps may run this long past their deadlines (net of the leak) before it is moved
LATE_LEAK = 0.1  # the late budget refills at this fraction of wall time: a server late 10% of the time is kept
SLOW_AVOID_S = 60.0  # a server moved off for slowness is left out of routes this long (one refresh period)
# A long step's deadline is never shorter than this plus its bytes both ways at `SLOW_LINK_BYTES_PER_S`: what a server
# announcing an absurd prefill rate gets, which an honest server behind a busy queue meets
LONG_STEP_MIN_S = 4.0
SLOW_LINK_BYTES_PER_S = 1e6  # 8 Mbit/s: a slow home uplink, which the client's tensors cross on top of the compute
# No step's deadline is longer (bytes aside): a server announcing a tiny rate (or none) may not hold a step for
# `request_timeout_s` (minutes)
STEP_MAX_S = 60.0

StallAction = Literal["slow", "moved", "failed_over", "waited", "outpaced"]


@dataclass(frozen=True)
class StallEvent:
    """One suspected stall: the server, its blocks, how long the step had waited when the suspicion was checked, its
    step deadline, what the client did (`slow`: it answered a ping, kept; `moved`: its late budget ran out; `failed_over`:
    silent, another server holds its blocks; `waited`: silent and the only one; `outpaced`: `client.session.delivery`'s
    verdict, `detected_after_s` then its delivered step and `step_deadline_s` the other chain's) and the step's tokens."""

    peer_id: str
    blocks: tuple[int, int]
    detected_after_s: float
    step_deadline_s: float | None  # None: noticed by a liveness ping, not at a step deadline
    action: StallAction
    num_tokens: int = 0


class StepClock:
    """Per span session: `record(num_tokens, elapsed_s)` after each answered step that was never suspect;
    `deadline_s(num_tokens, nbytes)` is how long the next step (`nbytes`: its inputs' size) may stay silent before the
    client checks on the server (never more than `STEP_MAX_S`, bytes aside).
    `announced_step_s`: the decode step time the server's record implies (its blocks / its `inference_rps`; None when
    it announces none): the deadline of the first steps, and with `STALL_FACTOR` the most any deadline may grow to
    (steps that keep within 4x the last ones could otherwise raise it without bound). `announced_token_s`: a long
    step's time per token the record implies (`announced_token_s()`; None when it announces none).
    `charge_late(late_s, now_s)` after a step answered past its deadline; `late_left_s(now_s)` is what is left of
    `LATE_BUDGET_S` (times are `time.monotonic()`'s)."""

    def __init__(self, announced_step_s: float | None = None, announced_token_s: float | None = None) -> None:
        self._times_s: collections.deque[float] = collections.deque(maxlen=STEP_TIMES_KEPT)
        # (when answered, seconds) of every answered decode step, late ones too: what the span delivered
        self._delivered: collections.deque[tuple[float, float]] = collections.deque(maxlen=DELIVERED_KEPT)
        # seconds a row and token of its recent long steps (prompts, replays), late ones too (decision 0193)
        self._delivered_long: collections.deque[float] = collections.deque(maxlen=STEP_TIMES_KEPT)
        self._ceiling_s = STEP_MAX_S
        if announced_step_s is not None and math.isfinite(announced_step_s) and announced_step_s >= 0:
            self._ceiling_s = min(STEP_MAX_S, max(STALL_MIN_S, STALL_FACTOR * announced_step_s))
        self._token_s: float | None = None
        if announced_token_s is not None and math.isfinite(announced_token_s) and announced_token_s >= 0:
            self._token_s = announced_token_s
        self._late_s, self._late_at_s = 0.0, 0.0

    def record(self, num_tokens: int, elapsed_s: float) -> None:
        if 0 < num_tokens <= DECODE_MAX_TOKENS and elapsed_s >= 0:
            self._times_s.append(elapsed_s)

    def delivered(self, num_tokens: int, elapsed_s: float, answered_s: float, rows: int = 1) -> None:
        """After any answered step, late or not: its time per row and token counts in what the span delivers, a
        decode step's in `delivered_step_s`, a long step's (a prompt's, a replay's) in `delivered_token_s`."""
        if num_tokens <= 0 or not elapsed_s >= 0 or rows <= 0:
            return
        if num_tokens <= DECODE_MAX_TOKENS:
            self._delivered.append((answered_s, elapsed_s / (rows * num_tokens)))
        else:
            self._delivered_long.append(elapsed_s / (rows * num_tokens))

    def delivered_token_s(self, window: int) -> float | None:
        """What the span delivers on long steps now, in seconds a row and token: the mean of its last `window` (late
        ones included); None before the first (decision 0193: a server is judged on its long steps apart)."""
        if not self._delivered_long:
            return None
        times = list(self._delivered_long)[-window:]
        return math.fsum(times) / len(times)

    def delivered_step_s(self, min_steps: int, window_steps: int, window_s: float, now_s: float) -> float | None:
        """What the span delivers now, as a step of one row and token (decision 0189: judged against what another
        server would): the mean of the decode steps answered in the last `window_s` (the last `window_steps` where
        fewer; at most `DELIVERED_KEPT`), late ones included, less the slowest one (a hiccup); None with fewer than
        `min_steps` (at least 2); per row and token, so that a session of many rows or tokens a step is not judged
        against a one-token figure (decision 0201)."""
        steps = self._delivered
        times = [elapsed_s for answered_s, elapsed_s in steps if now_s - answered_s <= window_s]
        if len(times) < window_steps:
            times = [elapsed_s for _, elapsed_s in list(steps)[-window_steps:]]
        if len(times) < max(2, min_steps):
            return None
        return (math.fsum(times) - max(times)) / (len(times) - 1)

    def deadline_s(self, num_tokens: int, nbytes: int = 0) -> float:
        if num_tokens > DECODE_MAX_TOKENS:
            return self._long_deadline_s(num_tokens, nbytes)
        if not self._times_s:
            return self._ceiling_s
        return min(max(STALL_MIN_S, STALL_FACTOR * max(self._times_s)), self._ceiling_s)

    def _long_deadline_s(self, num_tokens: int, nbytes: int) -> float:
        """A prompt's or a replay's: 4x its tokens at the announced rate, never under the slowest decode step measured
        here (a long step costs at least one; a server announcing an absurd rate is held to what it showed) nor
        under the floor of its bytes, never over `STEP_MAX_S` (a server announcing a tiny rate, or none)."""
        floor_s = LONG_STEP_MIN_S + 2 * nbytes / SLOW_LINK_BYTES_PER_S
        if self._token_s is None and not self._times_s:
            return max(floor_s, STEP_MAX_S)
        estimate_s = max(num_tokens * (self._token_s or 0.0), max(self._times_s, default=0.0))
        return max(floor_s, min(STEP_MAX_S, STALL_FACTOR * estimate_s))

    def handoff_deadline_s(self, nbytes: int) -> float:
        """A KV hand-off of `nbytes`, either side (the import's first reply, decision 0162; the whole export, 0168):
        the bytes at `SLOW_LINK_BYTES_PER_S` plus a zero-token step's deadline."""
        return nbytes / SLOW_LINK_BYTES_PER_S + self.deadline_s(0)

    def late_left_s(self, now_s: float) -> float:
        leaked_s = LATE_LEAK * max(0.0, now_s - self._late_at_s)
        return LATE_BUDGET_S - max(0.0, self._late_s - leaked_s)

    def charge_late(self, late_s: float, now_s: float) -> None:
        self._late_s = LATE_BUDGET_S - self.late_left_s(now_s) + max(0.0, late_s)
        self._late_at_s = now_s
