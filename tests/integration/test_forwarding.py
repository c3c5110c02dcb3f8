"""Server-to-server forwarding (client.session.forwarding) through a chain of three in-process servers (tiny Llama, blocks
0:2, 2:3, 3:4, plus a replica of 2:3), each behind a WAN proxy (benchmarks.wan_emulator) with a small one-way delay: greedy
tokens identical to local transformers with the push path in use (replies flagged as answers to pushed steps), and
the middle server cut off mid-generation (its proxy closed: connections reset, new ones refused, as for a killed
process) still gives identical tokens, the replacement chain being pushed to in turn."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest
import torch

from benchmarks.wan_emulator import LinkConfig, ProxyThread
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from helpers.ports import free_port
from helpers.swarm import start_inprocess_server
from helpers.tiny_models import hf_greedy, make_tiny_model

pytestmark = pytest.mark.timeout(300)  # setup included: four servers start in 30-40 s at load 15 on 2 cores

DELAY_MS = 5.0
PROMPT = torch.tensor([[1, 8, 27, 64, 125]])
NEW_TOKENS = 16
SPANS = ((0, 2), (2, 3), (2, 3), (3, 4))  # the second (2, 3) is the replica that takes over


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"), seed=3)


@pytest.fixture(scope="module")
def chain(model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """(servers, their proxies, the ProxyThread): every connection to a server crosses its proxy. The first server
    starts the swarm, the others join it at once; all stop together (each stop waits for its announcements)."""
    servers: list = []
    with ProxyThread() as wan, ThreadPoolExecutor(len(SPANS)) as pool:
        ports = [free_port() for _ in SPANS]
        proxies = [wan.add(port, LinkConfig(delay_ms=DELAY_MS)) for port in ports]

        def start(index: int, **peers):
            return start_inprocess_server(
                model_path,
                tmp_path_factory.mktemp(f"cache{index}"),
                host_maddrs=(f"/ip4/127.0.0.1/tcp/{ports[index]}",),
                announce_maddrs=(f"/ip4/127.0.0.1/tcp/{proxies[index].port}",),
                local_socket=False,
                throughput=1.0,
                block_indices=SPANS[index],
                step_timeout_s=30.0,
                request_timeout_s=10.0,
                drain_timeout_s=0.0,  # the test's sessions are over (or cut off) at the end: nothing to drain
                **peers,
            )

        try:
            servers.append(start(0, new_swarm=True))
            peers = dict(new_swarm=False, initial_peers=tuple(servers[0].join_maddrs))
            joining = [pool.submit(start, index, **peers) for index in range(1, len(SPANS))]
            wait(joining)  # every start is waited for, so a failed one leaves no server running
            servers += [future.result() for future in joining if future.exception() is None]
            for future in joining:
                if future.exception() is not None:
                    raise RuntimeError("a server did not start") from future.exception()
            yield servers, proxies, wan
        finally:
            list(pool.map(lambda server: server.shutdown(), servers))


@pytest.fixture(scope="module")
def expected(model_path: Path) -> list[list[int]]:
    return hf_greedy(model_path, PROMPT, NEW_TOKENS).tolist()


class AtToken:
    """A streamer that runs `action(session)` once, at generated token `at`, and times every token."""

    def __init__(self, at: int | None, action=None):
        self.at, self.action, self.count, self.session = at, action, 0, None
        self.times: list[float] = []
        self.route: list[tuple[str, int, int]] = []  # the chain when the last token came

    def put(self, value) -> None:
        self.times.append(time.perf_counter())
        if self.session is not None:
            self.route = [(span.peer_id, span.start, span.end) for span, _ in self.session.route]
        self.count += 1
        if self.at is not None and self.count == self.at + 1:  # the first put is the prompt
            self.action(self.session)

    def end(self) -> None:
        pass


def _generate(servers, streamer: AtToken, **config) -> list[list[int]]:
    client_config = ClientConfig(
        max_retries=5,
        min_backoff_s=0.1,
        update_period_s=2.0,
        liveness_check_period_s=1.0,
        request_timeout_s=20.0,
        local_transport=False,
        **config,
    )
    with AutoDistributedModelForCausalLM.from_pretrained(
        servers[0].config.model_name_or_path, initial_peers=list(servers[0].join_maddrs), client_config=client_config
    ) as model:
        with model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS) as session:
            streamer.session = session
            return model.generate(
                PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, session=session, streamer=streamer
            ).tolist()


def test_forwarding_through_a_delayed_chain_is_token_identical(chain, expected):
    servers, _, _ = chain
    streamer = AtToken(None)
    assert _generate(servers, streamer) == expected
    assert [(start, end) for _, start, end in streamer.route] == [(0, 2), (2, 3), (3, 4)]
    per_token_ms = 1000 * (streamer.times[-1] - streamer.times[2]) / (len(streamer.times) - 3)
    print(f"forwarding: {per_token_ms:.1f} ms per token through 3 servers behind {DELAY_MS} ms proxies")
    # after the prefill, spans 2 and 3 answer the copy pushed by the previous server; the client's own request races
    # the push by one proxy delay, and on a loaded 2-core CI machine a few steps lose that race (answered all the
    # same): most steps, not all, must be pushed ones (27 of 30 seen under CI load; 0 when pushing is broken)
    pushable = 2 * (NEW_TOKENS - 1)
    assert streamer.session.num_pushed_steps >= 3 * pushable // 4, streamer.session.num_pushed_steps


def test_middle_server_cut_off_mid_generation(chain, expected):
    servers, proxies, wan = chain
    cut: list[str] = []
    pushed_before_cut: list[int] = []

    def cut_off(session) -> None:
        middle = next(span.peer_id for span, _ in session.route if span.start == 2)
        index = next(i for i, server in enumerate(servers) if server.peer_id == middle)
        asyncio.run_coroutine_threadsafe(proxies[index].close(), wan.loop).result(10)
        cut.append(middle)
        pushed_before_cut.append(session.num_pushed_steps)

    streamer = AtToken(6, cut_off)
    assert _generate(servers, streamer) == expected
    middle_now = next(peer_id for peer_id, start, _ in streamer.route if start == 2)
    assert cut and middle_now != cut[0]
    # the replacement chain is pushed to as well: of the 10 decode steps after the cut's token, each a hop to spans 2
    # and 3 (20 hops, the replacement's replay among them), 17 were answered as pushed copies when seen unloaded, 0
    # where the new chain is not pushed to. Counted after the cut, not over the session, and 2 in 5 asked: each hop is
    # a race of the push with the client's own request (one proxy delay), which a pause of this process (GC, CPU
    # starvation; every server runs in it) makes lose more often: 19 and 21 pushed in all (the bar was 22 of 30, 9
    # of them before the cut) with two 0.35-0.77 s pauses (/work/notes/hflake2/loopstall.py)
    after_cut = streamer.session.num_pushed_steps - pushed_before_cut[0]
    hops = 2 * (NEW_TOKENS - 6)
    assert after_cut >= 2 * hops // 5, (pushed_before_cut, streamer.session.num_pushed_steps)
