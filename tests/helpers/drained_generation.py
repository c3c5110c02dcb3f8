"""A greedy generation whose serving server drains mid-way, through real processes (the slow hand-off tests): what
joins the swarm and the drain happen at the 3rd generated token; the client reports its one hand-off."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.client.session.handoff import HandoffRecord

PROMPT = torch.tensor([[1, 8, 27, 64, 125, 3, 9, 81, 11, 2, 40, 17]])
NEW_TOKENS = 8
HONEST = ("--block_indices", "0:4", "--throughput", "1.0", "--drain_timeout_s", "120")


class AtThirdToken:
    """A streamer that runs `action()` once, at the 3rd generated token (the first put is the prompt)."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action, self.count = action, 0

    def put(self, value: Any) -> None:
        self.count += 1
        if self.count == 4:
            self.action()

    def end(self) -> None:
        pass


def generate_through_a_drain(
    swarm: Any, model_path: Path, at_third_token: Callable[[], None]
) -> tuple[torch.Tensor, HandoffRecord, list[str], set[str], set[str]]:
    """`PROMPT` and `NEW_TOKENS` greedy tokens over the p2p path, `at_third_token()` run at the 3rd of them: (the ids,
    the session's one hand-off, its route after it, the peers the client avoided, those it banned)."""
    config = ClientConfig(
        update_period_s=60.0, min_backoff_s=0.2, max_backoff_s=1.0, liveness_check_period_s=1.0, max_wait_s=30.0,
        request_timeout_s=150.0, local_transport=False,
        max_pinged=0,  # no RTTs: the announced speeds order the replacements (a loris announcing itself first)
    )  # fmt: skip
    with AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm.initial_peers, client_config=config
    ) as model:
        model.manager.wait_ready()
        with model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS) as session:
            output = model.generate(
                PROMPT,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                session=session,
                streamer=AtThirdToken(at_third_token),
            )
            (record,) = session.handoffs.records
            route = [span.peer_id for span, _ in session.route]
        return output, record, route, model.manager.avoided_peers(), model.manager.bans.banned_peers()
