"""The core's count of the stream bytes lent to handler processes (`--num_handlers` N > 1; decisions 0161, 0167): each
process reads its peers' messages within what the core lent it for each peer (`front.lent_stream_budget`), so that the
per-peer and total stream caps hold per server. A loan past a cap first recalls the other processes' idle loans (and,
for a peer within its share, their slow messages' streams: decision 0212); a process never holds more of a peer's
bytes than it was lent."""

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
# the longest a loan past the caps waits for the processes asked to give back their idle loans: a paused loop answers
# within seconds however loaded the host (decision 0252: no shorter clock), a process whose loop has not run for a
# minute is wedged, and the peer is refused as if nobody held anything to give back, not kept waiting for good
RECALL_WAIT_MAX_S = 60.0


def stream_caps(limits: PeerLimits) -> tuple[ByteCap, ByteCap]:
    """The per-peer and total caps of unfinished streamed bytes (the limits with their stream defaults set). The
    total keeps one message's bytes (at most half of it) for peers within their fair share (decision 0187), so an
    honest peer's message finds room at once instead of waiting for a recall of another's idle loans."""
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
        counted before), or once it ended (what it held given back: `StreamLoans.forget`)."""
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
                self.take(peer, nbytes)  # refused again: every process asked uses what it holds
        loans = self.holders.setdefault(holder, {})
        loans[peer] = loans.get(peer, 0) + nbytes

    async def _recall(self, borrower: LoanHolder, peer: str, nbytes: int) -> bool:
        """Asks back the idle loans that stand between `peer`'s loan of `nbytes` and the caps, and takes the loan as
        soon as the answers so far freed its room (True); False: nobody holds any that could (at once), or every
        process answered and the room is still short, or the wedged process's bound passed."""
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
        recalls = {asyncio.ensure_future(ask) for ask in asks}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RECALL_WAIT_MAX_S
        try:
            # the answers up to a wedged process's bound: a process answers as soon as its loop runs, or ends (and
            # its loans come back); a 3 s clock here refused a peer whose streams follow each other when a loaded
            # host paused the idle loan's process past it (decision 0252). The loan is taken at the first answer
            # that makes room: waiting for the slowest process left the room freed by the others to anyone's next
            # message meanwhile, and the borrower refused at the end (decision 0257)
            while recalls:
                answered, recalls = await asyncio.wait(
                    recalls, timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED
                )
                if not answered:
                    return False
                if self._taken(peer, nbytes):
                    return True
        finally:
            for recall in recalls:  # (taken, past the bound, or the borrower gone: nobody waits for the rest)
                recall.cancel()
        return False

    def _taken(self, peer: str, nbytes: int) -> bool:
        """Takes `peer`'s `nbytes` if the caps let them in now (no refusal raised)."""
        try:
            self.take(peer, nbytes)
        except (PeerLimitExceeded, ServerLimitExceeded):
            return False
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
