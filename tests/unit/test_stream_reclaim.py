"""Decision 0212: the stream total's reserve (0187) could be filled by two identities each within its fair share (peer
ids cost nothing), leaving a real user's message refused as a full server for as long as they trickled their
messages at the minimum rate. A peer within its share that finds the total full now takes the room of messages that
have been arriving for `RECLAIM_AFTER_S` (their streams cut, those of the peers holding most first); a message
arriving at the pace of a decode step is never cut, and a peer past its share cuts nothing."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from corolla.server.core.limits import KiB, PeerLimits, ServerLimitExceeded
from corolla.server.core.peer_bytes import (
    RECLAIM_AFTER_S,
    LentLease,
    LentStreamBudget,
    StreamBudget,
    StreamLease,
    StreamLoans,
)
from corolla.server.front import stream_guard
from helpers.lent_streams import Core, charged

# a message of 64 KiB, a peer 96 KiB (its share of 2), the total 192 KiB with its top message (64 KiB) kept for peers
# within their share; a message may take 10 s + its bytes at 4 KiB/s (the defaults' rate): 26 s for 64 KiB
LIMITS = PeerLimits(
    max_stream_message_bytes=64 * KiB, max_stream_bytes_per_peer=96 * KiB, max_stream_bytes_total=192 * KiB,
    stream_idle_timeout_s=2.0, min_stream_rate_kib_s=4.0, min_stream_rate_grace_s=10.0,
)  # fmt: skip
BOUND_S = 10.0
GAP_S = 0.05  # a hoarder's trickle: a byte every 50 ms (inside the idle timeout, for its pace's 26 s)


def _peer_frame(body: bytes) -> bytes:
    return P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


def _request(size: int) -> bytes:
    """A request of about `size` bytes (its metadata filled)."""
    return runtime_pb2.ExpertRequest(uid="p.0", metadata=b"\x00" * (size - 16)).SerializeToString()


END = P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)


async def _answer_all(requests, context):
    async for request in requests:
        yield runtime_pb2.ExpertResponse(metadata=request.uid.encode())


async def _trickle(sock: socket.socket, data: bytes) -> None:
    """The header and a few bytes at once, then a byte every `GAP_S`."""
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_sendall(sock, data[:64])
        for i in range(64, len(data)):
            await asyncio.sleep(GAP_S)
            await loop.sock_sendall(sock, data[i : i + 1])
    except OSError:  # the server cut the stream
        pass


async def _open(budget: StreamBudget, peer: str, data: bytes, rejected: list, *, trickle: bool):
    """One p2p forward stream of `peer` (`stream_guard.guarded_stream_handler`) sending `data`; (its handler's task,
    the client's socket, the sending task or None)."""
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    p2p = SimpleNamespace(peer_id="server")
    handle = stream_guard.guarded_stream_handler(
        p2p, "rpc_forward_stream", _answer_all, budget, on_reject=lambda name, e: rejected.append((peer, e))
    )
    sending = asyncio.create_task(_trickle(theirs, data)) if trickle else None
    if not trickle:
        await asyncio.get_running_loop().sock_sendall(theirs, data)
    served = asyncio.create_task(handle(SimpleNamespace(peer_id=PeerID(peer.encode())), reader, writer))
    return served, theirs, sending


# identities -> the messages each declares and trickles: together the whole total, each within its share
HOARDS = {2: (64 * KiB, 32 * KiB), 32: (6 * KiB,)}


@pytest.mark.parametrize("identities", sorted(HOARDS))
def test_identities_within_their_share_hoarding_the_total_let_a_real_user_in_at_once(identities) -> None:
    """2 hoarders (two streams each, 64 + 32 KiB declared and trickled: 96 KiB, the share of 2) or 32 (6 KiB each)
    hold the whole total; a second later a real user's 4 KiB request comes (within its share of 1/33). On main it was
    refused as a full server (for the hoarders' pace of 26 s, renewed at will); now the room of the largest holder's
    oldest stream is taken (it is cut) and the user is answered at once (0.001 s on the dev VM; bounded here well under
    the hoarders' pace, not at 1 s: a loaded CI loop pauses that long)."""
    rejected: list = []

    async def run() -> tuple[float, bytes, StreamBudget, int]:
        loop = asyncio.get_running_loop()
        budget = StreamBudget(LIMITS)
        hoards = []
        for peer in [f"hoarder-{i}" for i in range(identities)]:
            for size in HOARDS[identities]:
                before = budget.total_bytes
                hoards.append(await _open(budget, peer, _peer_frame(_request(size)), rejected, trickle=True))
                while budget.total_bytes == before:
                    await asyncio.sleep(0.01)  # (its header read and charged)
        assert budget.total_bytes > 192 * KiB - 512  # (each request a few bytes short of its size)
        await asyncio.sleep(RECLAIM_AFTER_S + 0.1)  # (the hoarders hold it for their pace's 26 s)
        started = loop.time()
        served, theirs, _ = await _open(budget, "user", _peer_frame(_request(4 * KiB)) + END, rejected, trickle=False)
        await asyncio.wait_for(served, BOUND_S)
        received = await asyncio.wait_for(loop.sock_recv(theirs, 1 << 16), BOUND_S)
        elapsed = loop.time() - started
        await asyncio.wait([task for task, _, _ in hoards], timeout=BOUND_S, return_when=asyncio.FIRST_COMPLETED)
        cut = sum(task.done() for task, _, _ in hoards)
        for task, sock, sending in hoards:
            task.cancel()
            if sending is not None:
                sending.cancel()
            sock.close()
        theirs.close()
        return elapsed, received, budget, cut

    elapsed, received, budget, cut = asyncio.run(run())
    assert [peer for peer, _ in rejected if peer == "user"] == [], rejected  # main: ServerLimitExceeded, total full
    assert received[:1] == P2P.MESSAGE_MARKER and received.endswith(b"p.0")
    # (not the hoarders' pace of 26 s; 0.001 s measured on the dev VM is decision 0212's figure, not a bound a loaded
    # CI worker keeps: main refused the user outright, which `rejected` asserts)
    assert elapsed < BOUND_S / 2, elapsed
    assert budget.num_reclaimed == 1 and cut == 1  # one stream freed the room: no more were cut


async def _gather(requests, context):
    """A training rpc's method: the request's parts gathered whole (up to the caller's END), then one reply."""
    uids = [request.uid async for request in requests]
    yield runtime_pb2.ExpertResponse(metadata=" ".join(uids).encode())


PART_GAP_S = 0.25  # (a few hundred bytes a second: the hoarders stay within their 96 KiB for seconds)


async def _hold_in_parts(sock: socket.socket, first: bytes, stop: asyncio.Event) -> None:
    """A request's first part whole at once, then a tiny part every `PART_GAP_S` (each whole at once, inside the idle
    timeout, for the request's pace) until `stop`: no frame is ever arriving for long."""
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_sendall(sock, first)
        while not stop.is_set():
            await asyncio.sleep(PART_GAP_S)
            await loop.sock_sendall(sock, _peer_frame(_request(32)))
    except OSError:  # the server cut the stream
        pass


def test_identities_holding_whole_parts_of_unfinished_requests_let_a_real_user_in_at_once() -> None:
    """Decision 0228, against 0212. 2 identities (two forward streams each, 64 + 32 KiB) send their request's first
    part whole at once, then a 32-byte part every 250 ms and never their END: the parts are kept charged until the
    request is whole (a training rpc gathers it), and no frame is arriving for long, so 0212's reclaim saw no slow
    message: the user's 4 KiB request a second later was refused as a full server, for the request's pace (26 s,
    renewed at will). A request still arriving in parts after `RECLAIM_AFTER_S` is now as slow as a frame: the room of
    the largest holder's oldest stream is taken, the user answered."""
    rejected: list = []

    async def run() -> tuple[float, bytes]:
        loop = asyncio.get_running_loop()
        budget = StreamBudget(LIMITS)
        stop = asyncio.Event()
        hoards = []
        for peer in ("hoarder-a", "hoarder-b"):
            for size in (63 * KiB, 31 * KiB):  # (room for the tiny parts within the share: 94 of 96 KiB)
                before = budget.total_bytes
                ours, theirs = socket.socketpair()
                theirs.setblocking(False)
                reader, writer = await asyncio.open_unix_connection(sock=ours)
                handle = stream_guard.guarded_stream_handler(
                    SimpleNamespace(peer_id="server"), "rpc_forward_stream", _gather, budget,
                    on_reject=lambda name, e, peer=peer: rejected.append((peer, e)),
                )  # fmt: skip
                sending = asyncio.create_task(_hold_in_parts(theirs, _peer_frame(_request(size)), stop))
                served = asyncio.create_task(handle(SimpleNamespace(peer_id=PeerID(peer.encode())), reader, writer))
                hoards.append((served, theirs, sending))
                while budget.total_bytes < before + size - 512:
                    await asyncio.sleep(0.01)  # (its first part read and charged)
        assert budget.total_bytes > 188 * KiB - 1024  # (the user's 4 KiB do not fit)
        await asyncio.sleep(RECLAIM_AFTER_S + 0.1)
        started = loop.time()
        served, theirs, _ = await _open(budget, "user", _peer_frame(_request(4 * KiB)) + END, rejected, trickle=False)
        await asyncio.wait_for(served, BOUND_S)
        received = await asyncio.wait_for(loop.sock_recv(theirs, 1 << 16), BOUND_S)
        elapsed = loop.time() - started
        stop.set()
        for task, sock, sending in hoards:
            task.cancel()
            sending.cancel()
            sock.close()
        theirs.close()
        return elapsed, received

    elapsed, received = asyncio.run(run())
    assert [peer for peer, _ in rejected if peer == "user"] == [], rejected  # main: ServerLimitExceeded, total full
    assert received[:1] == P2P.MESSAGE_MARKER and received.endswith(b"p.0")
    assert elapsed < BOUND_S / 2, elapsed


class _Conn:
    """A stream's connection as a reclaim sees it: a frame arriving or not, a transport to abort."""

    def __init__(self, arriving: bool = True):
        self.frame_arriving, self.aborted = arriving, 0
        self.transport = SimpleNamespace(abort=self._abort)

    def _abort(self) -> None:
        self.aborted += 1


def _lease(budget: StreamBudget, peer: str, nbytes: int, *, age_s: float, arriving: bool = True) -> StreamLease:
    lease = budget.lease(peer)
    lease.conn = _Conn(arriving)  # type: ignore[assignment]
    lease.charge(nbytes)
    lease.charged_at -= age_s
    return lease


def test_whole_or_fresh_messages_are_not_cut_and_a_peer_past_its_share_cuts_nothing() -> None:
    budget = StreamBudget(LIMITS)
    fresh = [_lease(budget, "a", 64 * KiB, age_s=0.0), _lease(budget, "b", 64 * KiB, age_s=0.0)]
    whole = _lease(budget, "c", 64 * KiB, age_s=5.0, arriving=False)  # (waits for the handler, not for its peer)
    with pytest.raises(ServerLimitExceeded, match="max_stream_bytes_total"):
        budget.charge("user", 8 * KiB)
    assert budget.num_reclaimed == 0 and not whole.conn.aborted  # type: ignore[union-attr]
    for lease in fresh:
        lease.charged_at -= 2 * RECLAIM_AFTER_S
    with pytest.raises(ServerLimitExceeded):
        budget.charge("a", 24 * KiB)  # past its share (64 KiB of 3 peers): the full total refuses it, nothing cut
    assert budget.num_reclaimed == 0
    budget.charge("user", 8 * KiB)
    assert budget.num_reclaimed == 1 and sum(lease.conn.aborted for lease in fresh) == 1  # type: ignore[union-attr]


def test_identities_holding_a_few_bytes_each_do_not_push_a_users_one_message_past_its_share() -> None:
    """Decision 0228, against 0187 and 0212. A peer's fair share is the total over the peers holding any bytes, so
    identities that each hold a few (a message's header charged, one byte of it kept back) shrink every other
    peer's share at will: 22 of them at 100 bytes each beside 124 KiB of other streams made a user's first 8 KiB
    message "past its share" (192 KiB / 25 = 7.7 KiB), kept out of the reserve and refused as a full server, and, past
    its share, it could reclaim nothing (0212). A peer's one message (up to `max_stream_message_bytes`) is now
    always within its share: the reserve is one message kept for whoever holds no more."""
    budget = StreamBudget(LIMITS)
    for peer in ("a", "b"):  # (whole messages waiting for the handler: nobody's to cut)
        _lease(budget, peer, 62 * KiB, age_s=0.0, arriving=False)
    for i in range(22):
        _lease(budget, f"tiny-{i}", 100, age_s=2 * RECLAIM_AFTER_S)
    assert budget.total_bytes + 8 * KiB > 192 * KiB - 64 * KiB  # (in the reserve)
    budget.charge("user", 8 * KiB)  # main: ServerLimitExceeded, "less 65536 bytes kept for peers within their share"
    assert budget.per_peer["user"] == 8 * KiB and budget.num_reclaimed == 0
    with pytest.raises(ServerLimitExceeded, match="less 65536 bytes kept"):
        budget.charge("user", 60 * KiB)  # a second message past its share still is kept out of the reserve


def test_with_handler_processes_the_core_has_a_slow_hoarders_stream_cut_for_a_user_within_its_share() -> None:
    """`--num_handlers` 2: the hoarders' streams in one process, the user's in the other. On main the user's loan
    was refused after a recall (the hoarders' loans are not idle); now the recall cuts the hoarders' older stream."""
    limits = LIMITS

    async def go() -> tuple[LentLease, list[LentLease]]:
        loans = StreamLoans(limits)
        one, two = LentStreamBudget(limits, Core(loans)), LentStreamBudget(limits, Core(loans))
        hoards = []
        for peer in ("hoarder-a", "hoarder-b"):
            for size in (64 * KiB, 32 * KiB):
                lease = one.lease(peer)
                lease.conn = _Conn()  # type: ignore[assignment]
                await charged(lease, size)
                lease.charged_at -= 2 * RECLAIM_AFTER_S
                hoards.append(lease)
        assert loans.total_bytes == 192 * KiB
        user = two.lease("user")
        await charged(user, 8 * KiB)
        assert loans.per_peer["user"] == 8 * KiB and loans.total_bytes <= 192 * KiB
        return user, hoards

    user, hoards = asyncio.run(go())
    assert user.held == 8 * KiB
    assert [lease.conn.aborted for lease in hoards] == [1, 0, 0, 0]  # type: ignore[union-attr]
