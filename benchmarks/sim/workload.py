"""The workload: conversations (multi-turn sessions) with a region, an arrival time and per-turn prompt and output
lengths, either generated (open Poisson arrivals or a closed loop of clients) with published averages, or read from
a JSON-lines trace. Defaults are LMSYS-Chat-1M's averages (Zheng et al. 2023, table 1: 2.0 turns per conversation,
69.5 prompt and 214.5 response tokens per turn); think and idle times are assumptions."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.sim.regions import REGIONS

MAX_TRACE_LINES = 10_000_000
LENGTH_SIGMA = 1.0  # lognormal spread of prompt/output lengths around their means (assumption)


@dataclass(frozen=True)
class Conversation:
    """One client session: turns of (prompt tokens, output tokens), opened at `arrival_s` from `region`."""

    arrival_s: float
    region: str
    turns: tuple[tuple[int, int], ...]

    @property
    def total_tokens(self) -> int:
        return sum(p + o for p, o in self.turns)


@dataclass(frozen=True)
class WorkloadConfig:
    """Open arrivals (`sessions_per_hour`) or a closed loop (`concurrent_clients`, each keeping
    `sessions_per_client` conversations open from its region, the next one `mean_idle_s` after the last one ended:
    an application serving its users), or a `trace_path`."""

    sessions_per_hour: float | None = None
    concurrent_clients: int | None = None
    sessions_per_client: int = 1
    trace_path: str | None = None
    mean_turns: float = 2.0
    mean_prompt_tokens: float = 69.5
    mean_output_tokens: float = 214.5
    mean_think_s: float = 20.0
    mean_idle_s: float = 30.0
    max_context_tokens: int = 4096
    region_weights: Mapping[str, float] = field(default_factory=lambda: {r: 1.0 for r in REGIONS})

    def __post_init__(self) -> None:
        modes = [self.sessions_per_hour is not None, self.concurrent_clients is not None, self.trace_path is not None]
        if sum(modes) != 1:
            raise ValueError("set exactly one of sessions_per_hour, concurrent_clients, trace_path")
        unknown = set(self.region_weights) - set(REGIONS)
        if unknown:
            raise ValueError(f"unknown regions {sorted(unknown)}; regions are {REGIONS}")
        if self.sessions_per_client < 1:
            raise ValueError(f"sessions_per_client must be >= 1, got {self.sessions_per_client}")
        if self.mean_turns < 1:
            raise ValueError(f"mean_turns must be >= 1, got {self.mean_turns}")


def _lognormal_int(rng: random.Random, mean: float) -> int:
    mu = math.log(mean) - LENGTH_SIGMA**2 / 2
    return max(1, round(rng.lognormvariate(mu, LENGTH_SIGMA)))


class WorkloadGenerator:
    """Draws conversations from a config with its own random stream."""

    def __init__(self, config: WorkloadConfig, rng: random.Random):
        self.config, self.rng = config, rng
        self.regions = [r for r in REGIONS if config.region_weights.get(r, 0) > 0]
        self.weights = [config.region_weights[r] for r in self.regions]

    def region(self) -> str:
        return self.rng.choices(self.regions, weights=self.weights, k=1)[0]

    def conversation(self, arrival_s: float, region: str | None = None) -> Conversation:
        c, rng = self.config, self.rng
        turns_count = 1
        while rng.random() > 1 / c.mean_turns:  # geometric with mean `mean_turns`
            turns_count += 1
        turns: list[tuple[int, int]] = []
        context = 0
        for _ in range(turns_count):
            prompt, output = _lognormal_int(rng, c.mean_prompt_tokens), _lognormal_int(rng, c.mean_output_tokens)
            if context + prompt + output > c.max_context_tokens:
                break
            turns.append((prompt, output))
            context += prompt + output
        if not turns:
            prompt = min(_lognormal_int(rng, c.mean_prompt_tokens), c.max_context_tokens // 2)
            turns.append((prompt, c.max_context_tokens - prompt))
        return Conversation(arrival_s, region or self.region(), tuple(turns))

    def open_arrivals(self, duration_s: float) -> list[Conversation]:
        rate = (self.config.sessions_per_hour or 0.0) / 3600.0
        arrivals, t = [], 0.0
        while rate > 0:
            t += self.rng.expovariate(rate)
            if t >= duration_s:
                break
            arrivals.append(self.conversation(t))
        return arrivals

    def idle_s(self) -> float:
        return self.rng.expovariate(1 / self.config.mean_idle_s)

    def think_s(self) -> float:
        return self.rng.expovariate(1 / self.config.mean_think_s)


def read_trace(path: str | Path, *, max_context_tokens: int = 4096) -> list[Conversation]:
    """Conversations from JSON lines `{"arrival_s": 1.5, "region": "europe", "turns": [[prompt, output], ...]}`,
    every field checked; sorted by arrival."""
    conversations = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if number > MAX_TRACE_LINES:
                raise ValueError(f"{path}: more than {MAX_TRACE_LINES} lines")
            if not line.strip():
                continue
            record = json.loads(line)
            arrival, region, turns = record.get("arrival_s"), record.get("region"), record.get("turns")
            if not isinstance(arrival, (int, float)) or not arrival >= 0:
                raise ValueError(f"{path}:{number}: arrival_s must be a number >= 0, got {arrival!r}")
            if region not in REGIONS:
                raise ValueError(f"{path}:{number}: region must be one of {REGIONS}, got {region!r}")
            if not isinstance(turns, list) or not turns:
                raise ValueError(f"{path}:{number}: turns must be a non-empty list")
            parsed = []
            for turn in turns:
                if (
                    not isinstance(turn, list)
                    or len(turn) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in turn)
                ):
                    raise ValueError(f"{path}:{number}: each turn must be [prompt_tokens >= 1, output_tokens >= 1]")
                parsed.append((turn[0], turn[1]))
            if sum(p + o for p, o in parsed) > max_context_tokens:
                raise ValueError(f"{path}:{number}: conversation longer than {max_context_tokens} tokens")
            conversations.append(Conversation(float(arrival), region, tuple(parsed)))
    return sorted(conversations, key=lambda c: c.arrival_s)
