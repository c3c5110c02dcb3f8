"""Stream bytes lent by the core to handler processes (`core.stream_loans`, `front.lent_stream_budget`): two
processes' budgets on one core's loans hold one peer to one cap and the server to one total, a message past its
loan borrows before it is counted (its refusal is the stream's, reasons unchanged), and a process gives back what
its peers did not use while keeping a streaming peer's loan."""

from __future__ import annotations

import asyncio
import gc

import pytest

from corolla.server.core.limits import PeerLimitExceeded, PeerLimits, ServerLimitExceeded
from corolla.server.core.peer_bytes import PeerBytes
from corolla.server.core.stream_loans import LoanPending, stream_loans
from corolla.server.front.lent_stream_budget import LentLease, LentStreamBudget

LIMITS = PeerLimits(max_stream_message_bytes=600, max_stream_bytes_per_peer=1000, max_stream_bytes_total=1500)


class Core:
    """The core's side of one handler process's channel (as `device_channel` lends), counting its calls."""

    def __init__(self, loans: PeerBytes):
        self.loans, self.lent, self.calls = loans, dict[str, int](), 0

    async def borrow_stream(self, peer: str, nbytes: int) -> None:
        self.calls += 1
        await asyncio.sleep(0)  # (a round trip)
        self.loans.take(peer, nbytes)
        self.lent[peer] = self.lent.get(peer, 0) + nbytes

    def repay_stream(self, peer: str, nbytes: int) -> None:
        self.lent[peer] -= nbytes
        self.loans.give_back(peer, nbytes)


async def charged(lease: LentLease, nbytes: int) -> None:
    """Charges as a stream does: the frame taken again once a pending loan is answered."""
    while True:
        try:
            lease.charge(nbytes)
            return
        except LoanPending as pending:
            await asyncio.wait((pending.future,))


def test_two_processes_hold_one_peer_to_one_cap_and_the_server_to_one_total():
    async def go() -> None:
        loans = stream_loans(LIMITS)
        one, two = (LentStreamBudget(LIMITS, Core(loans)) for _ in range(2))
        await charged(one.lease("a"), 600)
        with pytest.raises(PeerLimitExceeded, match="max_stream_bytes_per_peer") as refused:
            await charged(two.lease("a"), 600)  # (each process alone would take it)
        assert refused.value.reason == "peer_stream_bytes"
        await charged(two.lease("b"), 600)
        with pytest.raises(ServerLimitExceeded, match="max_stream_bytes_total") as full:
            await charged(one.lease("c"), 400)
        assert full.value.reason == "stream_bytes_full"
        assert loans.total_bytes == 1200 and one.total_bytes + two.total_bytes == 1200
        with pytest.raises(PeerLimitExceeded, match="max_stream_message_bytes"):
            await charged(one.lease("c"), 601)  # the message bound is each process's, as before

    asyncio.run(go())


def test_a_streaming_peer_keeps_its_loan_and_an_idle_one_gives_it_back():
    async def go() -> None:
        loans = stream_loans(LIMITS)
        core = Core(loans)
        budget = LentStreamBudget(LIMITS, core)
        steps, idle = budget.lease("a"), budget.lease("b")
        await charged(steps, 300)
        await charged(idle, 500)
        idle.close()
        assert core.calls == 2
        for _ in range(3):  # a step each period: released, then the next charged within the loan (no call)
            budget.rebalance()  # (as its timer does every LOAN_REBALANCE_S)
            steps.release(300)
            await charged(steps, 300)
        assert core.calls == 2 and loans.per_peer == {"a": 300}  # b's loan came back, a's stayed
        steps.close()
        budget.rebalance()
        budget.rebalance()
        assert loans.total_bytes == 0 and budget.lent == {} and core.lent == {"a": 0, "b": 0}

    asyncio.run(go())


def test_a_refused_loan_of_a_stream_that_ended_is_not_logged_as_a_lost_error():
    """A peer that closes its stream while the core refuses its message's loan: nobody takes the refusal again, and
    asyncio must not log it as a task exception never retrieved (an error and a traceback a hostile peer could
    repeat at will)."""

    async def ended() -> list[dict[str, object]]:
        lost: list[dict[str, object]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, context: lost.append(context))
        loans = stream_loans(LIMITS)
        loans.take("a", 1000)
        lease = LentStreamBudget(LIMITS, Core(loans)).lease("a")
        with pytest.raises(LoanPending) as pending:
            lease.charge(500)
        future = pending.value.future
        await asyncio.wait((future,))
        lease.close()  # the stream ended: its frame is never taken again
        del pending, future, lease
        gc.collect()
        return lost

    assert asyncio.run(ended()) == []
