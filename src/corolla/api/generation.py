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
from corolla.api.sampling import SampledToken, Sampler, SamplingParams
from corolla.api.textstream import TextStream


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


@dataclass
class Finished:
    completion_tokens: int  # all choices together


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
) -> None:
    """Blocking: emits, per choice, `Delta`* then `ChoiceDone`; then `Finished`, or `Failed` on any error."""
    try:
        generator = request.params.make_generator()  # shared by the choices: a seeded request is reproducible
        started, total = time.perf_counter(), 0
        for index in range(request.n):
            done = _run_choice(backend, request, index, generator, emit, cancelled, metrics, started)
            if done is None:
                return
            total += done.completion_tokens
            emit(done)
        emit(Finished(total))
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
) -> ChoiceDone | None:
    params = request.params
    sampler = Sampler(params, request.prompt_ids, backend.eos_token_ids, generator)
    stream = TextStream(backend.decode, request.stops)
    want_logprobs = params.logprobs is not None
    pending: list[TokenLogprob] = []
    every: list[TokenLogprob] = []
    finish_reason, stop_reason, num_tokens = "length", None, 0
    last = started
    steps = backend.step_logits(request.prompt_ids, len(request.prompt_ids) + params.max_new_tokens)
    try:
        logits = next(steps)
        while True:
            if cancelled.is_set():
                return None
            sampled = sampler.choose(logits)
            token = sampled.token_id
            num_tokens += 1
            now = time.perf_counter()
            if metrics is not None:
                metrics.token(first=num_tokens == 1, since_s=None if (num_tokens == 1 and index > 0) else now - last)
            last = now
            if want_logprobs:
                entry = _logprob_entry(backend, sampled)
                pending.append(entry)
                every.append(entry)
            if token in params.stop_token_ids:
                finish_reason, stop_reason = "stop", token
                break
            if token in backend.eos_token_ids and not params.ignore_eos:
                finish_reason = "stop"
                break
            text, hit_stop = stream.push(token)
            if text:
                emit(Delta(index, text, pending))
                pending = []
            if hit_stop:
                finish_reason, stop_reason = "stop", _which_stop(stream.text, request.stops, stream)
                break
            if num_tokens >= params.max_new_tokens:
                break
            logits = steps.send(token)
    finally:
        steps.close()  # ends the inference session now, in this thread
    tail = stream.finish()
    if tail or pending:
        emit(Delta(index, tail, pending))
    return ChoiceDone(index, finish_reason, num_tokens, stream.text, every if want_logprobs else None, stop_reason)


def _which_stop(text: str, stops: list[str], stream: TextStream) -> str | None:
    full = stream.full_text
    for stop in sorted(stops, key=len, reverse=True):
        if full.startswith(stop, len(text)):
            return stop
    return None


def _logprob_entry(backend: GenerationBackend, sampled: SampledToken) -> TokenLogprob:
    assert sampled.logprob is not None
    top = tuple((backend.decode([t]), lp) for t, lp in sampled.top)
    return TokenLogprob(sampled.token_id, backend.decode([sampled.token_id]), sampled.logprob, top)
