"""The blocking generation loop of one API request (run in a worker thread): `n` choices one after another, each
sampled by a `Sampler` from the backend's logits, cut by EOS, `stop_token_ids` and stop strings; it emits events
(`Delta`, `ChoiceDone`, then `Finished` or `Failed`) that the event loop turns into HTTP responses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from corolla.api.backend import GenerationBackend
from corolla.api.metrics import ApiMetrics
from corolla.api.prompt_cache import counting_cached_tokens
from corolla.api.sampling import SampledToken, Sampler, SamplingParams
from corolla.api.speculative import run_speculative_choice
from corolla.api.textstream import TextStream
from corolla.client.speculative.acceptance import SpeculativeConfig


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its log-probability and the most likely alternatives, as text."""

    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[str, float], ...]


@dataclass
class Delta:
    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # tokens consumed since the previous delta


@dataclass
class ChoiceDone:
    index: int
    finish_reason: str  # "stop" | "length"
    completion_tokens: int
    text: str
    logprobs: list[TokenLogprob] | None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's field)
    cached_tokens: int = 0  # prompt tokens its session took from the servers' prefix caches


@dataclass
class Finished:
    completion_tokens: int  # all choices together
    cached_tokens: int = 0  # the prompt tokens the first choice took from the servers' prefix caches


@dataclass
class Failed:
    error: BaseException


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stops: list[str]
    n: int = 1


def run_generation(
    backend: GenerationBackend,
    request: GenerationRequest,
    emit: Callable[[Any], None],
    cancelled: threading.Event,
    metrics: ApiMetrics | None = None,
    speculative: SpeculativeConfig | None = None,
) -> None:
    """Blocking: emits, per choice, `Delta`* then `ChoiceDone`; then `Finished`, or `Failed` on any error. With
    `speculative` set, each choice drafts and verifies several tokens per pass (`corolla.api.speculative`)."""
    try:
        generator = request.params.make_generator()  # shared by the choices: a seeded request is reproducible
        started, total, cached = time.perf_counter(), 0, 0
        for index in range(request.n):
            with counting_cached_tokens() as counter:
                done = _run_choice(backend, request, index, generator, emit, cancelled, metrics, started, speculative)
            if done is None:
                return
            done.cached_tokens = counter.count
            cached = cached if index else counter.count
            total += done.completion_tokens
            emit(done)
        emit(Finished(total, cached))
    except BaseException as e:  # reported to the client; never kills the worker pool
        emit(Failed(e))


def _run_choice(
    backend: GenerationBackend,
    request: GenerationRequest,
    index: int,
    generator: Any,
    emit: Callable[[Any], None],
    cancelled: threading.Event,
    metrics: ApiMetrics | None,
    started: float,
    speculative: SpeculativeConfig | None = None,
) -> ChoiceDone | None:
    if cancelled.is_set():  # its client left while it waited for a thread: no session, no prefill for nobody
        return None
    params = request.params
    sampler = Sampler(params, request.prompt_ids, backend.eos_token_ids, generator)
    choice = _Choice(backend, request, index, emit, metrics, started)
    max_length = len(request.prompt_ids) + params.max_new_tokens
    if speculative is not None:
        with backend.verify_target(max_length) as target:
            run_speculative_choice(
                target, speculative, sampler, request.prompt_ids, params.max_new_tokens, choice.push, cancelled
            )
        return None if cancelled.is_set() and not choice.ended else choice.finish()
    steps = backend.step_logits(request.prompt_ids, max_length)
    try:
        logits = next(steps)
        while True:
            if cancelled.is_set():
                return None
            if choice.push(sampler.choose(logits)):
                break
            logits = steps.send(sampler.generated[-1])
    finally:
        steps.close()  # ends the inference session now, in this thread
    return choice.finish()


class _Choice:
    """What one choice has produced: counts tokens (metrics), collects log-probabilities, cuts at EOS, stop tokens,
    stop strings and the length limit, and emits `Delta`s of text."""

    def __init__(
        self,
        backend: GenerationBackend,
        request: GenerationRequest,
        index: int,
        emit: Callable[[Any], None],
        metrics: ApiMetrics | None,
        started: float,
    ):
        self.backend, self.request, self.index, self.emit, self.metrics = backend, request, index, emit, metrics
        self.stream = TextStream(backend.decode, request.stops)
        self.want_logprobs = request.params.logprobs is not None
        self.pending: list[TokenLogprob] = []
        self.every: list[TokenLogprob] = []
        self.finish_reason: str = "length"
        self.stop_reason: int | str | None = None
        self.num_tokens = 0
        self.last = started
        self.ended = False

    def push(self, sampled: SampledToken) -> bool:
        """Takes the next token; True when the choice ends with it."""
        params, token = self.request.params, sampled.token_id
        self.num_tokens += 1
        now = time.perf_counter()
        if self.metrics is not None:
            first = self.num_tokens == 1
            self.metrics.token(first=first, since_s=None if (first and self.index > 0) else now - self.last)
        self.last = now
        if self.want_logprobs:
            entry = _logprob_entry(self.backend, sampled)
            self.pending.append(entry)
            self.every.append(entry)
        self.ended = self._ends(token, params)
        return self.ended

    def _ends(self, token: int, params: SamplingParams) -> bool:
        if token in params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token
            return True
        if token in self.backend.eos_token_ids and not params.ignore_eos:
            self.finish_reason = "stop"
            return True
        text, hit_stop = self.stream.push(token)
        if text:
            self.emit(Delta(self.index, text, self.pending))
            self.pending = []
        if hit_stop:
            self.finish_reason = "stop"
            self.stop_reason = self.stream.stop
            return True
        return self.num_tokens >= params.max_new_tokens

    def finish(self) -> ChoiceDone:
        tail = self.stream.finish()
        if tail or self.pending:
            self.emit(Delta(self.index, tail, self.pending))
        logprobs = self.every if self.want_logprobs else None
        return ChoiceDone(self.index, self.finish_reason, self.num_tokens, self.stream.text, logprobs, self.stop_reason)


def _logprob_entry(backend: GenerationBackend, sampled: SampledToken) -> TokenLogprob:
    assert sampled.logprob is not None
    top = tuple((backend.decode([t]), lp) for t, lp in sampled.top)
    return TokenLogprob(sampled.token_id, backend.decode([sampled.token_id]), sampled.logprob, top)
