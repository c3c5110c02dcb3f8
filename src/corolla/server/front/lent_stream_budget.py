"""A handler process's stream budget (`--num_handlers` N > 1): its peers' unfinished streamed bytes, spent from what the
core lent this process for each peer (`core.stream_loans`), so that the caps hold per server with no round trip per
message. A message past its peer's loan borrows the shortfall first (`LoanPending`); what a peer did not use is given
back every `LOAN_REBALANCE_S`, and at once what the core recalls (`recall`)."""

from __future__ import annotations

import asyncio

from corolla.server.core.limits import PeerLimits
from corolla.server.core.stream_loans import LOAN_REBALANCE_S, LoanPending, LoanShort, StreamLender
from corolla.server.front.stream_endpoint import StreamBudget, StreamLease


class LentLease(StreamLease):
    """A stream's lease in a `LentStreamBudget`: a charge past the peer's loan starts a borrow and raises
    `LoanPending`; the next charge (the same frame, taken again) raises the core's refusal if it came."""

    budget: LentStreamBudget
    pending: asyncio.Future[None] | None = None

    def charge(self, nbytes: int) -> None:
        pending, self.pending = self.pending, None
        if pending is not None and pending.done() and not pending.cancelled() and pending.exception() is not None:
            raise pending.exception()  # type: ignore[misc]  # (the core's refusal of this message)
        try:
            self.budget.charge(self.peer, nbytes)
        except LoanShort as short:
            self.pending = self.budget.borrow(self.peer, short.nbytes)
            raise LoanPending(self.pending) from None
        self.charged(nbytes)


class LentStreamBudget(StreamBudget):
    """`StreamBudget` whose per-peer bound is the peer's loan from the core (`lent`), the caps being the core's."""

    def __init__(self, limits: PeerLimits, lender: StreamLender):
        super().__init__(limits)
        self.lender = lender
        self.lent: dict[str, int] = {}  # bytes the core lent this process, by peer
        self.peak: dict[str, int] = {}  # the most each peer held here since the last rebalance
        self.borrowing: dict[str, int] = {}  # loans asked of the core and not answered yet, by peer
        self._rebalance: asyncio.TimerHandle | None = None
        lender.answer_recalls(self.recall)

    def lease(self, peer: str) -> LentLease:
        return LentLease(self, peer)

    def take(self, peer: str, nbytes: int) -> None:
        held = self.per_peer.get(peer, 0) + nbytes
        short = held - self.lent.get(peer, 0)
        if short > 0:
            raise LoanShort(short)
        self.per_peer[peer] = held
        self.total_bytes += nbytes
        if held > self.peak.get(peer, 0):
            self.peak[peer] = held

    def borrow(self, peer: str, nbytes: int) -> asyncio.Future[None]:
        """`nbytes` more of `peer`'s loan asked of the core; done (with the core's refusal, if any) once it answered."""
        borrowed = asyncio.ensure_future(self._borrow(peer, nbytes))
        borrowed.add_done_callback(_retrieved)  # a stream that ended meanwhile never takes the refusal again
        return borrowed

    async def _borrow(self, peer: str, nbytes: int) -> None:
        self.borrowing[peer] = self.borrowing.get(peer, 0) + 1
        try:
            await self.lender.borrow_stream(peer, nbytes)
        finally:
            if self.borrowing[peer] > 1:
                self.borrowing[peer] -= 1
            else:
                del self.borrowing[peer]
        self.lent[peer] = self.lent.get(peer, 0) + nbytes  # (before the stream waiting for it takes its frame again)
        if self._rebalance is None:
            self._rebalance = asyncio.get_running_loop().call_later(LOAN_REBALANCE_S, self.rebalance)

    def rebalance(self) -> None:
        """Gives back each peer's loan above the most it held since the last rebalance (and above what it holds)."""
        self._rebalance = None
        for peer, lent in list(self.lent.items()):
            held = self.per_peer.get(peer, 0)
            keep = max(self.peak.pop(peer, 0), held)
            if held:
                self.peak[peer] = held
            if lent > keep:
                self.lender.repay_stream(peer, lent - keep)
                if keep:
                    self.lent[peer] = keep
                else:
                    del self.lent[peer]
        if self.lent:
            self._rebalance = asyncio.get_running_loop().call_later(LOAN_REBALANCE_S, self.rebalance)

    def recall(self, peer: str, peer_bytes: int, any_bytes: int, reclaim_bytes: int = 0) -> None:
        """The core needs loans back for another stream: gives back up to `peer_bytes` of `peer`'s loan it does not
        hold, then what its other peers do not hold, up to `any_bytes` in all (`peer`'s counted), the largest idle
        loans first; short of `reclaim_bytes` (a peer within its share refused at the full total), cuts other peers'
        slow messages' streams for the rest (`reclaim`) and gives back their loans. A peer whose loan is being
        borrowed keeps it (its shortfall counted it as spent)."""
        given = self._give_others(self._give_idle(peer, peer_bytes), any_bytes)
        if given < reclaim_bytes and self.reclaim(reclaim_bytes - given, sparing=peer):
            self._give_others(given, any_bytes)

    def _give_others(self, given: int, any_bytes: int) -> int:
        """Gives back idle loans, the largest first, until `given` reaches `any_bytes`; the bytes given in all."""
        for other in sorted(self.lent, key=lambda p: self.per_peer.get(p, 0) - self.lent[p]):
            if given >= any_bytes:
                break
            given += self._give_idle(other, any_bytes - given)
        return given

    def _give_idle(self, peer: str, most: int) -> int:
        """Repays up to `most` of `peer`'s loan it does not hold (none while a borrow of `peer` is out); the bytes."""
        lent = self.lent.get(peer, 0)
        nbytes = min(most, lent - self.per_peer.get(peer, 0))
        if nbytes <= 0 or peer in self.borrowing:
            return 0
        self.lender.repay_stream(peer, nbytes)
        if lent > nbytes:
            self.lent[peer] = lent - nbytes
        else:
            del self.lent[peer]
        return nbytes


def _retrieved(borrowed: asyncio.Future[None]) -> None:
    """Marks a loan's refusal as seen: else asyncio logs it as an error lost with its traceback once the future is
    collected (a peer that closes its stream past its loan could have that logged at will)."""
    if not borrowed.cancelled():
        borrowed.exception()
