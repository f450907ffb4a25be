"""API errors and each protocol's envelope: one place maps every failure to a status and body.

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"[, "code"]}}
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from ..errors import BusyError, ContextLengthError, EngineError, InvalidArgumentError, MlxrsError

# status -> (OpenAI type, OpenAI code, Anthropic type)
_KIND = {
    400: ("invalid_request_error", None, "invalid_request_error"),
    401: ("invalid_request_error", "invalid_api_key", "authentication_error"),
    403: ("invalid_request_error", "forbidden", "permission_error"),
    404: ("invalid_request_error", "not_found", "not_found_error"),
    405: ("invalid_request_error", "method_not_allowed", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type", "invalid_request_error"),
    429: ("rate_limit_error", "queue_full", "rate_limit_error"),
    500: ("server_error", None, "api_error"),
    503: ("server_error", "overloaded", "overloaded_error"),
}


class ApiError(Exception):
    """An error response. `type`/`code` override the status's defaults (memory admission)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        anthropic_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.anthropic_type = anthropic_type
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self, protocol: str) -> dict[str, Any]:
        oa_type, oa_code, an_type = _KIND.get(self.status, _KIND[500])
        if protocol == "anthropic":
            err: dict[str, Any] = {"type": self.type or self.anthropic_type or an_type, "message": self.message}
            if self.code and self.type:  # memory admission's code rides along in its own type
                err["code"] = self.code
            return {"type": "error", "error": err}
        return {
            "error": {
                "message": self.message,
                "type": self.type or oa_type,
                "param": self.param,
                "code": self.code or oa_code,
            }
        }

    def response(self, protocol: str) -> web.Response:
        return web.json_response(self.body(protocol), status=self.status, headers=self.headers, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def admission_error(message: str, param: str | None = "messages") -> ApiError:
    return ApiError(400, message, param=param, type="memory_admission", code="context_over_budget")


def engine_error(state: str, why: str | None) -> ApiError:
    """503 for a server whose engine cannot generate (its thread died, or it was closed)."""
    return ApiError(
        503,
        f"the engine cannot generate ({state}{': ' + why if why else ''}): restart the server",
        code="engine_unavailable",
        anthropic_type="api_error",
    )


def from_exception(e: BaseException) -> ApiError:
    """An mlxrs (or aiohttp) exception as the ApiError it means."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ContextLengthError):
        return admission_error(str(e))
    if isinstance(e, BusyError):
        return ApiError(429, f"the server is busy: {e}", headers={"Retry-After": "1"})
    if isinstance(e, EngineError):
        return engine_error("dead", str(e))
    if isinstance(e, InvalidArgumentError):
        return ApiError(400, str(e))
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        return ApiError(413, "request body too large: " + e.text if e.text else "request body too large")
    if isinstance(e, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(e.allowed_methods))
        return ApiError(405, f"method {e.method} is not allowed here (allowed: {allowed})", headers={"Allow": allowed})
    if isinstance(e, web.HTTPNotFound):
        return ApiError(404, "no such endpoint")
    if isinstance(e, web.HTTPException):
        return ApiError(e.status if e.status in _KIND else 500, e.reason or "error")
    if isinstance(e, MlxrsError):
        return ApiError(500, f"{type(e).__name__}: {e}")
    return ApiError(500, f"internal error: {type(e).__name__}: {e}")
