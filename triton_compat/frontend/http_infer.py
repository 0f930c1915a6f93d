"""`POST /v2/models/{m}[/versions/{v}]/infer` over HTTP: the hot path, as pure ASGI.

Owns: reading the body (bounded by `--http-max-input-size`, gzip / deflate undone),
`tensors.parse_request` → `infer.run` → `tensors.encode_response`, and the response with
`Inference-Header-Content-Length` when it carries binary tensors. `InferFastPath` answers these
requests in front of the FastAPI app, its middleware stack and request objects (measured:
they cost more than a small model's inference); it sits inside the drain gate and the
restricted-API check (api/server.py `_front`), so both still apply. The FastAPI route in
routes.py calls the same `infer_http`, for the OpenAPI document and any caller that reaches it.
"""

from __future__ import annotations

import json
import logging
import re
import zlib

from starlette.requests import ClientDisconnect, Request

from engine.log_config import verbose
from triton_compat.frontend.context import V2Context
from triton_compat.errors import InferError
from triton_compat.frontend.infer import run
from triton_compat.frontend.tensors import TensorError, encode_response, parse_request

INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
JSON = [(b"content-type", b"application/json")]
# the request headers an infer reads
HEADERS = {b"content-length", b"content-encoding", b"inference-header-content-length",
           b"traceparent", b"tracestate"}      # the last two: OpenTelemetry trace context
logger = logging.getLogger("continuum.triton")


def too_large(size: int, limit: int) -> InferError:
    """The 400 for a body past `--http-max-input-size`."""
    return InferError(f"request size {size} bytes exceeds the maximum allowed value of "
                      f"{limit} bytes (--http-max-input-size)")


async def read_body(request: Request, limit: int, refuse=too_large) -> bytes:
    """`receive_body` for a Starlette request (the one size-limited body reader of both
    protocols: the OpenAI routes pass their own `refuse`). Raises starlette's ClientDisconnect
    when the client leaves meanwhile."""
    body = await receive_body(request.receive, request.headers.get("content-length"), limit,
                              refuse)
    if body is None:
        raise ClientDisconnect()
    return body


async def receive_body(receive, declared: str | None, limit: int,
                       refuse=too_large) -> bytes | None:
    """The body from ASGI `receive`, refused once it passes `limit` bytes (or its `declared`
    Content-Length does), before all of it is held: raises `refuse(size, limit)` (by default
    Triton's InferError 400). None when the client disconnects first."""
    if declared and declared.isdigit() and int(declared) > limit:
        raise refuse(int(declared), limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise refuse(size, limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def decode_body(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo gzip / deflate Content-Encoding, never inflating past `limit` bytes."""
    if encoding not in ("gzip", "deflate"):
        return body
    try:
        inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        out = inflater.decompress(body, limit + 1)
    except zlib.error as e:
        raise InferError(f"failed to decompress the {encoding} request body: {e}") from None
    if len(out) > limit:
        raise too_large(len(out), limit)
    return out


async def infer_http(ctx: V2Context, model: str, version: str, headers, body: bytes,
                     limit: int, trace=None) -> tuple[bytes, list]:
    """One infer: the response body and its headers. `headers`: the request's (a mapping with
    lower-case keys); `trace`: its `Trace`, when sampled. Raises InferError (v2 status)."""
    repo = ctx.repository()
    repo.runtime(model, version)           # unknown model: 404 before the body is parsed
    body = decode_body(body, headers.get("content-encoding"), limit)
    header_length = headers.get("inference-header-content-length")
    try:
        parsed = parse_request(body, int(header_length) if header_length else None,
                               model, version)
    except ValueError as e:                # TensorError, or a bad header value
        raise InferError(str(e) if isinstance(e, TensorError) else
                         f"invalid Inference-Header-Content-Length: {header_length}") from None
    if verbose():                          # --log-verbose 1: each request, as Triton logs it
        logger.debug("HTTP infer request: model '%s' version '%s' id '%s'", model, version,
                     parsed.id)
    version_ran, outputs = await run(repo, ctx.shm, parsed, ctx.busy, trace)
    try:
        payload, json_length = encode_response(model, version_ran, parsed.id, outputs,
                                               parsed.binary_default)
    except Exception as e:            # an output the model filled with the wrong kind of data
        raise InferError(f"model '{model}' returned an output that cannot be sent: "
                         f"{type(e).__name__}: {e}", 500) from None
    if json_length is None:
        return payload, JSON
    return payload, [(b"content-type", b"application/octet-stream"),
                     (b"inference-header-content-length", str(json_length).encode())]


class InferFastPath:
    """Pure ASGI layer answering v2 infer requests (see the module docstring); anything else
    goes on to `app`."""

    def __init__(self, app, ctx: V2Context, max_input_size: int) -> None:
        self.app, self.ctx, self.limit = app, ctx, max_input_size

    async def __call__(self, scope, receive, send) -> None:
        match = (INFER_PATH.fullmatch(scope["path"])
                 if scope["type"] == "http" and scope["method"] == "POST" else None)
        if match is None:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k in HEADERS}
        status = 200
        trace = self.ctx.trace(match[1], headers)
        if trace is not None:
            trace.mark("HTTP_RECV_START")
        try:
            body = await receive_body(receive, headers.get("content-length"), self.limit)
            if body is None:               # the client left while sending its body
                if trace is not None:
                    trace.finish()
                return
            if trace is not None:
                trace.mark("HTTP_RECV_END")
            payload, extra = await infer_http(self.ctx, match[1], match[2] or "", headers,
                                              body, self.limit, trace)
        except InferError as e:
            status, payload, extra = e.status, json.dumps({"error": e.message}).encode(), JSON
        except Exception as e:             # a bug of ours: still the v2 error shape
            logger.exception("infer %s failed", scope["path"])
            status, payload, extra = 500, json.dumps(
                {"error": f"{type(e).__name__}: {e}"}).encode(), JSON
        if trace is not None:
            trace.mark("HTTP_SEND_START")
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", str(len(payload)).encode()), *extra]})
        await send({"type": "http.response.body", "body": payload})
        if trace is not None:
            trace.mark("HTTP_SEND_END")
            trace.finish()

