"""A client's graceful drain against in-process fake servers (no network): the hand-off finds its replacement in
the swarm as it is when the drain starts, not as the client last read it, and sessions that drain together wait
for one read of the records."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from corolla.client.routing import sequence_manager
from corolla.client.session import stalls
from corolla.client.session.inference_session import InferenceSession
from helpers.fake_chain import HIDDEN, FakeManager, FakeServer, reference
from helpers.fake_handoff import AlwaysDraining, HonestDrainer, Importer


def test_a_drain_hands_off_to_a_replica_that_joined_after_the_last_read():
    """The client read the records before the replica joined (`update_period_s` may be a minute): the hand-off
    re-reads them and moves the cache there. Before, it gave up ("no other server holds blocks 0:2") and the next
    step replayed the whole history."""
    torch.manual_seed(0)
    tokens = torch.randn(1, 8, HIDDEN)
    servers = {"drainer": HonestDrainer(0, 2, tokens, inference_rps=1e6), "C": FakeServer(2, 4)}
    manager = FakeManager(servers, 4, max_wait_s=10)
    servers["B"] = Importer(0, 2)  # online after the client's read
    with InferenceSession(manager, max_length=8) as session:
        steps = [session.step(tokens[:, :4])] + [session.step(tokens[:, t : t + 1]) for t in range(4, 8)]
        records = session.handoffs.records
    assert len(records) == 1 and records[0].to_peer == "B", records
    assert servers["B"].imports == 1
    torch.testing.assert_close(torch.cat(steps, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)


def test_sessions_that_need_the_swarm_at_once_wait_for_one_read(monkeypatch):
    # "read lately" is MIN_REREAD_S (1 s) of wall time: the read, 8 threads and their joins took 0.2 s here, but a
    # loaded machine can stretch them past it (the next call then read again); the rule is the same at 60 s
    monkeypatch.setattr(sequence_manager, "MIN_REREAD_S", 60.0)
    servers = {"A": FakeServer(0, 2)}
    manager = FakeManager(servers, 2)
    reads: list[float] = []
    fetch = manager.fetch_module_infos

    def slow_fetch():
        reads.append(time.monotonic())
        time.sleep(0.2)
        return fetch()

    manager.fetch_module_infos = slow_fetch
    started = time.monotonic()
    threads = [threading.Thread(target=manager.reread, args=(started,)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(reads) == 1  # the first read started after every caller's `newer_than`
    manager.reread()  # read within MIN_REREAD_S: nothing to do
    assert len(reads) == 1
    manager.reread(time.monotonic())  # asked for a read newer than the last one
    assert len(reads) == 2


def test_a_server_that_drains_on_every_reply_does_not_make_every_token_read_the_records():
    """A hostile server, the only one of its blocks, marks every reply draining: each hand-off finds no replacement
    and the next step replays on it again. Its drain makes the client re-read the records once, not once a token
    (before: 8 reads for 8 tokens, each a DHT lookup the token waited for, for every client of that server)."""
    torch.manual_seed(0)
    tokens = torch.randn(1, 8, HIDDEN)
    servers = {"liar": AlwaysDraining(0, 2), "C": FakeServer(2, 4)}
    manager = FakeManager(servers, 4, max_wait_s=10)
    reads = []
    fetch = manager.fetch_module_infos

    def counted_fetch():
        reads.append(time.monotonic())
        return fetch()

    manager.fetch_module_infos = counted_fetch
    with InferenceSession(manager, max_length=8) as session:
        steps = [session.step(tokens[:, t : t + 1]) for t in range(8)]
        records = session.handoffs.records
    assert len(records) == 8 and all(r.to_peer is None for r in records), records  # each hand-off failed: replays
    torch.testing.assert_close(torch.cat(steps, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    assert len(reads) <= 1, len(reads)


def test_a_replacement_that_takes_the_import_and_stalls_its_answer_is_left_for_the_next(monkeypatch):
    """B, announcing itself the fastest, takes the drained cache and answers the import 60 s late (answering pings):
    the import's answer has a deadline (its bytes at the slow-link rate plus a decode step's), then the late budget,
    then B is left (avoided, not banned) for D, which imports it; the outputs are the reference's. Before (decision
    0162), the import's answer had no deadline: the hand-off waited for it until the draining server's deadline (here
    120 s) ran out, then replayed."""
    monkeypatch.setattr(stalls, "LATE_BUDGET_S", 2.0)  # (8 s by default: the same rule, a shorter test)
    torch.manual_seed(0)
    tokens = torch.randn(1, 8, HIDDEN)
    drainer = HonestDrainer(0, 2, tokens, inference_rps=1e6)
    drainer.drain_s = 120.0
    servers = {"drainer": drainer, "C": FakeServer(2, 4), "B": Importer(0, 2, inference_rps=1e5), "D": Importer(0, 2)}
    servers["B"].import_delay_s = 60.0
    manager = FakeManager(servers, 4, max_wait_s=10, request_timeout_s=180.0)
    with InferenceSession(manager, max_length=8) as session:
        steps = [session.step(tokens[:, :4])] + [session.step(tokens[:, t : t + 1]) for t in range(4, 8)]
        records = session.handoffs.records
        moved = [(e.peer_id, e.action) for e in session.stall_events]
    assert len(records) == 1 and records[0].to_peer == "D", records
    assert servers["B"].imports == 1 and servers["D"].imports == 1
    # the replacement's stall is the session's (contracts: `stall_events` lists them all; a hand-off's span sessions
    # kept their own list before, so a session never told its caller about the move)
    assert ("B", "moved") in moved, moved
    assert "B" in manager.avoided_peers() and not manager.bans.banned_peers()
    torch.testing.assert_close(torch.cat(steps, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("stalls_at", "extra_bytes"), [("header", 0), ("parts", 0), ("parts", 512 << 20)])
def test_a_draining_server_that_stalls_its_export_is_left_for_a_replay(monkeypatch, stalls_at, extra_bytes):
    """The draining server, announcing 60 s left, holds its export's header (or its parts) 120 s while it answers
    pings: the export has a step's deadline (its header a zero-token step's, each part message the bytes before it
    plus a full message's at the slow-link rate plus that), then the late budget, then the hand-off fails and the
    span's history is replayed on D; the outputs are the reference's. Before (decision 0168), the export had no
    deadline of its own: the hand-off waited the notice's 60 s (at most `request_timeout_s`, + `connect_timeout_s`),
    then replayed; and a header announcing 512 MiB it never sends (under the 1 GiB `kv_handoff_max_bytes`) bought
    the parts those bytes' 537 s at the slow-link rate, the notice's 60 s again, until each message's deadline
    counted the bytes that came."""
    monkeypatch.setattr(stalls, "LATE_BUDGET_S", 2.0)  # (8 s by default: the same rule, a shorter test)
    torch.manual_seed(0)
    tokens = torch.randn(1, 8, HIDDEN)
    drainer = HonestDrainer(0, 2, tokens, inference_rps=1e6)
    drainer.drain_s = 60.0
    drainer.extra_bytes = extra_bytes
    setattr(drainer, f"{stalls_at}_delay_s", 120.0)
    servers = {"drainer": drainer, "C": FakeServer(2, 4), "D": Importer(0, 2)}
    manager = FakeManager(servers, 4, max_wait_s=10, request_timeout_s=180.0)
    with InferenceSession(manager, max_length=8) as session:
        steps = [session.step(tokens[:, :4])] + [session.step(tokens[:, t : t + 1]) for t in range(4, 8)]
        records = session.handoffs.records
    assert len(records) == 1 and records[0].to_peer is None and "ServerTooSlow" in str(records[0].error), records
    assert records[0].seconds < 30.0, records  # the step deadline (~1 s) + the late budget (2 s); before: 60 s
    assert servers["D"].imports == 0 and "drainer" in manager.avoided_peers() and not manager.bans.banned_peers()
    torch.testing.assert_close(torch.cat(steps, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
