"""Stream bytes lent by the core to handler processes (`core.peer_bytes`: `StreamLoans`, `LentStreamBudget`): two
processes' budgets on one core's loans hold one peer to one cap and the server to one total, a message past its
loan borrows before it is counted (its refusal is the stream's, reasons unchanged), and a process gives back what
its peers did not use while keeping a streaming peer's loan."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from unittest import mock

import pytest

from corolla.server.core.limits import PeerLimitExceeded, PeerLimits, ServerLimitExceeded
from corolla.server.core.peer_bytes import RECALL_WAIT_MAX_S, LentStreamBudget, LoanPending, StreamLoans
from helpers.lent_streams import Core, charged

# a lone peer meets its own cap before the total's reserve (a message, decision 0187), as with the defaults
LIMITS = PeerLimits(max_stream_message_bytes=600, max_stream_bytes_per_peer=1000, max_stream_bytes_total=1600)


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
            await charged(one.lease("c"), 500)
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
        idle.close()  # b's 500 idle in two: 1500 of 1600 lent, 600 held
        await charged(one.lease("c"), 400)  # the total would refuse this without the recall
        # each process was asked for the shortfall (300) and gave it from its idle loans, a's in one, b's in two
        assert one.lent == {"a": 100, "c": 400} and two.lent == {"a": 600, "b": 200}
        assert loans.total_bytes == 1300 and loans.num_recalls == 2

    asyncio.run(go())


class PausedCore(Core):
    """A handler process whose loop is paused (a loaded host starves it): it is asked back its loans (`asked`) and
    answers only once the test lets it run again (`resumed`)."""

    def __init__(self, loans: StreamLoans):
        super().__init__(loans)
        self.asked, self.resumed = asyncio.Event(), asyncio.Event()

    async def recall_streams(self, peer: str, peer_bytes: int, any_bytes: int, reclaim_bytes: int) -> None:
        self.asked.set()
        await self.resumed.wait()
        await super().recall_streams(peer, peer_bytes, any_bytes, reclaim_bytes)


@pytest.mark.parametrize("pause_s", [30.0, RECALL_WAIT_MAX_S + 1.0])
def test_a_loan_idle_in_a_paused_process_is_waited_for_up_to_a_wedged_process_s_bound(pause_s: float):
    """The process holding a peer's idle loan answers the recall late, after `pause_s` of the loop's clock (skipped,
    not slept): within `RECALL_WAIT_MAX_S` the other process's loan waits for that answer and is lent, never refused
    for the pause (before 0252 a 3 s wait refused it: a peer whose streams follow each other, on a loaded host); past
    it the process is wedged and the loan is refused with the cap's reason, not kept waiting for good."""

    async def go() -> None:
        loop = asyncio.get_running_loop()
        clock, skipped = loop.time, [0.0]
        with mock.patch.object(loop, "time", lambda: clock() + skipped[0]):
            loans = StreamLoans(LIMITS)
            paused = PausedCore(loans)
            one, two = LentStreamBudget(LIMITS, paused), LentStreamBudget(LIMITS, Core(loans))
            done = one.lease("a")
            await charged(done, 600)
            done.close()  # a's stream in one ended: 600 of a lent there, idle
            follows = asyncio.ensure_future(charged(two.lease("a"), 600))
            await paused.asked.wait()
            skipped[0] += pause_s  # (every timer of the loop due by then comes due)
            for _ in range(20):
                await asyncio.sleep(0)
            if pause_s < RECALL_WAIT_MAX_S:
                assert not follows.done()  # still waiting for the paused process's answer
                paused.resumed.set()
                await asyncio.wait_for(follows, 5)
                assert one.lent == {"a": 400} and two.lent == {"a": 600} and loans.per_peer == {"a": 1000}
            else:
                with pytest.raises(PeerLimitExceeded, match="max_stream_bytes_per_peer"):
                    await asyncio.wait_for(follows, 5)
                assert two.lent == {} and loans.per_peer == {"a": 600}
                paused.resumed.set()

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
            await charged(two.lease("c"), 500)
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


# one peer alone may fill the total: its cap is the server's (as a server whose per-peer cap is its total)
WIDE = PeerLimits(max_stream_message_bytes=600, max_stream_bytes_per_peer=1500, max_stream_bytes_total=1500)


@pytest.mark.parametrize("streams_ended", [False, True])
def test_a_peer_within_its_share_borrows_without_a_recall_while_another_presses_the_total(streams_ended):
    """Decision 0187. A peer pressing the total (its streams held, or ended with their loans idle in another
    process) made every other peer's loan recall first (a round trip to each handler process) and, its bytes held,
    be refused after it: on main an honest 300-byte message after 3 x 500 of the presser's was refused after a recall
    (held) or lent after one (idle). Now the top message (600) of the total is kept for peers within their share: the
    presser is refused at 900 (the reason unchanged), and the honest message is lent with its one call."""

    async def go() -> None:
        loans = StreamLoans(WIDE)
        one, two = (LentStreamBudget(WIDE, core := Core(loans)) for _ in range(2))
        presses = [one.lease("p") for _ in range(3)]
        await charged(presses[0], 500)
        await charged(presses[1], 400)
        with pytest.raises(ServerLimitExceeded, match="less 600 bytes kept for peers within their share") as full:
            await charged(presses[2], 500)  # main took it: 1400 of 1500
        assert full.value.reason == "stream_bytes_full"
        if streams_ended:
            for press in presses:
                press.close()  # its loans idle in one until its rebalance
        recalls = loans.num_recalls
        honest = two.lease("h")
        await charged(honest, 300)
        assert loans.num_recalls == recalls and core.calls == 1  # its borrow, nothing else
        assert loans.per_peer["h"] == 300 and loans.total_bytes == 1200

    asyncio.run(go())


def test_a_lone_peer_keeps_the_reserve_and_peers_within_their_share_may_fill_it():
    """The reserve is kept from whoever is past its share (a lone peer: half the total), not from peers within it:
    two peers of 750 fill the total, a third then is refused as a full server (no reserve named)."""
    loans = StreamLoans(WIDE)
    loans.take("a", 900)  # up to the reserve: anyone
    with pytest.raises(ServerLimitExceeded, match="less 600 bytes kept"):
        loans.take("a", 1)  # past its share of 750, in the reserve
    loans.take("b", 600)  # within its share (750 of 2 peers)
    with pytest.raises(ServerLimitExceeded, match=r"max_stream_bytes_total=1500; retry later"):
        loans.take("c", 1)
    assert loans.total_bytes == 1500


@pytest.mark.parametrize("presser", [False, True])
def test_a_loan_is_taken_once_the_answers_so_far_freed_its_room_not_after_the_slowest_process(presser: bool):
    """Decision 0257 (review of 0252). A recall at the total asks every process holding any loan; one answers at once
    with room enough, another is paused (a loop a hostile peer keeps busy, or a loaded host). On main the borrower
    waited for the paused process's answer (up to `RECALL_WAIT_MAX_S`, 60 s) though the room was there, and meanwhile
    that room was anyone's: another peer's message (`presser`, within the caps: no recall) took it, and the honest
    borrower was refused once the paused process answered. Now the loan is taken as soon as the answers so far
    freed its room; the paused process's answer is not waited for."""

    async def go() -> None:
        loans = StreamLoans(LIMITS)
        paused = PausedCore(loans)
        one, slow, two = (LentStreamBudget(LIMITS, core) for core in (Core(loans), paused, Core(loans)))
        for budget, peer, nbytes in ((one, "b", 600), (slow, "c", 400)):
            ended = budget.lease(peer)
            await charged(ended, nbytes)
            ended.close()  # idle there until its rebalance
        await charged(two.lease("d"), 500)  # held: 1500 of 1600 lent
        honest = asyncio.ensure_future(charged(two.lease("h"), 500))  # 400 short of the total: a recall
        await paused.asked.wait()
        for _ in range(20):  # (the quick process's answer, not the paused one's)
            await asyncio.sleep(0)
        # another peer's message within the caps takes whatever room is free, with no recall (main: the room freed
        # for the borrower); now it finds the total full and waits for a recall of its own
        presses = asyncio.ensure_future(charged(one.lease("q"), 500) if presser else asyncio.sleep(0))
        for _ in range(20):
            await asyncio.sleep(0)
        assert honest.done(), "the borrower waits for the paused process though its room came back"
        paused.resumed.set()
        await asyncio.wait_for(honest, 5)  # lent, not refused
        with contextlib.suppress(ServerLimitExceeded):
            await asyncio.wait_for(presses, 5)
        assert loans.per_peer["h"] == 500 and loans.total_bytes <= 1600

    asyncio.run(go())
