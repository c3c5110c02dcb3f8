"""`RetryBudget`: the fail-over budget of one client call (an inference step, a forward or backward): bans the server
that failed, sleeps with back-off, and ends in `NoHonestServerError` after `ClientConfig.max_retries` failed attempts
or `max_wait_s` seconds. Some failures re-route without a ban: the only server of a block lost to the network
(retried every `SOLE_SERVER_RETRY_S`: a ban would hide the one server that can answer once its link is back), a
server out of KV cache, one too slow to keep a session (`ServerTooSlow`), one whose dtype cannot hold the inputs
(`InputsOutOfRange`) and one outvoted by witnesses without standing (`OutputsDisputed`, 0190)."""

from __future__ import annotations

import time
from collections.abc import Callable

from corolla.client.calls.output_checks import BadServerOutput, InputsOutOfRange, OutputsDisputed
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.swarm.cache_refusals import is_cache_refusal, reroute_delay_s
from corolla.swarm.route_planning import covers, find_missing_blocks
from corolla.utils.errors import MissingBlocksError, NoHonestServerError
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

SOLE_SERVER_RETRY_S = 1.0  # retry period while the only server of a block is unreachable (a link down, not a liar)
# a server whose announced dtype cannot hold a span's inputs is left out of routes this long (decision 0170)
RANGE_AVOID_S = 60.0


class ServerTooSlow(ConnectionError):
    """A server answered pings but its span's steps ran past their deadlines by the span's late budget
    (`client.session.stalls`) while another server holds its blocks: the session moves off it (replaying its history
    there), and it is avoided for a while, not banned (it failed nothing): the call re-routes at once."""

    def __init__(self, peer_id: str, message: str):
        self.peer_id = peer_id
        super().__init__(message)


class PushedReplyRejected(ConnectionError):
    """A reply failed a check where its server flagged it as the answer to the copy of the step pushed to it, and the
    client had named it to receive that push: the push, not the server, may be at fault (decision 0154). Neither is
    blamed; the span is replayed from the client's own inputs, and neither `upstream` nor `peer_id` is named for
    pushes for a while (`routing.push_suspects`, decision 0169)."""

    def __init__(self, peer_id: str, upstream: str | None, message: str):
        self.peer_id, self.upstream = peer_id, upstream
        super().__init__(message)


def has_alternative(manager: RemoteSequenceManager, peer_id: str, blocks: tuple[int, int]) -> bool:
    """True when servers other than `peer_id` (and not banned) cover every block of `[blocks[0], blocks[1])` in the
    client's current view."""
    unusable = manager.bans.banned_peers() | {peer_id}
    return covers([span for span in manager.spans if span.peer_id not in unusable], *blocks)


def blame(manager: RemoteSequenceManager, error: BaseException, peer_id: str | None, blocks: tuple[int, int]) -> bool:
    """Bans `peer_id` for `error` (None: refreshes the view), unless the error is the network's (not a bad output)
    and the peer is the only server of some of `blocks`; returns whether it banned."""
    if peer_id is not None and not isinstance(error, BadServerOutput) and not has_alternative(manager, peer_id, blocks):
        logger.info(
            "retry.sole_server_kept(peer=...%s, blocks=%d:%d, error=%r): not banned, retried every %.0f s",
            peer_id[-6:], blocks[0], blocks[1], error, SOLE_SERVER_RETRY_S,
        )  # fmt: skip
        manager.request_update()  # a replica that came online since the last read of the records may take over
        return False
    manager.on_request_failure(peer_id)
    return True


class RetryBudget:
    """Counts consecutive failures of one call; `on_success()` (progress) starts the count and the clock anew."""

    def __init__(self, manager: RemoteSequenceManager, *, clock: Callable[[], float] = time.monotonic):
        self.manager, self._clock = manager, clock
        self.attempt = 0
        self.failing_since_s: float | None = None
        self.tried: list[str] = []  # peers that failed during this run of failures, oldest first
        self.cache_refusals = 0  # of those failures, cache refusals in a row
        self.kept_sole_server = False  # the last failure was the network's, of the only server of some block
        self.left_s: float | None = None  # of `max_wait_s` after the last failure (None: no bound)

    def on_success(self) -> None:
        self.attempt, self.failing_since_s, self.cache_refusals = 0, None, 0
        self.tried.clear()

    def _uncovered(self, blocks: tuple[int, int]) -> list[int]:
        """The blocks of `blocks` that no server but the ones that failed covers in the current view (a dead sole
        server's record outlives it, and it is not banned for a network failure): all of them if every block has one."""
        others = [span for span in self.manager.spans if span.peer_id not in self.tried]
        return find_missing_blocks(others, *blocks) or list(range(*blocks))

    def on_failure(self, error: BaseException, peer_id: str | None, blocks: tuple[int, int]) -> float:
        """Bans `peer_id` (None: no server to blame, e.g. no route) and returns the sleep before the next attempt;
        raises NoHonestServerError (from `error`) when the budget is spent."""
        config = self.manager.config
        now = self._clock()
        if self.failing_since_s is None:
            self.failing_since_s = now
        self.attempt += 1
        if peer_id is not None and peer_id not in self.tried:
            self.tried.append(peer_id)
        refused = peer_id is not None and is_cache_refusal(error)
        self.cache_refusals = self.cache_refusals + 1 if refused else 0
        if refused and peer_id is not None:  # avoided for a while, not banned: it failed nothing
            self.manager.on_cache_refusal(peer_id)
        too_slow = isinstance(error, ServerTooSlow)  # avoided by the span session already: it failed nothing
        # inputs its dtype cannot hold were not sent to it: routed around where another server holds its blocks
        out_of_range = isinstance(error, InputsOutOfRange)
        routed_around = out_of_range and peer_id is not None and self.manager.avoid(peer_id, RANGE_AVOID_S)
        # (the push's fault, maybe; or outputs outvoted by witnesses short of standing: avoided already, 0190)
        unblamed = too_slow or out_of_range or isinstance(error, (PushedReplyRejected, OutputsDisputed))
        banned = refused or unblamed or blame(self.manager, error, peer_id, blocks)
        waited_s = now - self.failing_since_s
        out_of_time = config.max_wait_s is not None and waited_s >= config.max_wait_s
        if config.retries_exhausted(self.attempt) or out_of_time:
            missing = error.missing if isinstance(error, MissingBlocksError) else self._uncovered(blocks)
            raise NoHonestServerError(
                missing,
                tried=self.tried,
                banned=sorted(self.manager.bans.banned_peers()),
                waited_s=waited_s,
                last_error=self.manager.describe_missing(missing)
                if isinstance(error, MissingBlocksError)
                else f"{type(error).__name__}: {error}",
            ) from error
        if isinstance(error, MissingBlocksError):
            self.manager.request_update()
        delay_s = config.retry_delay_s(self.attempt - 1)
        if refused:
            delay_s = reroute_delay_s(self.cache_refusals, delay_s)
        if unblamed and (routed_around or not out_of_range):  # another server holds its blocks (it was checked),
            delay_s = 0.0  # or the span is replayed as it is: no wait (else the usual pace: no server fits now)
        self.kept_sole_server = not banned and peer_id is not None
        if self.kept_sole_server:
            delay_s = min(delay_s, SOLE_SERVER_RETRY_S)
        self.left_s = None if config.max_wait_s is None else config.max_wait_s - waited_s
        if self.left_s is not None:  # the last attempt happens at the deadline, not after it
            delay_s = min(delay_s, self.left_s)
        logger.warning(
            "retry.scheduled(blocks=%d:%d, attempt=%d, delay_s=%.1f, peer=...%s, error=%r)",
            blocks[0], blocks[1], self.attempt, delay_s, (peer_id or "?")[-6:], error,
        )  # fmt: skip
        return max(delay_s, 0.0)
