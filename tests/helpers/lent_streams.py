"""The core's side of a handler process's stream loans, for tests of `LentStreamBudget` (`test_stream_loans`,
`test_stream_reclaim`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from corolla.server.core.peer_bytes import LentLease, LoanPending, StreamLoans


class Core:
    """The core's side of one handler process's channel (as `device_channel` lends and recalls), counting its
    calls."""

    def __init__(self, loans: StreamLoans):
        self.loans, self.calls = loans, 0
        self.give_back: Callable[[str, int, int, int], None] | None = None

    async def borrow_stream(self, peer: str, nbytes: int) -> None:
        self.calls += 1
        await asyncio.sleep(0)  # (a round trip)
        await self.loans.lend(self, peer, nbytes)

    def repay_stream(self, peer: str, nbytes: int) -> None:
        self.loans.repay(self, peer, nbytes)

    def answer_recalls(self, give_back: Callable[[str, int, int, int], None]) -> None:
        self.give_back = give_back

    async def recall_streams(self, peer: str, peer_bytes: int, any_bytes: int, reclaim_bytes: int) -> None:
        await asyncio.sleep(0)  # (the note there, the answer back)
        assert self.give_back is not None
        self.give_back(peer, peer_bytes, any_bytes, reclaim_bytes)


async def charged(lease: LentLease, nbytes: int) -> None:
    """Charges as a stream does: the frame taken again once a pending loan is answered."""
    while True:
        try:
            lease.charge(nbytes)
            return
        except LoanPending as pending:
            await asyncio.wait((pending.future,))
