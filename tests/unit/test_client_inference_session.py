"""InferenceSession against in-process fake servers (no network): fail-over replay rebuilds caches with no lost or
duplicated tokens (Petals bug #587), rollback, hypo_ids, zero-token steps, deep prompts, and every stream closed."""

from __future__ import annotations

import os
import time

import pytest
import torch

from corolla.client.config import ClientConfig
from corolla.client.session.inference_session import InferenceSession
from corolla.utils.errors import MissingBlocksError
from helpers.fake_chain import HIDDEN, FakeManager, FakeServer, reference


def test_failover_replays_history_without_lost_or_duplicated_tokens():
    torch.manual_seed(0)
    servers = {"A": FakeServer(0, 2), "B": FakeServer(2, 4, inference_rps=1000.0), "C": FakeServer(2, 4)}
    manager = FakeManager(servers, 4)
    tokens = torch.randn(1, 12, HIDDEN)
    outputs = []
    with InferenceSession(manager, max_length=12) as session:
        outputs.append(session.step(tokens[:, :4]))  # prefill through A -> B
        for t in range(4, 12):
            if t == 7:
                servers["B"].dead = True
            outputs.append(session.step(tokens[:, t : t + 1]))
        assert session.position == 12
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)
    replay = servers["C"].requests[0]
    assert replay[0]["start_from_position"] == 0 and replay[1] == 8  # 7 old tokens + the new one, once each
    assert servers["C"].final_lengths == [12] and servers["A"].final_lengths == [12]
    assert servers["A"].open_streams == servers["C"].open_streams == 0
    assert manager.bans.is_banned("B")


def test_history_grows_in_place_and_holds_every_input():
    torch.manual_seed(2)
    manager = FakeManager({"A": FakeServer(0, 4)}, 4)
    tokens = torch.randn(1, 200, HIDDEN)
    buffers = set()
    with InferenceSession(manager, max_length=200) as session:
        session.step(tokens[:, :32])
        after_prompt = session._spans[0]._history_buf.data_ptr()
        for t in range(32, 200):
            session.step(tokens[:, t : t + 1])
            buffers.add(session._spans[0]._history_buf.data_ptr())
            if t < 64:  # the prompt's buffer has room for as many tokens again: no copy at the first tokens
                assert session._spans[0]._history_buf.data_ptr() == after_prompt
        span = session._spans[0]
        torch.testing.assert_close(span.history, tokens, atol=0, rtol=0)
        assert span.position == 200
    assert len(buffers) <= 5  # doubling: a handful of reallocations, not one whole-history copy per token


def test_rollback_hypo_ids_zero_token_steps_and_deep_prompts():
    torch.manual_seed(1)
    servers = {"A": FakeServer(0, 3), "B": FakeServer(3, 5)}
    manager = FakeManager(servers, 5)
    x = torch.randn(2, 6, HIDDEN)
    prompts = torch.randn(5, 1, 2, HIDDEN)
    with InferenceSession(manager, max_length=8) as session:
        out = session.step(x[:, :4], prompts=prompts)
        torch.testing.assert_close(out, reference(x[:, :4], 5, prompts), atol=1e-5, rtol=0)
        empty = session.step(x[:, :0])
        assert empty.shape == (2, 0, HIDDEN) and session.position == 4
        session.position = 2  # roll back: positions 2.. are overwritten
        out = session.step(x[:, 4:6])
        expected = reference(torch.cat([x[:, :2], x[:, 4:6]], dim=1), 5, prompts)[:, 2:]
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
        # beam-search style reordering: both rows continue row 1's history
        hypo_ids = torch.tensor([1, 1])
        new = torch.randn(2, 1, HIDDEN)
        out = session.step(new, hypo_ids=hypo_ids)
        history = torch.cat([x[:, :2], x[:, 4:6]], dim=1)[hypo_ids]
        expected = reference(torch.cat([history, new], dim=1), 5, prompts)[:, -1:]
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="max_length"):
            session.step(torch.randn(2, 4, HIDDEN))
        with pytest.raises(ValueError, match="batch size is 2"):
            session.step(torch.randn(3, 1, HIDDEN))
        with pytest.raises(ValueError, match="deep prompts"):
            session.step(new, prompts=torch.randn(3, 1, 1, HIDDEN))
    assert servers["A"].open_streams == servers["B"].open_streams == 0


def test_failover_during_replay_with_deep_prompts_and_new_chain_shape():
    """The replacement chain has a different shape (two servers for one span) and gets the position-0 prompts."""
    torch.manual_seed(2)
    servers = {"AB": FakeServer(0, 4, inference_rps=1000.0), "A": FakeServer(0, 2), "B": FakeServer(2, 4)}
    manager = FakeManager(servers, 4)
    x = torch.randn(1, 7, HIDDEN)
    prompts = torch.randn(4, 1, 3, HIDDEN)
    with InferenceSession(manager, max_length=7) as session:
        outs = [session.step(x[:, :3], prompts=prompts), session.step(x[:, 3:5])]
        servers["AB"].dead = True
        outs += [session.step(x[:, 5:6]), session.step(x[:, 6:7])]
    torch.testing.assert_close(torch.cat(outs, dim=1), reference(x, 4, prompts), atol=1e-5, rtol=0)
    assert servers["A"].requests[0][1] == 6 and servers["B"].requests[0][1] == 6
    assert servers["A"].final_lengths == servers["B"].final_lengths == [7]


def test_missing_span_fails_after_max_retries():
    servers = {"A": FakeServer(0, 2)}
    manager = FakeManager(servers, 4, max_retries=1)
    with InferenceSession(manager, max_length=4) as session:
        with pytest.raises(MissingBlocksError) as info:
            session.step(torch.randn(1, 1, HIDDEN))
    assert info.value.missing == [2, 3]


def test_hung_server_is_detected_by_liveness_pings():
    torch.manual_seed(3)
    servers = {"A": FakeServer(0, 2), "B": FakeServer(2, 4, inference_rps=1000.0), "C": FakeServer(2, 4)}
    manager = FakeManager(servers, 4, liveness_check_period_s=0.2, request_timeout_s=60.0)
    x = torch.randn(1, 5, HIDDEN)
    with InferenceSession(manager, max_length=5) as session:
        outs = [session.step(x[:, :3])]
        servers["B"].hung = True
        started = time.monotonic()
        outs.append(session.step(x[:, 3:5]))
        assert time.monotonic() - started < 3  # liveness pings, not request_timeout_s
    torch.testing.assert_close(torch.cat(outs, dim=1), reference(x, 4), atol=1e-5, rtol=0)
    assert servers["C"].requests[0][1] == 5


def test_busy_poll_only_for_the_process_s_only_step_in_flight(monkeypatch):
    from corolla.client.session import span_session as module

    config = ClientConfig(busy_poll_ms=20)
    monkeypatch.setattr(module, "_steps_in_flight", 1)
    assert module._poll_s(config) == 0.02
    monkeypatch.setattr(module, "_steps_in_flight", 2)  # another session steps too: its thread needs the GIL
    assert module._poll_s(config) == 0.0
    monkeypatch.setattr(module, "_steps_in_flight", 1)
    assert module._poll_s(ClientConfig()) == 0.0
    with pytest.raises(ValueError, match="busy_poll_ms"):
        ClientConfig(busy_poll_ms=-1)


def test_steps_in_flight_counts_nested_and_failed_steps(monkeypatch):
    from corolla.client.session import span_session as module

    config = ClientConfig(busy_poll_ms=20)
    monkeypatch.setattr(module, "_steps_in_flight", 0)
    with module.steps_in_flight():
        assert module._steps_in_flight == 1 and module._poll_s(config) == 0.02
        with module.steps_in_flight():  # another session's step meanwhile: no polling
            assert module._steps_in_flight == 2 and module._poll_s(config) == 0.0
        with pytest.raises(RuntimeError), module.steps_in_flight():
            raise RuntimeError("a failed step")
        assert module._steps_in_flight == 1
    assert module._steps_in_flight == 0


def test_a_forked_client_counts_only_its_own_steps_in_flight():
    """A process forked while another thread's step was in flight (a pre-forking web server's worker) has no such
    step: its first step is its only one (it may busy-poll), and the count's lock is free even if that thread held it
    at the fork. Before, the child inherited the parent's count for good (it never busy-polled), and a fork inside
    the lock left it held in the child (its first step hung)."""
    from corolla.client.session import span_session as module

    config = ClientConfig(busy_poll_ms=20)

    def child(write_end: int) -> None:  # its count and poll as its first step sees them, then out without cleanup
        try:
            report = "the lock is held (a step would hang)"
            if module._steps_lock.acquire(blocking=False):
                module._steps_lock.release()
                with module.steps_in_flight():
                    report = f"{module._steps_in_flight} {module._poll_s(config)}"
            os.write(write_end, report.encode())
        finally:
            os._exit(0)

    reports = []
    for hold_lock in (False, True):  # (True: the other thread inside `steps_in_flight`'s lock at the fork)
        read_end, write_end = os.pipe()
        with module.steps_in_flight():
            if hold_lock:
                with module._steps_lock:
                    if (pid := os.fork()) == 0:
                        child(write_end)
            elif (pid := os.fork()) == 0:
                child(write_end)
            os.close(write_end)
            with os.fdopen(read_end, "rb") as reader:
                reports.append(reader.read().decode())
            os.waitpid(pid, 0)
    assert reports == ["1 0.02", "1 0.02"]


def test_the_refresh_leaves_the_servers_of_open_sessions_unpinged():
    """A ping dials through p2pd, and one that raced a link's failure put the address in libp2p's dial back-off, so a
    session's own dial once the link was back met "dial backoff" (stop 57's flake). The servers a live session steps
    through are measured by its steps: the refresh pings the others only, and pings them again once every session on
    them is closed (a server failed over included)."""
    torch.manual_seed(3)
    servers = {"A": FakeServer(0, 2), "B": FakeServer(2, 4, inference_rps=1000.0), "C": FakeServer(2, 4)}
    pinged: list[list[str]] = []

    class Pinging(FakeManager):
        def measure_rtts_s(self, peer_ids):
            pinged.append(sorted(peer_ids))
            return super().measure_rtts_s(peer_ids)

    manager = Pinging(servers, 4, max_pinged=3)
    assert pinged == [["A", "B", "C"]]

    def refresh() -> list[str]:
        """The servers a refresh pings (none pinged: no call)."""
        calls = len(pinged)
        manager.update()
        return pinged[-1] if len(pinged) > calls else []

    tokens = torch.randn(1, 6, HIDDEN)
    with InferenceSession(manager, max_length=6) as first, InferenceSession(manager, max_length=6) as second:
        first.step(tokens[:, :3])
        second.step(tokens[:, :3])
        assert [span.peer_id for span, _ in first.route] == ["A", "B"]
        assert refresh() == ["C"]
        servers["B"].dead = True
        first.step(tokens[:, 3:4])  # failed over to C
        assert [span.peer_id for span, _ in first.route] == ["A", "C"]
        assert refresh() == []  # B: banned, out of the view
        first.close()
        assert refresh() == ["C"]  # A: second's
    assert refresh() == ["A", "C"]
