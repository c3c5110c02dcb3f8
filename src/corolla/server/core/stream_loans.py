"""The stream byte caps (`--max_stream_bytes_per_peer` / `--max_stream_bytes_total`: bytes of streamed requests
received and not yet processed) held per server when `--num_handlers` N > 1: the device process's core lends them to
the handler processes (`stream_loans`, a `PeerBytes` of bytes lent, per peer and in all, under the caps), and each
process spends its loans locally (`front.lent_stream_budget.LentStreamBudget`), so a message costs no round trip to
the core. A process short of a peer's loan borrows the shortfall before the message's payload is read (one call;
the core refuses as the front would, same reasons); it gives back what a peer did not use in the last
`LOAN_REBALANCE_S` (a note); the core takes back what a dead process held. A loan the core would refuse first recalls
what the other processes hold idle (`StreamLoans.lend`: a note to each, answered once they gave back their idle
loans, at most `RECALL_WAIT_S`), so a loan idle in one process never refuses a peer in another while the server's
count has room; a loan of a peer within its fair share still short at the total also has the processes cut their
slow messages' streams (`reclaim_bytes`, decision 0212: cheap identities each within their share filled 0187's reserve);
the refusal (same reasons) stands only when neither frees room. The bytes lent never pass the caps, and
a process never holds more of a peer's bytes than it was lent: with any N, a peer spreading its streams over the
processes gets one cap, and the server one total. With N = 1 the one front counts alone (`StreamBudget`), as before."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from corolla.server.core.limits import PeerLimitExceeded, PeerLimits, ServerLimitExceeded
from corolla.server.core.peer_bytes import ByteCap, PeerBytes

# how often a handler process gives back what its peers did not use since the last time: a peer that stopped
# streaming holds its loan up to twice this long unless another process needs it (a recall); a process whose peer
# streams on keeps its loan (no round trip a message)
LOAN_REBALANCE_S = 0.5
# how long a loan past the caps waits for the other processes to give back their idle loans (a recall) before it is
# refused: a process that answers late (its loop or the core's paused by a full collection or a starved CPU, 1-2 s
# seen on a loaded 2-core host) costs the borrower this wait, not a refusal it would not have had (decision 0227:
# 2 rebalances, 1 s, refused 2 of 6 runs of a peer's back-to-back streams under such pauses, 6 rebalances none)
RECALL_WAIT_S = 6 * LOAN_REBALANCE_S


def stream_caps(limits: PeerLimits) -> tuple[ByteCap, ByteCap]:
    """The per-peer and total caps of unfinished streamed bytes (the limits with their stream defaults set). The
    total keeps one message's bytes (at most half of it) for peers within their fair share (decision 0187): a peer
    past its share is refused that much below the total, so an honest peer's message finds room at once instead of
    waiting for the recall of another's idle loans (`StreamLoans.lend`: a round trip to every handler process) or
    being refused for another's held bytes. The defaults (per peer 2 messages or 96 MiB, in all 3 or 128 MiB) make
    a lone peer meet its own cap first."""
    total = limits.max_stream_bytes_total
    reserve = min(limits.max_stream_message_bytes or 0, total // 2) if total else 0
    return (
        ByteCap("max_stream_bytes_per_peer", limits.max_stream_bytes_per_peer, "peer_stream_bytes"),
        ByteCap("max_stream_bytes_total", total, "stream_bytes_full", reserve),
    )


class LoanHolder(Protocol):
    """A handler process as the core lends to it (`handlers.device_channel.DeviceChannel`, over its channel)."""

    async def recall_streams(self, peer: str, peer_bytes: int, any_bytes: int, reclaim_bytes: int) -> None:
        """Asks the process to give back up to `peer_bytes` of `peer`'s loan it does not use, then its other idle
        loans up to `any_bytes` in all (`peer`'s counted), then, short of `reclaim_bytes`, the loans of other peers'
        streams it cuts for their slow messages (`StreamBudget.reclaim`); returns once it answered (its repayments
        counted before)."""
        ...


class StreamLoans(PeerBytes):
    """The core's count of stream bytes lent to handler processes, under the stream caps (`take` refuses a loan past
    them as a front refuses a message: `PeerLimitExceeded` / `ServerLimitExceeded`, same reasons), and what each
    process holds (`lend`, `repay`, `forget`)."""

    def __init__(self, limits: PeerLimits):
        super().__init__("stream message", "of unfinished requests", *stream_caps(limits))
        self.holders: dict[LoanHolder, dict[str, int]] = {}  # what each process was lent, by peer
        self.num_recalls = 0  # loans that had to recall idle loans first (a metric for tests and benches)

    async def lend(self, holder: LoanHolder, peer: str, nbytes: int) -> None:
        """`nbytes` more of `peer`'s bytes lent to `holder`. Past a cap, the idle loans of the other processes (of
        `peer`; at the total, of any peer and the borrower's other peers too) are recalled first, then the loan is
        taken or refused (the caps' refusal, reasons unchanged: the server really holds that much)."""
        try:
            self.take(peer, nbytes)
        except (PeerLimitExceeded, ServerLimitExceeded):
            if not await self._recall(holder, peer, nbytes):
                raise
            self.take(peer, nbytes)  # refused again: every process uses what it holds
        loans = self.holders.setdefault(holder, {})
        loans[peer] = loans.get(peer, 0) + nbytes

    async def _recall(self, borrower: LoanHolder, peer: str, nbytes: int) -> bool:
        """Asks back the idle loans that stand between `peer`'s loan of `nbytes` and the caps; False: nobody holds
        any that could (refused at once)."""
        per_peer_cap, total_cap = self.per_peer_cap.limit_bytes, self.total_limit_bytes(peer, nbytes)
        peer_short = max(0, self.per_peer.get(peer, 0) + nbytes - per_peer_cap) if per_peer_cap else 0
        total_short = max(0, self.total_bytes + nbytes - total_cap) if total_cap else 0
        # the full total refuses a peer within its share: slow messages' streams may be cut for it (decision 0212)
        reclaim_bytes = total_short if total_short and self.within_share(peer, nbytes) else 0
        asks: list[Awaitable[None]] = []
        for holder, loans in self.holders.items():
            # the borrower's own loan of `peer` is in its shortfall already: only its other peers' count
            peer_bytes = peer_short if holder is not borrower and loans.get(peer) else 0
            any_bytes = total_short if any(p != peer or holder is not borrower for p in loans) else 0
            if peer_bytes or any_bytes:
                asks.append(holder.recall_streams(peer, peer_bytes, any_bytes, reclaim_bytes))
        if not asks:
            return False
        self.num_recalls += 1
        recalls = [asyncio.ensure_future(ask) for ask in asks]
        try:
            await asyncio.wait(recalls, timeout=RECALL_WAIT_S)
        finally:
            for recall in recalls:  # (late, or the borrower gone meanwhile: nobody waits for them)
                recall.cancel()
        return True

    def repay(self, holder: LoanHolder, peer: str, nbytes: int) -> None:
        """`holder` gives back `nbytes` of `peer`'s loan (at most what it was lent)."""
        loans = self.holders.get(holder, {})
        nbytes = min(nbytes, loans.get(peer, 0))
        if nbytes <= 0:
            return
        left = loans[peer] - nbytes
        if left:
            loans[peer] = left
        else:
            del loans[peer]
        self.give_back(peer, nbytes)

    def forget(self, holder: LoanHolder) -> None:
        """A process that ended: everything it was lent comes back (it gives nothing back itself)."""
        for peer, nbytes in list(self.holders.pop(holder, {}).items()):
            self.give_back(peer, nbytes)


class StreamLender(Protocol):
    """Where a handler process borrows stream bytes (`handlers.remote_core.RemoteCore`, over its channel)."""

    async def borrow_stream(self, peer: str, nbytes: int) -> None:
        """`nbytes` more of `peer`'s stream bytes lent to this process; the core's refusal raised, nothing lent."""
        ...

    def repay_stream(self, peer: str, nbytes: int) -> None:
        """`nbytes` of `peer`'s loan given back (a note: nothing waits)."""
        ...

    def answer_recalls(self, give_back: Callable[[str, int, int, int], None]) -> None:
        """From now on the core's recalls call `give_back(peer, peer_bytes, any_bytes, reclaim_bytes)`
        (`LoanHolder.recall_streams`: it repays what it gives back, and the core learns it answered once it
        returned)."""
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
