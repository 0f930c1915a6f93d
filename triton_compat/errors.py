"""The one error type of the v2 layer: a message and the HTTP status it is sent with.

KServe v2 errors are `{"error": "<message>"}`; the status follows Triton's mapping of its
error codes (INVALID_ARG 400, NOT_FOUND 404, UNAVAILABLE 503, INTERNAL 500).
"""

from __future__ import annotations


class InferError(Exception):
    """An error answered to one request. `status`: HTTP status code."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status

    def __str__(self) -> str:
        return self.message
