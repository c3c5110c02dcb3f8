"""The stream byte caps (`--max_stream_bytes_per_peer` / `--max_stream_bytes_total`: bytes of streamed requests
received and not yet processed) held per server when `--num_handlers` N > 1: the device process's core lends them to
the handler processes (`stream_loans`, a `PeerBytes` of bytes lent, per peer and in all, under the caps), and each
process spends its loans locally (`front.lent_stream_budget.LentStreamBudget`), so a message costs no round trip to
the core. A process short of a peer's loan borrows the shortfall before the message's payload is read (one call;
the core refuses as the front would, same reasons); it gives back what a peer did not use in the last
`LOAN_REBALANCE_S` (a note); the core takes back what a dead process held. The bytes lent never pass the caps, and
a process never holds more of a peer's bytes than it was lent: with any N, a peer spreading its streams over the
processes gets one cap, and the server one total. With N = 1 the one front counts alone (`StreamBudget`), as before."""

from __future__ import annotations

import asyncio
from typing import Protocol

from corolla.server.core.limits import PeerLimits
from corolla.server.core.peer_bytes import ByteCap, PeerBytes

# how often a handler process gives back what its peers did not use since the last time: a peer that stopped
# streaming holds its loan up to twice this long, during which another process may be refused early for that peer
# (or, at the total, for any peer); a process whose peer streams on keeps its loan (no round trip a message)
LOAN_REBALANCE_S = 0.5


def stream_caps(limits: PeerLimits) -> tuple[ByteCap, ByteCap]:
    """The per-peer and total caps of unfinished streamed bytes (the limits with their stream defaults set)."""
    return (
        ByteCap("max_stream_bytes_per_peer", limits.max_stream_bytes_per_peer, "peer_stream_bytes"),
        ByteCap("max_stream_bytes_total", limits.max_stream_bytes_total, "stream_bytes_full"),
    )


def stream_loans(limits: PeerLimits) -> PeerBytes:
    """The core's count of stream bytes lent to handler processes, under the stream caps (`take` refuses a loan past
    them as a front refuses a message: `PeerLimitExceeded` / `ServerLimitExceeded`, same reasons)."""
    return PeerBytes("stream message", "of unfinished requests", *stream_caps(limits))


class StreamLender(Protocol):
    """Where a handler process borrows stream bytes (`handlers.remote_core.RemoteCore`, over its channel)."""

    async def borrow_stream(self, peer: str, nbytes: int) -> None:
        """`nbytes` more of `peer`'s stream bytes lent to this process; the core's refusal raised, nothing lent."""
        ...

    def repay_stream(self, peer: str, nbytes: int) -> None:
        """`nbytes` of `peer`'s loan given back (a note: nothing waits)."""
        ...


class LoanShort(Exception):
    """A message of a peer needs `nbytes` more than this process was lent for it."""

    def __init__(self, nbytes: int):
        super().__init__(f"{nbytes} bytes short of the stream loan")
        self.nbytes = nbytes


class LoanPending(Exception):
    """A message's charge waits for a loan (`future`, done when the core answered): the frame's header is left
    unparsed, and the stream takes the frame again once the loan came (or is refused)."""

    def __init__(self, future: asyncio.Future[None]):
        super().__init__("a stream loan is pending")
        self.future = future
