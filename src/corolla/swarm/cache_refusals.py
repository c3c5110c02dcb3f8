"""A server out of KV cache refused a session: a fact about that server now, not a failure of the swarm. The client
avoids the server for `AVOID_S` (a fixed time, not the escalating ban of a failure), re-reads the records (fresher
free-cache figures: servers re-announce early, `swarm.early_announce`) and re-routes at once, up to
`IMMEDIATE_REROUTES` refusals in a row; only then does it back off as after a failure (the swarm looks full).
Pure: the real client (`client.calls.retries`, `client.routing.sequence_manager`) and `benchmarks.sim` apply the same rule (decision 0020)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from corolla.protocol.records import RemoteSpanInfo
from corolla.swarm.route_planning import covers
from corolla.utils.errors import AllocationFailed

AVOID_S = 15.0  # a full server is skipped this long (about the time for its early re-announcement to show room)
IMMEDIATE_REROUTES = 3  # refusals in a row re-routed with no delay; then the failure back-off schedule

# the texts servers send for a full cache: corolla's KV pool and hand-off promise (engine.kv.kv_pool), Petals'
# MemoryCache ("Could not allocate ... bytes"), and the exception's name where a server sends repr(error)
CACHE_REFUSAL_TEXTS = ("AllocationFailed", "KV pool is full", "KV cache is full", "Could not allocate")


def is_cache_refusal(error: BaseException) -> bool:
    """Whether `error` (raised by a server call, or wrapping one) says the server had no KV cache for the session."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:  # the refusal may be the cause of a transport error
        seen.add(id(current))
        if isinstance(current, AllocationFailed):
            return True
        text = str(current)
        if any(marker in text for marker in CACHE_REFUSAL_TEXTS):
            return True
        current = current.__cause__ or current.__context__
    return False


def reroute_delay_s(refusals_in_row: int, backoff_s: float) -> float:
    """The sleep before routing again after the `refusals_in_row`-th cache refusal in a row (1-based): none for the
    first `IMMEDIATE_REROUTES`, else `backoff_s` (the failure schedule's)."""
    return 0.0 if refusals_in_row <= IMMEDIATE_REROUTES else backoff_s


def may_avoid(
    spans: Sequence[RemoteSpanInfo],
    peer_id: str,
    num_blocks: int,
    client_rtts_s: Mapping[str, float],
    region_rtt_s: float | None,
) -> bool:
    """Whether the client may skip `peer_id` (refused for cache) for `AVOID_S`: where the other servers of `spans` (its
    view) still cover every block, and, for a policy that routes by region (`region_rtt_s`: the RTT bound of the
    client's region; None: the whole swarm), where its region still covers every block without it if it did with it.
    Else the session's next chain would leave its region for want of that one server, which is what it waits for
    (decision 0030)."""
    others = [span for span in spans if span.peer_id != peer_id]
    if not covers(others, 0, num_blocks):
        return False
    if region_rtt_s is None:
        return True
    near = [span for span in spans if client_rtts_s.get(span.peer_id, math.inf) <= region_rtt_s]
    return not covers(near, 0, num_blocks) or covers([s for s in near if s.peer_id != peer_id], 0, num_blocks)
