"""The stream byte caps (`max_stream_bytes_per_peer` / `max_stream_bytes_total`) of a server with handler processes
are the server's: the core lends each process its peers' bytes (`core.peer_bytes.StreamLoans`), so a peer spreading stalled
streams over the processes holds one cap's worth, not one per process (decision 0161), and the loans come back to
the core once the streams are gone."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from hivemind.p2p import P2P

from corolla.server.core.limits import MiB, PeerLimits
from helpers.swarm import ClientThread, connected_clients, start_inprocess_server, wait_until
from helpers.tiny_models import make_tiny_model

NUM_BLOCKS = 2
STREAM_IDLE_S = 5.0
STREAMS = 6
FORWARD = "TransformerConnectionHandler.rpc_forward_stream"

pytestmark = [pytest.mark.timeout(120)]

LIMITS = PeerLimits(
    stream_idle_timeout_s=STREAM_IDLE_S,
    min_stream_rate_kib_s=0,  # (the stalled streams end at the idle timeout only)
    max_stream_message_bytes=8 * MiB,
    max_stream_bytes_per_peer=10 * MiB,  # one 6 MiB message of a peer at a time, in all processes
    max_stream_bytes_total=40 * MiB,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_path = make_tiny_model("llama", tmp_path_factory.mktemp("models"))
    server = start_inprocess_server(
        model_path, tmp_path_factory.mktemp("cache"), block_indices=(0, NUM_BLOCKS), num_handlers=2,
        step_timeout_s=30.0, request_timeout_s=30.0, peer_limits=LIMITS,
    )  # fmt: skip
    yield server
    server.shutdown()


async def _stalled_stream(client: ClientThread, declared: int) -> bytes:
    """Opens a forward stream, declares a message of `declared` bytes, sends 1 KiB of it and nothing more; returns all
    the server said before it closed (its error)."""
    _, reader, writer = await client.p2p.call_binary_stream_handler(client.peer_id, FORWARD)
    writer.write(P2P.MESSAGE_MARKER + declared.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\0" * 1024)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


def test_a_peer_spreading_stalled_streams_over_handler_processes_holds_one_cap(server):
    """6 streams of one peer at once, each declaring 6 MiB under a 10 MiB per-peer cap, land in both handler
    processes (p2pd spreads them): one is held (until it stalls out), every other is refused at its header as the
    one-process server refuses it. Counted in each process, one stream a process was held (2 of 6, or more)."""
    with connected_clients(server, 1) as (attacker,):

        async def flood() -> list[bytes]:
            return list(await asyncio.gather(*(_stalled_stream(attacker, 6 * MiB) for _ in range(STREAMS))))

        replies = attacker.call(flood(), 60)
    held = [reply for reply in replies if b"stream_idle_timeout" in reply]
    refused = [reply for reply in replies if b"max_stream_bytes_per_peer" in reply]
    assert (len(held), len(refused)) == (1, STREAMS - 1), replies
    assert all(reply[:1] == P2P.ERROR_MARKER for reply in replies)
    loans = server.service.core.stream_loans
    assert loans is not None
    assert wait_until(lambda: loans.total_bytes == 0 and not loans.per_peer, 5)  # given back once unused
    text = server.metrics.render().decode()
    assert 'reason="peer_stream_bytes"' in text and 'reason="stream_stalled"' in text


async def _whole_stream(client: ClientThread, nbytes: int) -> bytes:
    """Opens a forward stream, sends one whole message of `nbytes` (not a request) and returns the server's answer,
    one frame: its refusal (`request frame is not an ExpertRequest`), sent once the message's bytes were given back
    (`stream_guard._answer`), so the next stream follows this one in the server too. Its input is not ended first:
    the caller's p2pd ends the whole stream at the caller's half-close, and a read after `write_eof` returned b""
    before the server had read the message: the next stream overlapped this one there (a handler process slow to
    read it, on a loaded host, still held its bytes: refused, rightly)."""
    _, reader, writer = await client.p2p.call_binary_stream_handler(client.peer_id, FORWARD)
    try:
        writer.write(P2P.MESSAGE_MARKER + nbytes.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\0" * nbytes)
        await writer.drain()
        head = await asyncio.wait_for(reader.readexactly(1 + P2P.HEADER_LEN), 30)
        return head + await asyncio.wait_for(reader.readexactly(int.from_bytes(head[1:], P2P.BYTEORDER)), 30)
    except asyncio.IncompleteReadError as e:
        return e.partial  # (the stream ended without a whole answer: the caller's checks tell)
    except ConnectionError:
        return b""  # (a refused message's stream may be cut while its payload is still sent: the metrics tell)
    finally:
        writer.close()


def _rejected(server: Any, reason: str) -> float:
    """`corolla_requests_rejected_total{reason=...}` in the server's metrics (every process's; 0 before the first)."""
    found = re.search(
        rf'corolla_requests_rejected_total{{reason="{reason}"}} ([0-9.]+)', server.metrics.render().decode()
    )
    return float(found.group(1)) if found else 0.0


def test_a_peer_whose_streams_follow_each_other_over_handler_processes_is_never_refused(server):
    """One peer's 6 MiB messages one after the other (10 MiB per-peer cap: it never holds two), each stream placed
    by p2pd in either handler process: the loan the last one left idle in the other process is recalled before a
    refusal (decision 0167). With 0161 alone, a stream that came to the other process within ~1 s of the last one's
    end was refused with max_stream_bytes_per_peer although the server held none of the peer's bytes. Its verdict
    waits on events only: each stream starts once the server answered the last, and the recall waits for the
    process's answer however late a loaded host lets it come (decision 0252)."""
    loans = server.service.core.stream_loans
    assert loans is not None
    assert wait_until(lambda: loans.total_bytes == 0 and not loans.per_peer, 10)  # (the other test's streams gone)
    refused_before = _rejected(server, "peer_stream_bytes")
    with connected_clients(server, 1) as (peer,):

        async def one_by_one() -> list[bytes]:
            return [await _whole_stream(peer, 6 * MiB) for _ in range(STREAMS)]

        replies = peer.call(one_by_one(), 90)
    assert wait_until(lambda: loans.total_bytes == 0 and not loans.per_peer, 30)  # (every process's notes in)
    assert _rejected(server, "peer_stream_bytes") == refused_before
    assert all(b"not an ExpertRequest" in reply for reply in replies), replies  # (each read by the server, whole)
    assert loans.num_recalls >= 1  # (p2pd placed streams in both processes: a loan was recalled)
