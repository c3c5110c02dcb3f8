"""The FastAPI app of `corolla-api`: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (plain JSON or SSE
chunks exactly as OpenAI sends them, ending in `data: [DONE]`), API-key check and OpenAI-style errors.

Each request runs its blocking generation loop in a worker thread of its own, so concurrent requests are concurrent
inference sessions in the swarm (which the servers may batch); the event loop only moves text between them.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from corolla.api.backend import GenerationBackend
from corolla.api.body import DEFAULT_MAX_REQUEST_BYTES, read_body
from corolla.api.errors import ApiError, invalid_param, missing_blocks
from corolla.api.sampling import SamplingParams
from corolla.api.schemas import ChatCompletionRequest, CompletionRequest
from corolla.api.textstream import TextStream
from corolla.utils.errors import MissingBlocksError
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass
class ApiConfig:
    api_key: str | None = None  # when set, every /v1 request needs `Authorization: Bearer <api_key>`
    model_aliases: tuple[str, ...] = ()  # extra names accepted in the `model` field besides backend.model_id
    max_concurrent_requests: int = 64  # generation threads; further requests wait for a free one
    default_chat_max_tokens: int = 512  # chat requests without max_tokens get min(this, context left)
    sse_ping_interval_s: float = 15.0  # keep-alive comments on idle streams
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413, refused before they are read

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")


# --- events from a generation thread to the event loop ---
@dataclass
class _Delta:
    text: str


@dataclass
class _Done:
    finish_reason: str  # "stop" | "length"
    completion_tokens: int
    text: str


@dataclass
class _Failed:
    error: BaseException


def _run_generation(
    backend: GenerationBackend,
    prompt_ids: list[int],
    params: SamplingParams,
    stops: list[str],
    emit: Callable[[Any], None],
    cancelled: threading.Event,
) -> None:
    """Blocking: generates, cuts stops, and emits `_Delta`* then `_Done` or `_Failed`."""
    try:
        stream = TextStream(backend.decode, stops)
        finish_reason, num_tokens = "length", 0
        tokens = backend.generate(prompt_ids, params)
        try:
            for token in tokens:
                if cancelled.is_set():
                    return
                num_tokens += 1
                if token in backend.eos_token_ids:
                    finish_reason = "stop"
                    break
                text, hit_stop = stream.push(token)
                if text:
                    emit(_Delta(text))
                if hit_stop:
                    finish_reason = "stop"
                    break
        finally:
            tokens.close()  # ends the inference session now, in this thread
        tail = stream.finish()
        if tail:
            emit(_Delta(tail))
        emit(_Done(finish_reason, num_tokens, stream.text))
    except BaseException as e:  # reported to the client; never kills the worker pool
        emit(_Failed(e))


def _error_for(exc: BaseException, model_id: str) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, MissingBlocksError):
        return missing_blocks(model_id, exc.missing)
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc))
    logger.error(f"api.generation_failed(error={exc!r})", exc_info=exc)
    return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")


def _validation_message(err: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    return (f"Invalid value for '{param}': {msg}" if param else f"Invalid request: {msg}"), param


async def _parse(request: Request, model: type[CompletionRequest] | type[ChatCompletionRequest], max_bytes: int) -> Any:
    raw = await read_body(request, max_bytes)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(
            400, f"We could not parse the JSON body of your request ({e}); send valid JSON", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        message, param = _validation_message(e)
        raise ApiError(400, message, param=param) from None


def create_app(backend: GenerationBackend, config: ApiConfig | None = None) -> FastAPI:
    """Builds the gateway around `backend` (owns a thread pool that closes with the app's lifespan)."""
    config = config or ApiConfig()
    model_names = {backend.model_id, *config.model_aliases}
    executor = ThreadPoolExecutor(max_workers=config.max_concurrent_requests, thread_name_prefix="corolla-api-gen")
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="corolla OpenAI-compatible API", lifespan=lifespan)
    app.state.backend = backend
    app.state.config = config

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return ApiError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, str(exc.detail), code=code).response()

    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")

    def check_model(name: str) -> None:
        if name not in model_names:
            raise ApiError(
                404,
                f"The model `{name}` does not exist; this gateway serves {sorted(model_names)}",
                param="model",
                code="model_not_found",
            )

    def check_common(req: CompletionRequest | ChatCompletionRequest) -> None:
        check_model(req.model)
        if (req.n or 1) > 1:
            raise invalid_param("n > 1 is not supported; send one request per completion", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise invalid_param(f"{name} is not supported (use 0 or leave it out)", name)
        if req.logit_bias:
            raise invalid_param("logit_bias is not supported", "logit_bias")
        if req.logprobs:
            raise invalid_param("logprobs are not supported", "logprobs")

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

    def sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
        )

    async def start_generation(
        prompt_ids: list[int], params: SamplingParams, stops: list[str]
    ) -> tuple[asyncio.Queue, threading.Event]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def emit(event: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the loop has closed (shutdown): nobody is listening
                cancelled.set()

        loop.run_in_executor(executor, _run_generation, backend, prompt_ids, params, stops, emit, cancelled)
        return queue, cancelled

    async def complete(prompt_ids: list[int], params: SamplingParams, stops: list[str]) -> _Done:
        queue, cancelled = await start_generation(prompt_ids, params, stops)
        try:
            while True:
                event = await queue.get()
                if isinstance(event, _Done):
                    return event
                if isinstance(event, _Failed):
                    raise _error_for(event.error, backend.model_id)
        finally:
            cancelled.set()

    async def stream(
        prompt_ids: list[int],
        params: SamplingParams,
        stops: list[str],
        make_chunk: Callable[[str | None, str | None], dict[str, Any]],
        prelude: list[dict[str, Any]],
        usage_chunk: Callable[[int], dict[str, Any]] | None,
    ) -> Response:
        queue, cancelled = await start_generation(prompt_ids, params, stops)
        # Wait for the first event so that failures before any output get a proper HTTP status.
        first = await queue.get()
        if isinstance(first, _Failed):
            cancelled.set()
            raise _error_for(first.error, backend.model_id)

        async def events() -> AsyncIterator[str]:
            try:
                for chunk in prelude:
                    yield json.dumps(chunk)
                event = first
                while True:
                    if isinstance(event, _Delta):
                        yield json.dumps(make_chunk(event.text, None))
                    elif isinstance(event, _Done):
                        yield json.dumps(make_chunk(None, event.finish_reason))
                        if usage_chunk is not None:
                            yield json.dumps(usage_chunk(event.completion_tokens))
                        yield "[DONE]"
                        return
                    elif isinstance(event, _Failed):
                        yield json.dumps(_error_for(event.error, backend.model_id).body())
                        return
                    event = await queue.get()
            finally:
                cancelled.set()  # also on client disconnect: the worker stops at its next token

        return EventSourceResponse(events(), sep="\n", ping=config.sse_ping_interval_s)

    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def envelope(rid: str, kind: str, created: int, model: str, choices: list[Any], **extra: Any) -> dict[str, Any]:
        """The fields every completion object and stream chunk shares, then `choices` and `extra` (e.g. usage)."""
        return {
            "id": rid,
            "object": kind,
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": choices,
            **extra,
        }

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        check_auth(request)
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": created, "owned_by": "corolla"}
                for name in sorted(model_names)
            ],
        }

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request) -> dict[str, Any]:
        check_auth(request)
        check_model(name)
        return {"id": name, "object": "model", "created": created, "owned_by": "corolla"}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        check_auth(request)
        req: CompletionRequest = await _parse(request, CompletionRequest, config.max_request_bytes)
        check_common(req)
        if (req.best_of or 1) > 1:
            raise invalid_param("best_of > 1 is not supported", "best_of")
        if req.echo:
            raise invalid_param("echo is not supported", "echo")
        if req.suffix:
            raise invalid_param("suffix is not supported", "suffix")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise invalid_param("Only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        prompt_ids = backend.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab_size = getattr(backend, "vocab_size", None)
        if any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in prompt_ids):
            raise invalid_param(f"Token ids must be in [0, {vocab_size}) for this model", "prompt")
        max_tokens = budget(prompt_ids, req.max_tokens, 16, "max_tokens", "prompt")
        params = sampling(req, max_tokens)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        if not req.stream:
            done = await complete(prompt_ids, params, req.stop_list)
            choice = {"text": done.text, "index": 0, "logprobs": None, "finish_reason": done.finish_reason}
            usage_now = usage(len(prompt_ids), done.completion_tokens)
            return envelope(rid, "text_completion", now, req.model, [choice], usage=usage_now)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(text: str | None, finish_reason: str | None) -> dict[str, Any]:
            choice = {"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish_reason}
            extra = {"usage": None} if include_usage else {}
            return envelope(rid, "text_completion", now, req.model, [choice], **extra)

        def usage_chunk(completion_tokens: int) -> dict[str, Any]:
            return envelope(rid, "text_completion", now, req.model, [], usage=usage(len(prompt_ids), completion_tokens))

        return await stream(prompt_ids, params, req.stop_list, chunk, [], usage_chunk if include_usage else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        check_auth(request)
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest, config.max_request_bytes)
        check_common(req)
        if req.tools:
            raise invalid_param("tools are not supported", "tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise invalid_param("only the text response_format is supported", "response_format")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as e:
            raise invalid_param(str(e), "messages") from None
        try:
            prompt_ids = backend.chat_prompt_ids(messages)
        except Exception as e:  # e.g. a template that refuses a role order
            raise invalid_param(f"Could not apply the model's chat template: {e}", "messages") from None
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = budget(prompt_ids, requested, config.default_chat_max_tokens, param, "messages")
        params = sampling(req, max_tokens)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        if not req.stream:
            done = await complete(prompt_ids, params, req.stop_list)
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": done.text, "refusal": None},
                "logprobs": None,
                "finish_reason": done.finish_reason,
            }
            usage_now = usage(len(prompt_ids), done.completion_tokens)
            return envelope(rid, "chat.completion", now, req.model, [choice], usage=usage_now)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk_with(delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            extra = {"usage": None} if include_usage else {}
            return envelope(rid, "chat.completion.chunk", now, req.model, [choice], **extra)

        def chunk(text: str | None, finish_reason: str | None) -> dict[str, Any]:
            return chunk_with({} if text is None else {"content": text}, finish_reason)

        def usage_chunk(completion_tokens: int) -> dict[str, Any]:
            final_usage = usage(len(prompt_ids), completion_tokens)
            return envelope(rid, "chat.completion.chunk", now, req.model, [], usage=final_usage)

        prelude = [chunk_with({"role": "assistant", "content": ""}, None)]
        return await stream(prompt_ids, params, req.stop_list, chunk, prelude, usage_chunk if include_usage else None)

    return app
