"""The byte budgets of what peers have a server hold, each counted per peer and in all under a cap (`PeerBytes`): the
streamed requests received and not yet processed (the stream budget) and the KV hand-off imports in flight
(`import_budget`). A peer past its share is refused as a peer (`PeerLimitExceeded`), any peer past the server's total
as a full server (`ServerLimitExceeded`: retry later); either way nothing is taken.

The stream budget, whole: its caps (`stream_caps`: the total keeps its top message for peers within their fair share,
decisions 0187, 0228); a front's budget (`StreamBudget`), where each remote peer's stream holds a `StreamLease`, charged
with every message's declared length before its payload is read and released once the handler took the next message
(kept per message: decisions 0181, 0212), and where a peer within its share that finds the total full takes the room
of slow messages (`StreamBudget.reclaim`, decision 0212); with handler processes (`--num_handlers` N > 1), a process's
budget spent from what the core lent it for each peer (`LentStreamBudget`, no round trip per message) and the core's
count of those loans under the caps (`StreamLoans`), which recalls idle loans before it refuses one (decisions 0161,
0167, 0252, 0257). Event loop only."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from corolla.server.core.limits import MiB, PeerLimitExceeded, PeerLimits, ServerLimitExceeded
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


TRIM_AFTER_BYTES = 16 * MiB  # give freed stream buffers back to the OS (glibc keeps them otherwise)
TRIM_DELAY_S = 0.5
# a message whose payload is still arriving this long after its declared length was charged is slow (`reclaim`): a
# decode step's arrives within a round trip, one at the minimum rate (`min_stream_rate_kib_s`) may take hours
RECLAIM_AFTER_S = 1.0
# how often a handler process gives back what its peers did not use since the last time: a peer that stopped
# streaming holds its loan up to twice this long unless another process needs it (a recall); a process whose peer
# streams on keeps its loan (no round trip a message)
LOAN_REBALANCE_S = 0.5
# the longest a loan past the caps waits for the processes asked to give back their idle loans: a paused loop answers
# within seconds however loaded the host (decision 0252: no shorter clock), a process whose loop has not run for a
# minute is wedged, and the peer is refused as if nobody held anything to give back, not kept waiting for good
RECALL_WAIT_MAX_S = 60.0


@dataclass(frozen=True)
class ByteCap:
    """One cap: the `PeerLimits` field it comes from (named in the refusal), its bytes (0 or None: none), and the
    refusal's reason (a metrics label)."""

    name: str
    limit_bytes: int | None
    reason: str
    # the top of the cap that a peer holding more than its fair share (`PeerBytes.within_share`) may not take: the
    # others' room, kept free of one peer's pressure (0: none)
    reserve_bytes: int = 0


class PeerBytes:
    """`take(peer, nbytes)` counts bytes or refuses them, `give_back` returns them, `hold` does both around a block
    (event loop only). `what` and `held_as` word the refusals: "{what} of N bytes refused: this peer already holds M
    bytes {held_as}, ..."."""

    def __init__(self, what: str, held_as: str, per_peer: ByteCap, total: ByteCap):
        self.what, self.held_as = what, held_as
        self.per_peer_cap, self.total_cap = per_peer, total
        self.total_bytes = 0
        self.per_peer: dict[str, int] = {}

    def take(self, peer: str, nbytes: int) -> None:
        held = self.per_peer.get(peer, 0)
        cap = self.per_peer_cap
        if cap.limit_bytes and held + nbytes > cap.limit_bytes:
            raise PeerLimitExceeded(
                f"{self.what} of {nbytes} bytes refused: this peer already holds {held} bytes {self.held_as}, the "
                f"limit is {cap.name}={cap.limit_bytes}",
                reason=cap.reason,
            )
        cap = self.total_cap
        limit_bytes = self.total_limit_bytes(peer, nbytes)
        if limit_bytes and self.total_bytes + nbytes > limit_bytes:
            kept = cap.limit_bytes - limit_bytes if cap.limit_bytes else 0
            raise ServerLimitExceeded(
                f"{self.what} of {nbytes} bytes refused: the server holds {self.total_bytes} bytes {self.held_as}, "
                f"the limit is {cap.name}={cap.limit_bytes}"
                + (f" less {kept} bytes kept for peers within their share (this one holds {held})" if kept else "")
                + "; retry later",
                reason=cap.reason,
            )
        self.per_peer[peer] = held + nbytes
        self.total_bytes += nbytes

    def total_limit_bytes(self, peer: str, nbytes: int) -> int | None:
        """The total that `nbytes` more of `peer`'s may not pass: the total cap, less its reserve where they would
        take the total into it and `peer` past its fair share (`within_share`: a lone peer keeps the reserve for the
        next)."""
        cap = self.total_cap
        limit_bytes = cap.limit_bytes
        if not limit_bytes or not cap.reserve_bytes or self.total_bytes + nbytes <= limit_bytes - cap.reserve_bytes:
            return limit_bytes
        return limit_bytes if self.within_share(peer, nbytes) else limit_bytes - cap.reserve_bytes

    def within_share(self, peer: str, nbytes: int) -> bool:
        """Whether `peer` with `nbytes` more holds at most its fair share of the total cap: the cap over the peers
        holding any, itself counted, at least 2, and never less than the reserve (a message, so that cheap identities
        cannot shrink a user's share below one message: decision 0228)."""
        cap = self.total_cap
        peers = len(self.per_peer) + (peer not in self.per_peer)
        share = max((cap.limit_bytes or 0) // max(2, peers), cap.reserve_bytes)
        return self.per_peer.get(peer, 0) + nbytes <= share

    def give_back(self, peer: str, nbytes: int) -> None:
        left = self.per_peer.get(peer, 0) - nbytes
        assert left >= 0 and self.total_bytes >= nbytes, f"{self.what}: gave back more than was taken"
        if left:
            self.per_peer[peer] = left
        else:
            self.per_peer.pop(peer, None)
        self.total_bytes -= nbytes

    @contextlib.contextmanager
    def hold(self, peer: str, nbytes: int) -> Iterator[None]:
        """`take` on entry (refused: nothing held), `give_back` on exit however the block ends."""
        self.take(peer, nbytes)
        try:
            yield
        finally:
            self.give_back(peer, nbytes)


def import_budget(limits: PeerLimits) -> PeerBytes:
    """The KV hand-off imports in flight on the server, every front's (`SpanCore.hold_import`): an import's parts are
    held in host memory until its cache is written, past the stream budget, so these caps bound them; past either an
    import is refused at its header, before any part is read (the client tries another replacement or replays)."""
    return PeerBytes(
        "KV import",
        "of imports in flight",
        ByteCap("max_import_bytes_per_peer", limits.max_import_bytes_per_peer, "peer_import_bytes"),
        ByteCap("max_import_bytes_total", limits.max_import_bytes_total, "import_bytes_full"),
    )


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


class StreamBudget(PeerBytes):
    """Bytes of streamed requests received and not yet processed: per peer and in total (event loop only), and each
    message within `max_stream_message_bytes` (`--num_handlers` 1; a handler process spends what the core lent it:
    `LentStreamBudget`). A message refused at the total although its peer is within its fair share takes the room of
    slow messages (`reclaim`): peer ids cost nothing, so a hoarder is told by its pace (decision 0212)."""

    def __init__(self, limits: PeerLimits):
        super().__init__("stream message", "of unfinished requests", *stream_caps(limits))
        self.limits = limits
        self._freed_since_trim = 0
        self.leases: weakref.WeakSet[StreamLease] = weakref.WeakSet()  # the streams' leases (what `reclaim` cuts)
        self.num_reclaimed = 0  # streams cut by `reclaim` (a metric for tests and benches)

    def lease(self, peer: str) -> StreamLease:
        """A new stream's lease of `peer`'s bytes in this budget."""
        return StreamLease(self, peer)

    def reclaim(self, nbytes: int, *, sparing: str) -> int:
        """Cuts the streams of peers other than `sparing` whose message has been arriving for `RECLAIM_AFTER_S` or
        more (their bytes given back at once), those of the peers holding most first, then the oldest, until `nbytes`
        are free; cuts none where all of them would not free that much. Returns the bytes freed."""
        now = time.monotonic()
        slow = [lease for lease in self.leases if lease.peer != sparing and lease.slow_since(now, RECLAIM_AFTER_S)]
        if sum(lease.held for lease in slow) < nbytes:
            return 0
        slow.sort(key=lambda lease: (-self.per_peer.get(lease.peer, 0), lease.charged_at))
        freed = 0
        for lease in slow:
            if freed >= nbytes:
                break
            freed += lease.held
            logger.info(
                "stream_budget.reclaimed(peer=...%s, bytes=%d, arriving_s=%.1f)",
                lease.peer[-6:], lease.held, now - lease.charged_at,
            )  # fmt: skip
            lease.cut()
            self.num_reclaimed += 1
        return freed

    def charge(self, peer: str, nbytes: int) -> None:
        if nbytes <= 0:
            return  # an empty message (e.g. the end of a session) holds nothing
        max_message_bytes = self.limits.max_stream_message_bytes
        if max_message_bytes and nbytes > max_message_bytes:
            raise PeerLimitExceeded(
                f"stream message of {nbytes} bytes exceeds max_stream_message_bytes={max_message_bytes}",
                reason="stream_message_too_big",
            )
        try:
            self.take(peer, nbytes)
        except ServerLimitExceeded:  # the total: a peer within its share takes slow messages' room (`reclaim`)
            short = self.total_bytes + nbytes - (self.total_cap.limit_bytes or 0)
            if not self.within_share(peer, nbytes) or not self.reclaim(short, sparing=peer):
                raise
            self.take(peer, nbytes)

    def release(self, peer: str, nbytes: int) -> None:
        if nbytes <= 0:
            return
        self.give_back(peer, nbytes)
        self._freed_since_trim += nbytes

    def maybe_trim(self) -> None:
        """After large frees with nothing left in flight, asks glibc to return free heap pages to the OS."""
        if self._freed_since_trim >= TRIM_AFTER_BYTES and self.total_bytes == 0:
            self._freed_since_trim = 0
            gc.collect(1)  # a refused message's buffer may sit in an exception's traceback cycle
            malloc_trim()
            logger.debug("stream_budget.trimmed")


_libc: Any = None


def malloc_trim() -> bool:
    """`malloc_trim(0)` where the C library has it (glibc); False elsewhere."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    trim = getattr(_libc, "malloc_trim", None) if _libc else None
    if trim is None:
        return False
    return bool(trim(0))


class LeasedConnection(Protocol):
    """The connection a leased stream is read from (`front.stream_endpoint.FrameConnection`), as `reclaim` sees it."""

    transport: asyncio.Transport | None  # (aborted by a cut)

    @property
    def frame_arriving(self) -> bool:
        """A frame's header is read (its length charged) and its payload is not all here yet."""
        ...


class StreamLease:
    """The bytes one stream holds in a `StreamBudget`; `close()` gives back whatever is left, `cut()` too and ends the
    stream (the connection `conn` its port reads)."""

    def __init__(self, budget: StreamBudget, peer: str):
        self.budget, self.peer, self.held = budget, peer, 0
        budget.leases.add(self)
        self.conn: LeasedConnection | None = None  # set by the port that reads the stream (`SocketPort`)
        # time.monotonic() when its message's header was read; of a request in parts, its first part's
        self.charged_at = 0.0
        # a request in parts is being read (`SocketPort.requests(whole=True)`): its parts stay charged and the request
        # is slow as a frame is (decision 0228)
        self.gathering = False

    def charge(self, nbytes: int) -> None:
        self.budget.charge(self.peer, nbytes)
        self.charged(nbytes)

    def charged(self, nbytes: int) -> None:
        """`nbytes` of the next message were taken from the budget."""
        if not (self.gathering and self.held):  # (the parts after a request's first keep its clock)
            self.charged_at = time.monotonic()
        self.held += nbytes

    def slow_since(self, now: float, after_s: float) -> bool:
        """Whether it holds bytes of a message (or a request in parts) that has been arriving for `after_s` or more at
        `now`, and is not whole yet."""
        conn = self.conn
        arriving = conn is not None and (conn.frame_arriving or self.gathering)
        return bool(self.held) and arriving and now - self.charged_at >= after_s

    def cut(self) -> None:
        """Gives back what it holds and aborts its connection (its stream ends as on a lost connection)."""
        self.release(self.held)
        if self.conn is not None and self.conn.transport is not None:
            self.conn.transport.abort()

    def release(self, nbytes: int) -> None:
        nbytes = min(nbytes, self.held)
        self.held -= nbytes
        self.budget.release(self.peer, nbytes)

    def close(self) -> None:
        self.release(self.held)
        # trim once the stream's handler has unwound (its frames still hold the buffers now)
        asyncio.get_running_loop().call_later(TRIM_DELAY_S, self.budget.maybe_trim)


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
    """A handler process's `StreamBudget`: its per-peer bound is the peer's loan from the core (`lent`), the caps being
    the core's (`StreamLoans`), so that they hold per server with no round trip per message. A message past its peer's
    loan borrows the shortfall first (`LoanPending`); what a peer did not use is given back every `LOAN_REBALANCE_S`,
    and at once what the core recalls (`recall`)."""

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
    process holds (`lend`, `repay`, `forget`). A loan past a cap first recalls the other processes' idle loans (and,
    for a peer within its share, their slow messages' streams: decision 0212); a process never holds more of a peer's
    bytes than it was lent."""

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
