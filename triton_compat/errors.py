"""The one error type of the v2 layer: a message, the HTTP status it is sent with, and, where
HTTP's status does not say it, Triton's error code for gRPC.

KServe v2 errors are `{"error": "<message>"}`; the status follows Triton's mapping of its
error codes (HttpCodeFromError: INVALID_ARG and ALREADY_EXISTS 400, NOT_FOUND 404,
UNSUPPORTED 501, UNAVAILABLE 503, INTERNAL 500); gRPC maps the same codes one to one
(UNSUPPORTED → UNIMPLEMENTED).
"""

from __future__ import annotations

# HTTP infer on a decoupled model (Triton's text; 501)
DECOUPLED_HTTP = "HTTP end point doesn't support models with decoupled transaction policy"


class InferError(Exception):
    """An error answered to one request. `status`: HTTP status code; `code`: Triton's error
    code name when the status alone does not give it (e.g. "ALREADY_EXISTS", sent as 400 over
    HTTP and ALREADY_EXISTS over gRPC)."""

    def __init__(self, message: str, status: int = 400, code: str | None = None,
                 refused: bool = False) -> None:
        super().__init__(message)
        self.message, self.status, self.code = message, status, code
        # True when the request was refused before it ran (validation, a full queue): Triton
        # answers those from its infer call, not as a model response (a `triton_grpc_error`
        # stream goes on after them)
        self.refused = refused

    def __str__(self) -> str:
        return self.message


class TritonModelException(Exception):
    """`pb_utils.TritonModelException`: raised by python models, and by the python backend's
    API (triton_compat.core.pb_utils, bls, dlpack) where Triton's bindings raise."""
