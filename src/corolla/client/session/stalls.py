"""Stall detection for one hop of a chain: `StepClock` keeps a span's recent decode step times and derives the
deadline after which a step's silence is suspect (a multiple of the slowest recent step, never under
`STALL_MIN_S`), instead of waiting for the fixed `request_timeout_s`; `StallEvent` records what the client then did
(the server answered a ping: slow, keep waiting; it did not: fail over, or wait when it is the only server)."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Literal

STALL_FACTOR = 4.0  # a step this many times slower than the span's slowest recent step is suspect
STALL_MIN_S = 1.0  # never suspect sooner: a busy CPU, a GC pause or a batch on the server can take this long
DECODE_MAX_TOKENS = 8  # steps sending more tokens (prefills, replays) are not timed: their cost grows with length
STEP_TIMES_KEPT = 16  # recent step times a deadline is derived from

StallAction = Literal["slow", "failed_over", "waited"]


@dataclass(frozen=True)
class StallEvent:
    """One suspected stall: the server, its blocks, how long the step had waited when the suspicion was checked, and
    the step deadline it had, and what the client did (`slow`: it answered a ping, so we kept waiting; `failed_over`: it did not and another
    server holds its blocks; `waited`: it did not and it is the only one, so we kept waiting for the link)."""

    peer_id: str
    blocks: tuple[int, int]
    detected_after_s: float
    step_deadline_s: float | None  # None: noticed by a liveness ping, not at a step deadline
    action: StallAction


class StepClock:
    """Per span session: `record(num_tokens, elapsed_s)` after each answered step that was never suspect;
    `deadline_s(num_tokens)` is how long the next step may stay silent before the client checks on the server
    (None: no estimate yet, or a long step: only the liveness pings and `request_timeout_s` apply)."""

    def __init__(self) -> None:
        self._times_s: collections.deque[float] = collections.deque(maxlen=STEP_TIMES_KEPT)

    def record(self, num_tokens: int, elapsed_s: float) -> None:
        if 0 < num_tokens <= DECODE_MAX_TOKENS and elapsed_s >= 0:
            self._times_s.append(elapsed_s)

    def deadline_s(self, num_tokens: int) -> float | None:
        if not self._times_s or num_tokens > DECODE_MAX_TOKENS:
            return None
        return max(STALL_MIN_S, STALL_FACTOR * max(self._times_s))
