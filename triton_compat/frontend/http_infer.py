"""`POST /v2/models/{m}[/versions/{v}]/infer` over HTTP: the hot path, below the FastAPI app.

Owns: reading the body (bounded by `--http-max-input-size`, gzip / deflate undone),
`begin_infer` (`tensors.parse_request` → `infer.Inference`, the request submitted) →
`encode_http` (`tensors.encode_response`, with `Inference-Header-Content-Length` when the
response carries binary tensors), and the two ways a request reaches them:
- `InferRoute`: the HTTP protocol itself (api/http_protocol.py) hands it the requests it
  claims by their head (most: a plain keep-alive request with a Content-Length, no CORS
  `Origin` or proxy headers, the server not draining) and writes its answer, with no ASGI
  scope, task or middleware; a model that runs inline answers within the call. Measured with
  perf_analyzer on `simple`: the ASGI layers cost more than the model's whole inference.
- `InferFastPath`: a pure ASGI layer for the rest (pipelined behind another request, chunked,
  `Origin`, `X-Forwarded-For`), inside the drain gate and the restricted-API check
  (api/server.py `_front`).
The FastAPI route in routes.py calls the same `infer_http`, for the OpenAPI document and any
caller that reaches it. All three give the same answers.
"""

from __future__ import annotations

import json
import logging
import re
import zlib

from starlette.requests import ClientDisconnect, Request

from engine.log_config import log_http_request, verbose
from triton_compat.frontend.context import V2Context
from triton_compat.errors import InferError
from triton_compat.frontend.infer import Inference
from triton_compat.frontend.tensors import (TensorError, encode_response, parse_raw_request,
                                            parse_request)

INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
JSON = [(b"content-type", b"application/json")]
# the request headers an infer reads
HEADERS = {b"content-length", b"content-encoding", b"inference-header-content-length",
           b"traceparent", b"tracestate"}      # the last two: OpenTelemetry trace context
# headers whose requests go through the ASGI layers: CORS (`Origin`), uvicorn's proxy headers
LAYERED = {b"origin", b"x-forwarded-for", b"x-forwarded-proto"}
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


def begin_infer(ctx: V2Context, model: str, version: str, headers, body: bytes, limit: int,
                trace=None) -> Inference:
    """The request decoded and submitted: its `Inference`. `headers`: the request's (a mapping
    with lower-case keys); `trace`: its `Trace`, when sampled. Raises InferError (v2 status)."""
    repo = ctx.repository()
    runtime = repo.runtime(model, version)   # unknown model: 404 before the body is parsed
    body = decode_body(body, headers.get("content-encoding"), limit)
    header_length = headers.get("inference-header-content-length")
    try:
        length = int(header_length) if header_length else None
        parsed = (parse_raw_request(body, runtime.signature, model, version)  # Triton's raw
                  if length == 0 else parse_request(body, length, model, version))  # binary
    except ValueError as e:                # TensorError, or a bad header value
        raise InferError(str(e) if isinstance(e, TensorError) else
                         f"invalid Inference-Header-Content-Length: {header_length}") from None
    if verbose():                          # --log-verbose 1: each request, as Triton logs it
        logger.debug("HTTP infer request: model '%s' version '%s' id '%s'", model, version,
                     parsed.id)
    if verbose(2):                         # 2 and more: its inputs, as Triton's request dump
        logger.debug("HTTP infer request inputs: %s", ", ".join(
            f"{name} {parsed.datatypes.get(name, '')}" for name in parsed.inputs))
    return Inference(repo, ctx.shm, parsed, busy=ctx.busy, trace=trace, runtime=runtime)


def encode_http(inference: Inference) -> tuple[bytes, list]:
    """The response body and its headers (binary tensors: `Inference-Header-Content-Length`)
    of an inference whose future is done (`Inference.outcome`). Raises InferError: the
    model's failure, or 500 for an output the model filled with the wrong kind of data."""
    request = inference.request
    version_ran, outputs = inference.outcome()
    try:
        payload, json_length = encode_response(request.model, version_ran, request.id, outputs,
                                               request.binary_default)
    except Exception as e:
        raise InferError(f"model '{request.model}' returned an output that cannot be sent: "
                         f"{type(e).__name__}: {e}", 500) from None
    if json_length is None:
        return payload, JSON
    return payload, [(b"content-type", b"application/octet-stream"),
                     (b"inference-header-content-length", str(json_length).encode())]


async def infer_http(ctx: V2Context, model: str, version: str, headers, body: bytes,
                     limit: int, trace=None) -> tuple[bytes, list]:
    """One infer: the response body and its headers. `headers`: the request's (a mapping with
    lower-case keys); `trace`: its `Trace`, when sampled. Raises InferError (v2 status)."""
    inference = begin_infer(ctx, model, version, headers, body, limit, trace)
    await inference.settled()
    return encode_http(inference)


def error_answer(e: Exception, path) -> tuple[int, bytes, list]:
    """(status, body, headers) of a failed infer: an InferError's own status and text, anything
    else a bug of ours, logged, still in the v2 error shape."""
    if isinstance(e, InferError):
        return e.status, json.dumps({"error": e.message}).encode(), JSON
    logger.error("infer %s failed", path, exc_info=e)
    return 500, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode(), JSON


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
        except Exception as e:
            status, payload, extra = error_answer(e, scope["path"])
        if trace is not None:
            trace.mark("HTTP_SEND_START")
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", str(len(payload)).encode()), *extra]})
        await send({"type": "http.response.body", "body": payload})
        if trace is not None:
            trace.mark("HTTP_SEND_END")
            trace.finish()


class InferRoute:
    """The v2 infer requests `api.http_protocol.HttpToolsProtocol` answers itself, below ASGI
    (see the module docstring): `claim` picks them by their head, `answer` runs them. What it
    does not claim goes through the ASGI layers to `InferFastPath`, with the same result.

    `lifecycle` (api.lifecycle.Lifecycle) counts the requests in flight, as the drain gate
    does for the others."""

    def __init__(self, ctx: V2Context, max_input_size: int, lifecycle) -> None:
        self.ctx, self.limit, self.lifecycle = ctx, max_input_size, lifecycle

    def claim(self, url: bytes, headers: list[tuple[bytes, bytes]]) -> tuple | None:
        """(model, version, headers) of a v2 infer this path answers: a plain path (no query,
        no escapes), a Content-Length within `--http-max-input-size`, none of the `LAYERED`
        headers (CORS and the proxy headers apply to those), the server not draining (the
        drain gate refuses those). Else None."""
        if not (url.startswith(b"/v2/models/") and url.endswith(b"/infer")) or b"%" in url:
            return None
        match = INFER_PATH.fullmatch(url.decode("latin-1"))
        if match is None or self.lifecycle.draining:
            return None
        wanted = {}
        for name, value in headers:
            if name in HEADERS:
                wanted[name.decode("latin-1")] = value.decode("latin-1")
            elif name in LAYERED:
                return None
        declared = wanted.get("content-length")
        if declared is None or not declared.isdigit() or int(declared) > self.limit:
            return None
        if verbose():                  # the ASGI path's InFlightGate logs the others
            log_http_request("POST", match[0])
        return match[1], match[2] or "", wanted

    def answers_now(self, claim: tuple) -> bool:
        """Whether a claimed request is answered as soon as its body is read: its model runs
        every request alone (`runs_alone`). Else at the end of the event-loop pass, once the
        requests that arrived with it are counted, so a burst runs as batches."""
        repo = self.ctx.get_repository()
        try:
            return repo is not None and getattr(repo.runtime(claim[0], claim[1]),
                                                "runs_alone", False)
        except InferError:
            return True                # answered with the error at once

    def answer(self, claim: tuple, body: bytes):
        """(status, body, headers) of a claimed request, or a coroutine that gives them when
        its model does not answer at once (it runs on a worker thread, or at the end of this
        event-loop pass with the requests that came with it). Never raises."""
        model, version, headers = claim
        trace = self.ctx.trace(model, headers)
        if trace is not None:
            trace.mark("HTTP_RECV_START")
            trace.mark("HTTP_RECV_END")
        self.lifecycle.enter()
        try:
            inference = begin_infer(self.ctx, model, version, headers, body, self.limit, trace)
        except Exception as e:
            return self._done(error_answer(e, model), trace)
        if not inference.future.done():
            return self._later(inference, trace)
        return self._finish(inference, trace)

    async def _later(self, inference: Inference, trace) -> tuple:
        try:
            await inference.settled()
        except BaseException:          # cancelled: still out of the drain's count
            self.lifecycle.leave()
            raise
        return self._finish(inference, trace)

    def _finish(self, inference: Inference, trace) -> tuple:
        try:
            answer = (200, *encode_http(inference))
        except Exception as e:
            answer = error_answer(e, inference.request.model)
        return self._done(answer, trace)

    def _done(self, answer: tuple, trace) -> tuple:
        self.lifecycle.leave()
        if trace is not None:          # the protocol writes it next, in this call
            trace.mark("HTTP_SEND_START")
            trace.mark("HTTP_SEND_END")
            trace.finish()
        return answer
