"""The FastAPI app of `corolla-api`: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (plain JSON or SSE
chunks exactly as OpenAI sends them, ending in `data: [DONE]`; `n` choices, logprobs, every OpenAI and vLLM sampling
parameter honored or refused with a 400 naming it), the service routes of `service_routes` (`/health`, `/version`,
`/tokenize`, `/detokenize`, `/metrics`), API-key check and OpenAI-style errors. Sampling fields a request leaves
unset take the model's `generation_config.json` values (`backend.generation_defaults`), then OpenAI's defaults.

Each request runs its blocking generation loop in a worker thread of its own, so concurrent requests are concurrent
inference sessions in the swarm (which the servers may batch); the event loop only moves text between them.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from corolla.api.admission import Admission
from corolla.api.backend import GenerationBackend
from corolla.api.chat_page import install_chat_page
from corolla.api.errors import ApiError, invalid_param
from corolla.api.generation import ChoiceDone, Delta, Failed, Finished, GenerationRequest, TokenLogprob, run_generation
from corolla.api.metrics import ApiMetrics
from corolla.api.openai_objects import chat_logprobs, completion_logprobs, envelope, usage
from corolla.api.request_handling import (
    DEFAULT_MAX_REQUEST_BYTES,
    RequestCounter,
    error_for,
    parse_body,
    validation_message,
)
from corolla.api.route_trace import DEFAULT_ROUTE_LOG_ENTRIES
from corolla.api.sampling import SamplingParams
from corolla.api.schemas import ChatCompletionRequest, CompletionRequest
from corolla.api.service_routes import add_service_routes
from corolla.client.speculative.acceptance import SpeculativeConfig


@dataclass
class ApiConfig:
    api_key: str | None = None  # when set, every /v1 request needs `Authorization: Bearer <api_key>`
    model_aliases: tuple[str, ...] = ()  # extra names accepted in the `model` field besides backend.model_id
    unlisted_model_names: tuple[str, ...] = ()  # accepted in `model` but not listed by /v1/models (the --model path)
    max_concurrent_requests: int = 64  # generation threads; further requests wait for a free one
    max_queued_requests: int = 256  # requests that may wait for a thread; past them (and the threads) a 429
    max_requests_per_client: int = 64  # running or waiting, from one non-loopback address (api.admission); then 429
    retry_after_s: int = 1  # the Retry-After of a 429
    default_chat_max_tokens: int = 512  # chat requests without max_tokens get min(this, context left)
    sse_ping_interval_s: float = 15.0  # keep-alive comments on idle streams
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413, refused before they are read
    max_n: int = 8  # choices per request (`n`); more is a 400
    max_logprobs: int = 20  # `logprobs` (completions) / `top_logprobs` (chat) above it is a 400 (vLLM's default)
    route_log_entries: int = DEFAULT_ROUTE_LOG_ENTRIES  # generations whose route /corolla/route keeps (0 = off)
    speculative: SpeculativeConfig | None = None  # opt-in speculative decoding of every choice (api.speculative)

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_concurrent_requests < 1 or self.max_queued_requests < 0 or self.max_requests_per_client < 1:
            raise ValueError(
                "max_concurrent_requests and max_requests_per_client must be >= 1 and max_queued_requests >= 0, got "
                f"{self.max_concurrent_requests}, {self.max_requests_per_client}, {self.max_queued_requests}"
            )
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.max_n < 1 or self.max_logprobs < 0:
            raise ValueError(f"max_n must be >= 1 and max_logprobs >= 0, got {self.max_n}, {self.max_logprobs}")


async def next_event(queue: asyncio.Queue, hung_up: asyncio.Future) -> Any:
    """The generation's next event; ApiError 499 once `hung_up` (`client_gone`) is done first."""
    getting = asyncio.ensure_future(queue.get())
    await asyncio.wait({getting, hung_up}, return_when=asyncio.FIRST_COMPLETED)
    if not getting.done():
        getting.cancel()
        raise ApiError(499, "The client closed the request", code="client_closed_request")
    return getting.result()


async def client_gone(request: Request) -> None:
    """Returns once the client of `request` (its body already read) has hung up: the server's next ASGI message for
    it is then the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(backend: GenerationBackend, config: ApiConfig | None = None) -> FastAPI:
    """Builds the gateway around `backend` (owns a thread pool that closes with the app's lifespan)."""
    config = config or ApiConfig()
    model_names = {backend.model_id, *config.model_aliases}
    accepted_names = model_names | set(config.unlisted_model_names)
    executor = ThreadPoolExecutor(max_workers=config.max_concurrent_requests, thread_name_prefix="corolla-api-gen")
    created = int(time.time())
    metrics = ApiMetrics()
    defaults = dict(getattr(backend, "generation_defaults", None) or {})

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="corolla OpenAI-compatible API", lifespan=lifespan)
    app.state.backend = backend
    app.state.config = config
    app.state.metrics = metrics

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return ApiError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, str(exc.detail), code=code).response()

    generation_paths = ("/v1/completions", "/v1/chat/completions")
    app.add_middleware(  # inside RequestCounter (added after it: outer), which counts its 429s too
        Admission,
        paths=generation_paths,
        max_in_flight=config.max_concurrent_requests + config.max_queued_requests,
        max_per_client=config.max_requests_per_client,
        retry_after_s=config.retry_after_s,
    )
    app.add_middleware(RequestCounter, metrics=metrics, paths=generation_paths)

    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")

    def check_model(name: str) -> None:
        if name not in accepted_names:
            raise ApiError(
                404,
                f"The model `{name}` does not exist; this gateway serves {sorted(model_names)}",
                param="model",
                code="model_not_found",
            )

    async def parse(request: Request, choose: Callable[[dict], type[BaseModel]], kind: str | None = None) -> Any:
        return await parse_body(request, choose, config.max_request_bytes, kind)

    add_service_routes(app, backend, metrics, parse=parse, check_auth=check_auth, check_model=check_model)
    install_chat_page(app, check_auth, route_log_entries=config.route_log_entries)  # `/`, `/corolla/route`

    def check_token_ids(ids: list[int], param: str) -> None:
        vocab_size = getattr(backend, "vocab_size", None)
        if any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in ids):
            raise invalid_param(f"Token ids must be in [0, {vocab_size}) for this model", param)

    def budget(prompt_ids: list[int], requested: int | None, default: int, param: str, prompt_param: str) -> int:
        if not prompt_ids:
            raise invalid_param("The prompt is empty after tokenization", prompt_param)
        ctx = backend.max_context_tokens
        left = ctx - len(prompt_ids)
        max_tokens = requested if requested is not None else min(default, left)
        if max_tokens < 1 or len(prompt_ids) + max_tokens > ctx:
            raise ApiError(
                400,
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or the completion.",
                param=param,
                code="context_length_exceeded",
            )
        return max_tokens

    def generation_request(
        req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int], max_tokens: int, logprobs: int | None
    ) -> GenerationRequest:
        """The request's sampling: its own values, else generation_config.json's, else OpenAI's defaults."""
        n = req.n or 1
        if n > config.max_n:
            raise invalid_param(f"n must be <= {config.max_n} (--max_n), got {n}", "n")
        if logprobs is not None and logprobs > config.max_logprobs:
            param = "logprobs" if isinstance(req, CompletionRequest) else "top_logprobs"
            raise invalid_param(f"{param} must be <= {config.max_logprobs} (--max_logprobs), got {logprobs}", param)
        for param in ("stop_token_ids", "allowed_token_ids"):
            check_token_ids(list(getattr(req, param) or ()), param)
        try:
            bias = tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items())
        except ValueError:
            raise invalid_param("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
        check_token_ids([t for t, _ in bias], "logit_bias")

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(req, name)
            return value if value is not None else defaults.get(name, fallback)

        try:
            params = SamplingParams(
                max_new_tokens=max_tokens,
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0),
                repetition_penalty=pick("repetition_penalty", 1.0),
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                min_tokens=req.min_tokens,
                ignore_eos=req.ignore_eos,
                stop_token_ids=frozenset(req.stop_token_ids or ()),
                logit_bias=bias,
                allowed_token_ids=tuple(req.allowed_token_ids) if req.allowed_token_ids is not None else None,
                logprobs=logprobs,
                seed=req.seed,
            )
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            raise invalid_param(str(e), name if name in SamplingParams.__dataclass_fields__ else None) from None
        return GenerationRequest(prompt_ids, params, req.stop_list, n)

    async def start_generation(request: GenerationRequest) -> tuple[asyncio.Queue, threading.Event]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def emit(event: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the loop has closed (shutdown): nobody is listening
                cancelled.set()

        metrics.prompt_tokens(len(request.prompt_ids) * request.n)
        # the context goes along: the backend reports this request's route to its trace (`api.route_trace`)
        context = contextvars.copy_context()
        loop.run_in_executor(
            executor, context.run, run_generation, backend, request, emit, cancelled, metrics, config.speculative
        )
        return queue, cancelled

    async def complete(request: GenerationRequest, http: Request) -> list[ChoiceDone]:
        """The choices of a non-streaming request; ApiError 499 once its client hangs up (the generation stops at its
        next token instead of running to max_tokens for nobody, holding a worker and its swarm session)."""
        queue, cancelled = await start_generation(request)
        metrics.running(1)
        hung_up = asyncio.ensure_future(client_gone(http))
        try:
            choices: list[ChoiceDone] = []
            while True:
                event = await next_event(queue, hung_up)
                if isinstance(event, ChoiceDone):
                    choices.append(event)
                elif isinstance(event, Finished):
                    return choices
                elif isinstance(event, Failed):
                    raise error_for(event.error, backend.model_id)
        finally:
            hung_up.cancel()
            metrics.running(-1)
            cancelled.set()

    async def respond(
        http: Request,
        req: CompletionRequest | ChatCompletionRequest,
        gen: GenerationRequest,
        prompt_ids: list[int],
        done_choice: Callable[[ChoiceDone], dict[str, Any]],
        chunk_choice: Callable[[int, str | None, ChoiceDone | None, list[TokenLogprob]], dict[str, Any]],
        prelude: tuple[dict[str, Any], ...] = (),  # chat: a first chunk per choice naming its role
    ) -> Any:
        """The response in OpenAI's shape: one object, or (`stream`) SSE chunks of `chunk_choice`s after `prelude`'s,
        then a usage chunk when `stream_options.include_usage`, then `[DONE]`. Choices end with `finish_reason` and
        `stop_reason`."""
        chat = isinstance(req, ChatCompletionRequest)
        rid, now = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        if not req.stream:
            done = await complete(gen, http)
            choices = [{**done_choice(d), "finish_reason": d.finish_reason, "stop_reason": d.stop_reason} for d in done]
            usage_now = usage(len(prompt_ids), sum(d.completion_tokens for d in done), done[0].cached_tokens)
            return envelope(
                rid, "chat.completion" if chat else "text_completion", now, req.model, choices, usage=usage_now
            )
        kind = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choice: dict[str, Any], done: ChoiceDone | None) -> str:
            choice["finish_reason"] = done.finish_reason if done else None
            if done is not None:
                choice["stop_reason"] = done.stop_reason
            return json.dumps(
                envelope(rid, kind, now, req.model, [choice], **({"usage": None} if include_usage else {}))
            )

        queue, cancelled = await start_generation(gen)
        # Wait for the first event so that failures before any output get a proper HTTP status (and for the client:
        # one that hangs up while its request waits for a thread opens no session; from the first chunk on, the SSE
        # response sees the hang-up)
        hung_up = asyncio.ensure_future(client_gone(http))
        try:
            first = await next_event(queue, hung_up)
        except ApiError:
            cancelled.set()
            raise
        finally:
            hung_up.cancel()
        if isinstance(first, Failed):
            cancelled.set()
            raise error_for(first.error, backend.model_id)

        async def events() -> AsyncIterator[str]:
            metrics.running(1)
            try:
                for choice in prelude:
                    yield chunk(choice, None)
                event = first
                while True:
                    if isinstance(event, Delta):
                        yield chunk(chunk_choice(event.index, event.text, None, event.logprobs), None)
                    elif isinstance(event, ChoiceDone):
                        yield chunk(chunk_choice(event.index, None, event, []), event)
                    elif isinstance(event, Finished):
                        if include_usage:
                            final = usage(len(prompt_ids), event.completion_tokens, event.cached_tokens)
                            yield json.dumps(envelope(rid, kind, now, req.model, [], usage=final))
                        yield "[DONE]"
                        return
                    elif isinstance(event, Failed):
                        yield json.dumps(error_for(event.error, backend.model_id).body())
                        return
                    event = await queue.get()
            finally:
                metrics.running(-1)
                cancelled.set()  # also on client disconnect: the worker stops at its next token

        return EventSourceResponse(events(), sep="\n", ping=config.sse_ping_interval_s)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "corolla"}

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        check_auth(request)
        return {"object": "list", "data": [model_card(name) for name in sorted(model_names)]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request) -> dict[str, Any]:
        check_auth(request)
        check_model(name)
        return model_card(name)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        check_auth(request)
        req: CompletionRequest = await parse(request, lambda body: CompletionRequest, "completion")
        check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise invalid_param("Only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        # The schema's lists are homogeneous (pydantic took one branch of the union): a list left here, whose
        # first item is a token id (or that is empty), is all token ids, which mypy cannot infer from one item.
        prompt_ids = backend.encode(prompt) if isinstance(prompt, str) else list(cast("list[int]", prompt))
        check_token_ids(prompt_ids, "prompt")
        max_tokens = budget(prompt_ids, req.max_tokens, 16, "max_tokens", "prompt")
        gen = generation_request(req, prompt_ids, max_tokens, req.logprobs)
        offsets = [0] * gen.n  # text offset of the next logprobs entry, per choice

        def logprobs_of(index: int, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
            if entries is None or gen.params.logprobs is None:
                return None
            return completion_logprobs(entries, offsets, index)

        def done_choice(d: ChoiceDone) -> dict[str, Any]:
            return {"text": d.text, "index": d.index, "logprobs": logprobs_of(d.index, d.logprobs)}

        def chunk_choice(index: int, text: str | None, done: ChoiceDone | None, entries: list[TokenLogprob]) -> dict:
            return {
                "text": text or "",
                "index": index,
                "logprobs": logprobs_of(index, entries) if done is None else None,
            }

        return await respond(request, req, gen, prompt_ids, done_choice, chunk_choice)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        check_auth(request)
        req: ChatCompletionRequest = await parse(request, lambda body: ChatCompletionRequest, "chat")
        check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid_param("top_logprobs needs logprobs=true", "top_logprobs")
        try:
            messages = [m.as_dict() for m in req.messages]
        except ValueError as e:
            raise invalid_param(str(e), "messages") from None
        try:
            prompt_ids = backend.chat_prompt_ids(messages)
        except Exception as e:  # e.g. a template that refuses a role order
            raise invalid_param(f"Could not apply the model's chat template: {e}", "messages") from None
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = budget(prompt_ids, requested, config.default_chat_max_tokens, param, "messages")
        gen = generation_request(req, prompt_ids, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)

        def logprobs_of(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
            return None if entries is None or gen.params.logprobs is None else chat_logprobs(entries)

        def done_choice(d: ChoiceDone) -> dict[str, Any]:
            message = {"role": "assistant", "content": d.text, "refusal": None}
            return {"index": d.index, "message": message, "logprobs": logprobs_of(d.logprobs)}

        def chunk_choice(index: int, text: str | None, done: ChoiceDone | None, entries: list[TokenLogprob]) -> dict:
            delta = {} if text is None else {"content": text}
            return {"index": index, "delta": delta, "logprobs": logprobs_of(entries) if done is None else None}

        prelude = tuple(
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None} for i in range(gen.n)
        )
        return await respond(request, req, gen, prompt_ids, done_choice, chunk_choice, prelude)

    return app
