"""Shared pieces of the family end-to-end tests (`test_families_fam_a.py`, `test_families_fam_b.py`): one loopback
swarm per module with every family's servers started at once (`served_families`), local transformers references
(one model load per family and process), a chat request through corolla-api, and a streamer that SIGKILLs the
server of a session's first span mid-generation (for the families served twice: the fail-over path is the client's
and the same for every family; it runs for the family whose replayed cache differs most, not for all of them)."""

from __future__ import annotations

import functools
import json
import signal
import urllib.request
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from corolla.api.app import create_app
from corolla.api.backend import SwarmBackend
from corolla.api.serving import serve_in_thread
from helpers.swarm import Swarm, bootstrapped, inprocess_servers
from helpers.tiny_models import make_tiny_model

CHAT_TIMEOUT_S = 60


@contextmanager
def served_families(
    tmp_path_factory: pytest.TempPathFactory,
    families: Sequence[str],
    chat_template: str,
    *,
    replicated: Collection[str] = (),
    bootstrap_timeout_s: float = 60.0,
    ready_timeout_s: float = 120.0,
) -> Iterator[tuple[Swarm, dict[str, Path]]]:
    """Tiny 2-layer models of `families` (with `chat_template` in their tokenizers, as real ones carry), each served
    by one server holding blocks 0:2 in this process (what it serves is under test, not its process), those of
    `replicated` by two server processes (one is SIGKILLed); every server is started before any is waited for."""
    models_dir = tmp_path_factory.mktemp("models")
    paths = {family: make_tiny_model(family, models_dir, num_layers=2) for family in families}
    for path in paths.values():
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(path)
    with bootstrapped(tmp_path_factory.mktemp("swarm"), timeout_s=bootstrap_timeout_s) as swarm:
        servers = [
            swarm.start_server(paths[family], "--block_indices", "0:2", "--throughput", "1.0", wait=False)
            for family in families
            if family in replicated
            for _ in range(2)
        ]
        singles = [(paths[family], "0:2") for family in families if family not in replicated]
        cache_dir = tmp_path_factory.mktemp("cache")
        with inprocess_servers(singles, cache_dir, swarm.initial_peers):
            for server in servers:
                server.wait_ready(ready_timeout_s)
            yield swarm, paths


@functools.cache
def local_model(path: Path) -> Any:
    """The float32 transformers model at `path` (loaded once per process; tests only read it)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def local_greedy(path: Path, ids: torch.Tensor, new_tokens: int) -> list[int]:
    """Local greedy decoding of exactly `new_tokens` (`min_new_tokens`: EOS banned until then), prompt included. Every
    position is attended, as in the swarm: without a mask, `generate` masks each token equal to the pad id (0 in the
    tiny models, which a conversation's earlier answer may hold)."""
    with torch.no_grad():
        out = local_model(path).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    return out[0].tolist()


def local_argmax_tokens(path: Path, ids: torch.Tensor, new_tokens: int) -> list[int]:
    """What `ignore_eos` greedy decoding gives: the argmax even when it is EOS (unlike `min_new_tokens`, which bans
    EOS and so picks the runner-up); new tokens only."""
    seq = ids  # [1, T]
    with torch.no_grad():
        for _ in range(new_tokens):
            next_id = local_model(path)(seq).logits[:, -1].argmax(dim=-1, keepdim=True)  # [1, 1]
            seq = torch.cat([seq, next_id], dim=1)
    return seq[0, ids.shape[1] :].tolist()


def chat_through_api(model: Any, tokenizer: Any, family: str, messages: list[dict[str, str]]) -> dict:
    """One greedy (`ignore_eos`) 8-token chat completion through corolla-api on `model`, as parsed JSON."""
    backend = SwarmBackend(model, tokenizer, model_id=family)
    with serve_in_thread(create_app(backend)) as running:
        body = {"model": family, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(
            f"http://127.0.0.1:{running.port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=CHAT_TIMEOUT_S) as response:
            return json.loads(response.read())


class KillAt:
    """A streamer that SIGKILLs the server of the session's first span at generated token `at`."""

    def __init__(self, swarm: Swarm, at: int):
        self.swarm, self.at, self.count = swarm, at, 0
        self.session: Any = None
        self.killed: list[Any] = []

    def put(self, value: torch.Tensor) -> None:
        self.count += 1
        if self.count == self.at + 1:  # the first put is the prompt
            peer_id = self.session._spans[0].span.peer_id
            victim = next(p for p in self.swarm.processes if getattr(p, "peer_id", None) == peer_id)
            victim.signal(signal.SIGKILL)
            self.killed.append(victim)

    def end(self) -> None:
        pass
