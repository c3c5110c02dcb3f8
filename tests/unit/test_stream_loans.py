"""Stream bytes lent by the core to handler processes (`core.stream_loans`, `front.lent_stream_budget`): two
processes' budgets on one core's loans hold one peer to one cap and the server to one total, a message past its
loan borrows before it is counted (its refusal is the stream's, reasons unchanged), and a process gives back what
its peers did not use while keeping a streaming peer's loan."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable

import pytest

from corolla.server.core.limits import PeerLimitExceeded, PeerLimits, ServerLimitExceeded
from corolla.server.core.stream_loans import LoanPending, StreamLoans
from corolla.server.front.lent_stream_budget import LentLease, LentStreamBudget

LIMITS = PeerLimits(max_stream_message_bytes=600, max_stream_bytes_per_peer=1000, max_stream_bytes_total=1500)


class Core:
    """The core's side of one handler process's channel (as `device_channel` lends and recalls), counting its
    calls."""

    def __init__(self, loans: StreamLoans):
        self.loans, self.calls = loans, 0
        self.give_back: Callable[[str, int, int], None] | None = None

    async def borrow_stream(self, peer: str, nbytes: int) -> None:
        self.calls += 1
        await asyncio.sleep(0)  # (a round trip)
        await self.loans.lend(self, peer, nbytes)

    def repay_stream(self, peer: str, nbytes: int) -> None:
        self.loans.repay(self, peer, nbytes)

    def answer_recalls(self, give_back: Callable[[str, int, int], None]) -> None:
        self.give_back = give_back

    async def recall_streams(self, peer: str, peer_bytes: int, any_bytes: int) -> None:
        await asyncio.sleep(0)  # (the note there, the answer back)
        assert self.give_back is not None
        self.give_back(peer, peer_bytes, any_bytes)


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
        loans = StreamLoans(LIMITS)
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
        loans = StreamLoans(LIMITS)
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
        assert loans.total_bytes == 0 and budget.lent == {} and loans.holders == {core: {}}

    asyncio.run(go())


def test_a_loan_idle_in_one_process_is_recalled_before_another_process_is_refused():
    """A peer's loan idle in one process (its stream ended, the rebalance not come yet) is taken back when another
    process needs it: nothing refused while the server holds room (decision 0161 refused here for up to ~1 s)."""

    async def go() -> None:
        loans = StreamLoans(LIMITS)
        one, two = (LentStreamBudget(LIMITS, Core(loans)) for _ in range(2))
        done = one.lease("a")
        await charged(done, 600)
        done.close()  # a's stream in one ended: 600 of a lent there, none held
        await charged(two.lease("a"), 600)  # the per-peer cap (1000) would refuse this without the recall
        # one gave back its shortfall only (200 of its 400 idle stay lent there)
        assert one.lent == {"a": 400} and two.lent == {"a": 600} and loans.per_peer == {"a": 1000}
        idle = two.lease("b")
        await charged(idle, 500)
        idle.close()  # b's 500 idle in two: 1500 of 1500 lent, 600 held
        await charged(one.lease("c"), 300)  # the total would refuse this without the recall
        # each process was asked for the shortfall (300) and gave it from its idle loans, a's in one, b's in two
        assert one.lent == {"a": 100, "c": 300} and two.lent == {"a": 600, "b": 200}
        assert loans.total_bytes == 1200 and loans.num_recalls == 2

    asyncio.run(go())


def test_a_server_at_its_caps_still_refuses_after_the_recall_with_the_same_reasons():
    """What a process holds is not recalled: a peer (or the server) at its cap is refused as before, and a borrow
    in flight keeps its peer's loan."""

    async def go() -> None:
        loans = StreamLoans(LIMITS)
        one, two = (LentStreamBudget(LIMITS, Core(loans)) for _ in range(2))
        await charged(one.lease("a"), 600)
        with pytest.raises(PeerLimitExceeded, match="max_stream_bytes_per_peer") as refused:
            await charged(two.lease("a"), 600)
        assert refused.value.reason == "peer_stream_bytes" and loans.num_recalls == 1
        await charged(one.lease("b"), 600)
        with pytest.raises(ServerLimitExceeded, match="max_stream_bytes_total") as full:
            await charged(two.lease("c"), 400)
        assert full.value.reason == "stream_bytes_full" and loans.num_recalls == 2
        assert one.lent == {"a": 600, "b": 600} and loans.total_bytes == 1200
        one.borrowing["a"] = 1  # (a borrow of a's in flight there)
        one.per_peer["a"] = 0
        one.recall("a", 600, 600)
        assert one.lent["a"] == 600  # its shortfall counted that loan as spent

    asyncio.run(go())


def test_a_refused_loan_of_a_stream_that_ended_is_not_logged_as_a_lost_error():
    """A peer that closes its stream while the core refuses its message's loan: nobody takes the refusal again, and
    asyncio must not log it as a task exception never retrieved (an error and a traceback a hostile peer could
    repeat at will)."""

    async def ended() -> list[dict[str, object]]:
        lost: list[dict[str, object]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, context: lost.append(context))
        loans = StreamLoans(LIMITS)
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
