"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a status.

`APIError` carries the status code and the fields; `error_response` renders it. Engine and
validation errors are mapped here, once.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error the client caused or must retry, rendered in OpenAI's format."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code, self.headers = code, headers

    def body(self) -> dict:
        """The JSON body: `{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_response(err: APIError) -> JSONResponse:
    """`err` as a JSON response with its status code and headers."""
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    """HTTP 400 `invalid_request_error`, naming `param` when known."""
    return APIError(400, message, "invalid_request_error", param)


def engine_error(exc: Exception, param: str) -> APIError:
    """Map an exception from `generate` (before the first output) to an APIError."""
    from engine.async_llm import EngineDeadError, RequestFailedError
    from scheduler.request import ParamError, QueueFullError

    if isinstance(exc, ParamError):         # "prompt" stands for the route's prompt field
        return bad_request(str(exc), param if exc.param == "prompt" else exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), "service_unavailable", None, "queue_full",
                        headers={"Retry-After": "1"})
    if isinstance(exc, RequestFailedError):      # accepted, then failed (or the engine died)
        return APIError(500, str(exc), "internal_error")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "service_unavailable", None, "engine_dead")
    if isinstance(exc, ValueError):
        return bad_request(str(exc), param)
    return APIError(500, f"{type(exc).__name__}: {exc}", "internal_error")
