"""Speculative decoding through a 3-server chain of the demo model, each server behind a WAN proxy (benchmarks.wan_emulator,
5 ms one-way): greedy text with each drafter (prompt lookup, the demo draft model) is token-identical to plain
greedy with fewer passes through the swarm, and after a speculative generation (with rejections rolled back) the
servers' caches equal a fresh session's (a following step gives the same logits)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait

import pytest
import torch
from tests.helpers.ports import free_port
from tests.helpers.swarm import start_inprocess_server
from transformers import AutoTokenizer

from benchmarks.wan_emulator import LinkConfig, ProxyThread
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.client.speculative.acceptance import SpeculativeConfig
from corolla.demo.checkpoint import DEMO_CHECKPOINT_DIR

pytestmark = pytest.mark.timeout(180)

DELAY_MS = 5.0
SPANS = ((0, 1), (1, 3), (3, 4))
PROMPT = "The interpreter reads the source file and the source file is read by the interpreter and"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    """A client of the chain. The first server starts the swarm, the other two join it at once; all stop together."""
    cache_dirs = [tmp_path_factory.mktemp(f"cache{index}") for index in range(len(SPANS))]
    servers: list = []
    with ProxyThread() as wan, ThreadPoolExecutor(len(SPANS)) as pool:
        ports = [free_port() for _ in SPANS]
        proxies = [wan.add(port, LinkConfig(delay_ms=DELAY_MS)) for port in ports]

        def start(index: int, peers: tuple[str, ...] | None):
            return start_inprocess_server(
                DEMO_CHECKPOINT_DIR,
                cache_dirs[index],
                host_maddrs=(f"/ip4/127.0.0.1/tcp/{ports[index]}",),
                announce_maddrs=(f"/ip4/127.0.0.1/tcp/{proxies[index].port}",),
                local_socket=False,
                block_indices=SPANS[index],
                new_swarm=peers is None,
                initial_peers=peers,
                drain_timeout_s=0.0,  # no session to drain at the end
            )

        try:
            servers.append(start(0, None))
            peers = tuple(servers[0].join_maddrs)
            joining = [pool.submit(start, index, peers) for index in range(1, len(SPANS))]
            wait(joining)  # every start is waited for, so a failed one leaves no server running
            servers += [future.result() for future in joining if future.exception() is None]
            for future in joining:
                if future.exception() is not None:
                    raise RuntimeError("a server did not start") from future.exception()
            config = ClientConfig(max_retries=2, update_period_s=30.0, local_transport=False)
            with AutoDistributedModelForCausalLM.from_pretrained(
                DEMO_CHECKPOINT_DIR, initial_peers=list(peers), client_config=config
            ) as model:
                yield model
        finally:
            list(pool.map(lambda server: server.shutdown(), servers))


@pytest.fixture(scope="module")
def prompt_ids() -> torch.Tensor:
    return AutoTokenizer.from_pretrained(DEMO_CHECKPOINT_DIR)(PROMPT, return_tensors="pt")["input_ids"]


@pytest.fixture(scope="module")
def plain_greedy(model, prompt_ids) -> list[int]:
    with torch.no_grad():
        return model.generate(prompt_ids, max_new_tokens=40, do_sample=False).tolist()


@pytest.mark.parametrize("drafter", ["lookup", "draft"])
def test_greedy_is_token_identical_to_plain_greedy(model, prompt_ids, plain_greedy, drafter) -> None:
    with torch.no_grad():
        out = model.generate(
            prompt_ids, max_new_tokens=40, do_sample=False, speculative=SpeculativeConfig(drafter=drafter)
        )
    assert out.tolist() == plain_greedy
    stats = model.speculative_stats
    assert stats is not None and stats.generated_tokens == 40
    assert stats.accepted_tokens > 0 and stats.rounds < 40  # drafts were accepted: fewer passes than tokens
    assert stats.accepted_tokens < stats.drafted_tokens  # and some rejected: rollbacks happened


def test_rollback_leaves_caches_as_a_fresh_session(model, prompt_ids) -> None:
    torch.manual_seed(5)
    speculative = SpeculativeConfig(drafter="draft", num_draft_tokens=4)
    with torch.no_grad():
        with model.inference_session(max_length=160) as session:
            ids = model.generate(
                prompt_ids, max_new_tokens=20, do_sample=True, session=session, speculative=speculative
            )
            assert model.speculative_stats is not None and model.speculative_stats.accepted_tokens < (
                model.speculative_stats.drafted_tokens
            )
            assert session.position == ids.shape[1] - 1  # the last token is pending, as after plain generation
            after_rollback = model(ids[:, -1:], session=session).logits[0, -1]
        with model.inference_session(max_length=160) as fresh:
            expected = model(ids, session=fresh).logits[0, -1]
    torch.testing.assert_close(after_rollback, expected, atol=1e-4, rtol=0)


def test_batches_are_refused(model) -> None:
    with pytest.raises(ValueError, match="batch size 1"):
        model.generate(torch.tensor([[1, 2], [3, 4]]), max_new_tokens=2, speculative=SpeculativeConfig())
