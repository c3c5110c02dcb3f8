"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An error the gateway reports to its client as OpenAI would."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        extra: dict[str, Any] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code, **self.extra}
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code)


def invalid_param(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def missing_blocks(model_id: str, missing: list[int]) -> ApiError:
    return ApiError(
        503,
        f"The swarm serving {model_id} has no online server for blocks {missing}; "
        "start a server for them or retry when one joins",
        type="service_unavailable_error",
        code="missing_blocks",
        extra={"missing_blocks": list(missing)},
    )
