"""Per-token timing for `python -m benchmarks.wan`: a `generate(streamer=...)` sink that stamps each arrival, the
decode-phase latency per token from those stamps, and one corolla client mode's runs at the current link setting."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from corolla.utils.logging import get_logger

if TYPE_CHECKING:
    from corolla.client.models.distributed_model import DistributedModelForCausalLM

logger = get_logger(__name__)


class TokenClock:
    """A streamer: records (time, tokens) of every put after the prompt's."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, int]] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if self._prompt_seen:
            self.arrivals.append((now, int(value.numel())))
        self._prompt_seen = True

    def end(self) -> None:
        pass


def decode_ms_per_token(arrivals: list[tuple[float, int]]) -> float:
    """Mean milliseconds per token after the first arrival (which carries the prefill): (last - first) time over the
    tokens that arrived after the first put. Raises ValueError with fewer than 2 puts (nothing to time)."""
    if len(arrivals) < 2:
        raise ValueError(f"need at least 2 token arrivals to time decoding, got {len(arrivals)}")
    tokens = sum(n for _, n in arrivals[1:])
    return (arrivals[-1][0] - arrivals[0][0]) * 1000.0 / tokens


@dataclass
class ModeResult:
    """One mode at one (n, d): the decode latency per token of each run, its median, what was generated."""

    mode: str
    ms_per_token_runs: list[float] = field(default_factory=list)
    first_token_ms_runs: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    acceptance_rate: float | None = None
    error: str | None = None

    @property
    def ms_per_token(self) -> float | None:
        return statistics.median(self.ms_per_token_runs) if self.ms_per_token_runs else None

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "ms_per_token": self.ms_per_token,
            "ms_per_token_runs": self.ms_per_token_runs,
            "first_token_ms_runs": self.first_token_ms_runs,
            "tokens": self.tokens,
            "acceptance_rate": self.acceptance_rate,
            "error": self.error,
        }


def run_generate(
    model: DistributedModelForCausalLM, prompt: torch.Tensor, new_tokens: int, repeats: int, mode: str, **gen_kwargs
):
    """`repeats` greedy generations of `new_tokens` (EOS ignored), timed per token; returns a `ModeResult`."""
    result = ModeResult(mode)
    rates = []
    for _ in range(repeats):
        clock = TokenClock()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, streamer=clock, **gen_kwargs
            )
        result.ms_per_token_runs.append(decode_ms_per_token(clock.arrivals))
        result.first_token_ms_runs.append((clock.arrivals[0][0] - start) * 1000.0)
        result.tokens = out[0, prompt.shape[1] :].tolist()
        if "speculative" in gen_kwargs:  # generate(speculative=...) leaves its SpeculativeStats on the model
            stats = model.speculative_stats
            rate = stats.acceptance_rate if stats is not None else None
            if rate is not None:
                rates.append(rate)
    if rates:
        result.acceptance_rate = statistics.mean(rates)
    return result
