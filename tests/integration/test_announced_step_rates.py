"""A `--throughput N` server announces the step rates it measured from the steps it served (decision 0165), an
in-process server of the tiny llama over its own DHT: its record carries no `inference_rps` / `forward_rps` before
any step (the user's figure is only its `throughput`, which stays), both once sessions ran prompts and decode steps
(what its engine measured). A client's first long step on it then has a deadline from that figure (4 x its tokens at
the announced prefill rate, never under the 4 s floor), seen as the stall event of a prompt the server holds 7 s: on
the old server the record had no rate and the step's deadline was `STEP_MAX_S` (60 s: no event within the 7 s)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tests.helpers.swarm import start_inprocess_server
from tests.helpers.tiny_models import make_tiny_model

from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.client.routing.announced_pace import announced_step_s, announced_token_s
from corolla.client.session import stalls
from corolla.protocol.records import ServerInfo

pytestmark = pytest.mark.timeout(240)

PROMPT = torch.tensor([[1, 8, 27, 64, 125, 3, 9, 81, 11, 2, 40, 17]])  # 12 tokens: a long step
HELD_S = 7.0  # the held prompt's delay: past the floor's deadline (4 s), far under STEP_MAX_S (60 s)
THROUGHPUT = 10.0


def _record(model, peer_id: str) -> ServerInfo:
    model.manager.update()
    infos = [span.server_info for span in model.manager.spans if span.peer_id == peer_id]
    assert infos, "the server's record is not in the client's view"
    return infos[0]


def _wait_for_rates(model, peer_id: str, timeout_s: float = 60.0) -> ServerInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        info = _record(model, peer_id)
        if info.inference_rps is not None and info.forward_rps is not None:
            return info
        assert time.monotonic() < deadline, f"no rates announced within {timeout_s} s: {info}"
        time.sleep(0.5)


class HoldNextBatch:
    """A runtime batch observer that holds the device thread `held_s` after the next batch once `armed` is set."""

    def __init__(self, held_s: float):
        self.held_s = held_s
        self.armed = threading.Event()
        self.held = threading.Event()

    def __call__(self, kind: str, num_steps: int, elapsed_s: float) -> None:
        if self.armed.is_set() and not self.held.is_set():
            self.held.set()
            time.sleep(self.held_s)


def test_a_throughput_n_server_announces_its_measured_rates_and_clients_time_its_prompts(tmp_path):
    model_path = make_tiny_model("llama", tmp_path / "models", seed=3)
    server = start_inprocess_server(
        model_path, tmp_path / "cache", throughput=THROUGHPUT, update_period_s=1.0, block_indices="0:4"
    )
    try:
        config = ClientConfig(update_period_s=1.0, max_pinged=0, request_timeout_s=60.0, max_wait_s=30.0)
        with AutoDistributedModelForCausalLM.from_pretrained(
            model_path, initial_peers=server.join_maddrs, client_config=config
        ) as model:
            model.manager.wait_ready()
            time.sleep(1.5)  # an announcement after start, before any step
            before = _record(model, server.peer_id)
            assert before.inference_rps is None and before.forward_rps is None
            for _ in range(3):  # 3 prompts (long steps) and 12 decode steps
                model.generate(PROMPT, max_new_tokens=5)
            info = _wait_for_rates(model, server.peer_id)
            assert info.throughput == THROUGHPUT  # placement's figure stays the user's
            assert info.inference_rps > 0 and info.forward_rps > 0
            # the first long step of a new session on it: its deadline from the figure, not STEP_MAX_S
            hold = HoldNextBatch(HELD_S)
            server.service.runtime.add_batch_observer(hold)
            model.manager.update()
            hidden = torch.randn(1, PROMPT.shape[1], model.config.hidden_size)
            with model.inference_session(max_length=PROMPT.shape[1] + 1) as session:
                hold.armed.set()
                started = time.monotonic()
                session.step(hidden)
                took_s = time.monotonic() - started
                events = [e for e in session.stall_events if e.step_deadline_s is not None]  # (not liveness pings)
            assert hold.held.is_set() and took_s >= HELD_S
            blocks = info.end_block - info.start_block
            clock = stalls.StepClock(
                announced_step_s(blocks, info.inference_rps),
                announced_token_s(blocks, info.forward_rps, info.inference_rps),
            )
            expected_s = clock.deadline_s(PROMPT.shape[1], hidden.nbytes)
            assert expected_s < HELD_S < stalls.STEP_MAX_S
            assert [e.num_tokens for e in events] == [PROMPT.shape[1]], events
            assert events[0].step_deadline_s == pytest.approx(expected_s, rel=0.2)  # (the record may have moved)
            assert events[0].detected_after_s < HELD_S
    finally:
        server.shutdown()
