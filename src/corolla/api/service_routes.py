"""The gateway's vLLM-style service routes: `/health` (200 while serving), `/version`, `/tokenize`, `/detokenize`
(vLLM's request and response shapes) and `/metrics` (Prometheus text of `ApiMetrics`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

import corolla
from corolla.api.backend import GenerationBackend
from corolla.api.errors import invalid_param
from corolla.api.metrics import CONTENT_TYPE, ApiMetrics
from corolla.api.schemas import ChatMessage


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: Literal[True] = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def add_service_routes(
    app: FastAPI,
    backend: GenerationBackend,
    metrics: ApiMetrics,
    *,
    parse: Callable[..., Any],
    check_auth: Callable[[Request], None],
    check_model: Callable[[str], None],
) -> None:
    """Registers the routes on `app`; `parse(request, choose)` reads a bounded JSON body and validates it as the model
    class `choose(body)` names (400 on garbage)."""

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": corolla.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        check_auth(request)
        req = await parse(
            request, lambda body: TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        )
        if req.model is not None:
            check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            try:
                messages = [m.as_dict() for m in req.messages]
                tokens = backend.chat_prompt_ids(messages)
            except ValueError as e:
                raise invalid_param(str(e), "messages") from None
        else:
            tokens = backend.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(tokens), "max_model_len": backend.max_context_tokens, "tokens": tokens, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        check_auth(request)
        req = await parse(request, lambda body: DetokenizeRequest)
        if req.model is not None:
            check_model(req.model)
        vocab_size = getattr(backend, "vocab_size", None)
        if any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in req.tokens):
            raise invalid_param(f"Token ids must be in [0, {vocab_size}) for this model", "tokens")
        return {"prompt": backend.decode(req.tokens)}
