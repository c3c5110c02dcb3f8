"""One run of the prefix benchmark: a loopback chain of two CPU servers (`corolla.swarm.local.LocalSwarm`), two
in-process corolla-api gateways over it, one with the client's prefix reuse off and one with it on, and the same
workload replayed through both, request by request in turn (the off way sends no keys, so it leaves nothing in the
servers' caches; its sessions' pages may evict idle cached ones under memory pressure, as other traffic would);
greedy answers must be identical both ways."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.prefix.checkpoint import ModelShape, vocabulary, word_ids, write_checkpoint
from benchmarks.prefix.replay import TurnResult, replay
from benchmarks.prefix.workload import Conversation, WorkloadConfig, generate_conversations

MODEL_ID = "prefix-bench-llama"
# a greedy choice this close to a tie (in nats, without the cache) may flip when a prefix's KV comes from another
# computation (float32 sums in another order): such a divergence, and everything after it in that conversation, is
# reported as a near tie; any other divergence is a bug
NEAR_TIE_NATS = 1e-3


@dataclass
class PassReport:
    """One way's results over the workload."""

    prefix_reuse: bool
    results: list[TurnResult]

    @property
    def ok(self) -> list[TurnResult]:
        return [r for r in self.results if r.error is None]

    @property
    def errors(self) -> int:
        return len(self.results) - len(self.ok)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.ok)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.ok)

    @property
    def saved_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        return sum(r.cached_tokens > 0 for r in self.ok) / len(self.ok) if self.ok else 0.0

    def decode_p50_ms(self) -> float:
        times = [r.decode_s_per_token for r in self.ok if r.decode_s_per_token is not None]
        return 1000 * statistics.median(times) if times else float("nan")

    def ttft_p50_s(self, *, later_turns_only: bool = False) -> float:
        times = [r.ttft_s for r in self.ok if r.ttft_s is not None and (r.turn > 0 or not later_turns_only)]
        return statistics.median(times) if times else float("nan")


@dataclass
class RunReport:
    off: PassReport
    on: PassReport
    num_conversations: int
    num_turns: int
    shape: ModelShape
    mismatched_answers: int  # turns whose answers differ between the ways
    unexplained_mismatches: int  # of those, divergences not at a near tie nor after one in the same conversation
    wall_s: float  # the replay, both ways
    server_args: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)

    @property
    def ttft_speedup(self) -> float:
        return self.off.ttft_p50_s() / self.on.ttft_p50_s()

    def summary(self) -> dict[str, Any]:
        return {
            "conversations": self.num_conversations,
            "requests": self.num_turns,
            "prompt_tokens": self.on.prompt_tokens,
            "prefill_tokens_saved": self.on.cached_tokens,
            "prefill_saved_fraction": round(self.on.saved_fraction, 4),
            "request_hit_rate": round(self.on.request_hit_rate, 4),
            "ttft_p50_off_s": round(self.off.ttft_p50_s(), 4),
            "ttft_p50_on_s": round(self.on.ttft_p50_s(), 4),
            "ttft_p50_speedup": round(self.ttft_speedup, 3),
            "ttft_p50_later_turns_off_s": round(self.off.ttft_p50_s(later_turns_only=True), 4),
            "ttft_p50_later_turns_on_s": round(self.on.ttft_p50_s(later_turns_only=True), 4),
            "decode_ms_per_token_p50_off": round(self.off.decode_p50_ms(), 2),
            "decode_ms_per_token_p50_on": round(self.on.decode_p50_ms(), 2),
            "errors_off": self.off.errors,
            "errors_on": self.on.errors,
            "mismatched_answers": self.mismatched_answers,
            "unexplained_mismatches": self.unexplained_mismatches,
            "wall_s": round(self.wall_s, 1),
            "model": f"llama hidden={self.shape.hidden_size} layers={self.shape.num_layers} (random weights, float32)",
            "server_args": " ".join(self.server_args),
            "notes": self.notes,
        }


# a loopback chain of two servers on the model at a path, with these server flags: its initial peers while entered
ChainStarter = Callable[[Path, Sequence[str]], AbstractContextManager[Sequence[str]]]


@contextlib.contextmanager
def server_processes(path: Path, server_args: Sequence[str]) -> Iterator[Sequence[str]]:
    """The benchmark's chain: two server processes splitting the blocks (`corolla.swarm.local.LocalSwarm`)."""
    from corolla.models.config import load_config
    from corolla.swarm.local import LocalSwarm, LocalSwarmConfig, even_block_ranges

    config = LocalSwarmConfig(server_args=tuple(server_args), startup_timeout_s=180.0, stop_grace_s=10.0)
    with LocalSwarm(config) as swarm:
        swarm.start(path, even_block_ranges(load_config(str(path)).num_hidden_layers, 2))
        yield swarm.initial_peers


def run(
    workdir: str | Path,
    *,
    workload: WorkloadConfig,
    shape: ModelShape,
    server_args: Sequence[str] = (),
    concurrency: int = 1,
    conversations: list[Conversation] | None = None,
    start_chain: ChainStarter = server_processes,
) -> RunReport:
    """Writes the model, starts the chain (`start_chain`) and the two gateways, replays the workload both ways;
    everything is stopped before it returns."""
    import openai

    from corolla.api.app import ApiConfig, create_app
    from corolla.api.backend import load_swarm_backend
    from corolla.api.serving import serve_in_thread

    path = write_checkpoint(Path(workdir) / f"model-h{shape.hidden_size}-l{shape.num_layers}", shape)
    if conversations is None:
        conversations = generate_conversations(workload, vocabulary(shape))
    extra = {"ignore_eos": True, "allowed_token_ids": word_ids(path)}
    # float32 blocks (a float32 checkpoint is served in bfloat16 by default): bfloat16's rounding (~1e-2 of a logit)
    # would flip many near ties of a random model between the passes and hide a real divergence among them
    all_server_args = ("--torch_dtype", "float32", *server_args)
    with start_chain(path, all_server_args) as initial_peers, contextlib.ExitStack() as stack:
        backends = []  # (the cache off, on)
        for _ in range(2):
            backends.append(load_swarm_backend(str(path), initial_peers=initial_peers, model_id=MODEL_ID))
            stack.callback(backends[-1].model.shutdown)
        gateways = [stack.enter_context(serve_in_thread(create_app(backend, ApiConfig()))) for backend in backends]
        clients = [
            openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=600)
            for gateway in gateways
        ]
        for backend in backends:
            backend.model.manager.config.prefix_reuse = False  # warm-up requests, counted nowhere, keyed nowhere
        replay(clients, MODEL_ID, conversations[:1], extra=extra)
        backends[1].model.manager.config.prefix_reuse = True
        started = time.perf_counter()
        off_results, on_results = replay(clients, MODEL_ID, conversations, extra=extra, concurrency=concurrency)
        wall_s = time.perf_counter() - started
    off, on = PassReport(False, off_results), PassReport(True, on_results)
    off_by_turn = {(r.conversation, r.turn): r for r in off.ok}
    notes, mismatched, unexplained, diverged = [], 0, 0, set()
    for r in sorted(on.ok, key=lambda r: (r.conversation, r.turn)):
        other = off_by_turn.get((r.conversation, r.turn))
        if other is None or other.answer != r.answer:
            mismatched += 1
            a, b = (other.answer if other else "").split(), r.answer.split()
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            margin = other.margins[first] if other and other.margins and first < len(other.margins) else None
            if r.conversation not in diverged and (margin is None or margin >= NEAR_TIE_NATS):
                unexplained += 1
            diverged.add(r.conversation)
            notes.append(
                f"conversation {r.conversation} turn {r.turn}: answers differ from word {first} of {len(b)} "
                f"(greedy margin there without the cache: {margin if margin is None else f'{margin:.2e}'} nats)"
            )
    num_turns = sum(len(c.turns) for c in conversations)
    return RunReport(
        off, on, len(conversations), num_turns, shape, mismatched, unexplained, wall_s, all_server_args, notes
    )
