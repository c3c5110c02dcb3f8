"""A chain whose second span has a float16 server (decisions 0170, 0186): blocks 0:2 in float32, 2:4 twice, once in
float16 (announced fastest, so routes go through it) and once in float32, on CPU (where corolla refuses float16 as
slow: the chain lets it), and a client's greedy run through it with what the client then bans and avoids."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.helpers.swarm import Swarm, inprocess_servers

from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.server import startup_checks

# a client that fails over within seconds and never waits on pings (the tests check where it went, not how fast)
FAST_CLIENT = ClientConfig(update_period_s=2.0, min_backoff_s=0.2, max_backoff_s=1.0, max_wait_s=20.0, max_pinged=0)


def _float16_on_cpu(original: Callable[..., torch.dtype]) -> Callable[..., torch.dtype]:
    """`startup_checks.resolve_dtype` that lets a CPU server run float16."""

    def resolve(model_config: Any, requested: str, device: Any) -> torch.dtype:
        return torch.float16 if requested == "float16" else original(model_config, requested, device)

    return resolve


@contextmanager
def float16_chain(
    model_path: Path, tmp_path_factory: pytest.TempPathFactory, first_also: Callable[[Swarm], Any] | None = None
) -> Iterator[tuple[Swarm, Any, Any]]:
    """The chain of the module docstring, on `model_path`: (the swarm, the float16 server, what `first_also(swarm)`
    returned: e.g. another server of 0:2 started before the in-process ones, or None)."""
    swarm = Swarm(tmp_path_factory.mktemp("swarm"))
    patch = pytest.MonkeyPatch()
    patch.setattr(startup_checks, "resolve_dtype", _float16_on_cpu(startup_checks.resolve_dtype))
    try:
        swarm.start_bootstrap()
        also = first_also(swarm) if first_also is not None else None
        spans = [
            (model_path, "0:2"),
            (model_path, "2:4", {"torch_dtype": "float16", "throughput": 1000.0}),
            (model_path, "2:4"),
        ]
        with inprocess_servers(spans, tmp_path_factory.mktemp("cache"), swarm.initial_peers) as servers:
            yield swarm, servers[1], also
    finally:
        swarm.close()
        patch.undo()


def greedy_through(
    swarm: Swarm, model_path: Path, prompt: torch.Tensor, new_tokens: int
) -> tuple[torch.Tensor, set[str], set[str]]:
    """A fresh client's greedy `new_tokens` after `prompt` through `swarm`: (its output, the peers it banned, the
    peers it avoided at the end)."""
    with AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm.initial_peers, client_config=FAST_CLIENT
    ) as model:
        model.manager.wait_ready()
        output = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        return output, model.manager.bans.banned_peers(), model.manager.avoided_peers()
