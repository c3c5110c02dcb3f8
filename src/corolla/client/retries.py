"""`RetryBudget`: the fail-over budget of one client call (an inference step, a forward or backward): bans the server
that failed, sleeps with back-off, and ends in `NoHonestServerError` (naming the blocks and the servers tried and
banned) once `ClientConfig.max_retries` failed attempts or `max_wait_s` seconds of failing have passed."""

from __future__ import annotations

import time
from collections.abc import Callable

from corolla.client.routing import RemoteSequenceManager
from corolla.utils.errors import MissingBlocksError, NoHonestServerError
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class RetryBudget:
    """Counts consecutive failures of one call; `on_success()` (progress) starts the count and the clock anew."""

    def __init__(self, manager: RemoteSequenceManager, *, clock: Callable[[], float] = time.monotonic):
        self.manager, self._clock = manager, clock
        self.attempt = 0
        self.failing_since_s: float | None = None
        self.tried: list[str] = []  # peers that failed during this run of failures, oldest first

    def on_success(self) -> None:
        self.attempt, self.failing_since_s = 0, None
        self.tried.clear()

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
        self.manager.on_request_failure(peer_id)
        waited_s = now - self.failing_since_s
        out_of_time = config.max_wait_s is not None and waited_s >= config.max_wait_s
        if config.retries_exhausted(self.attempt) or out_of_time:
            missing = error.missing if isinstance(error, MissingBlocksError) else list(range(*blocks))
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
        if config.max_wait_s is not None:  # the last attempt happens at the deadline, not after it
            delay_s = min(delay_s, config.max_wait_s - waited_s)
        logger.warning(
            "retry.scheduled(blocks=%d:%d, attempt=%d, delay_s=%.1f, peer=...%s, error=%r)",
            blocks[0],
            blocks[1],
            self.attempt,
            delay_s,
            (peer_id or "?")[-6:],
            error,
        )
        return max(delay_s, 0.0)
