"""The ingress of the data-parallel app: one HTTP front (Ray Serve's proxy) for every replica.

Owns: `ContinuumIngress`, a Ray Serve deployment with a FastAPI app (`serve.ingress`). Every
request except `/health` and `/metrics` is read whole, given the text the router matches
(`prompt_text`: the completion prompt, or the chat messages' roles and contents), and forwarded
through the replica deployment's `DeploymentHandle` as a streaming call
(`handle.options(stream=True).forward.remote`); the replica's status, headers and body bytes
come back unchanged (SSE included), with `x-continuum-replica` naming the replica. Which replica
serves it is the request router's choice (`api.ray_serve.routing`).

Failures: a replica that dies before its response starts gives 503 in the protocol's shape
(OpenAI's `{"error": {...}}`, KServe v2's `{"error": "..."}`); one that dies mid-stream ends an
SSE stream with an error event and `data: [DONE]` (other bodies are cut short). Other replicas'
requests go on. A client that goes away cancels the replica call, which aborts the engine request.

`/health`: the ingress answers (liveness). `/health/ready` is forwarded: a replica answers
(Ray Serve routes only to replicas whose constructor returned, i.e. whose server was ready).
`/metrics`: every replica's metrics (from the `MetricsBoard`) with a `replica` label, plus sums.
"""

# No `from __future__ import annotations`: FastAPI, through serve.ingress, must see the real
# `Request` annotation, else the parameter is taken for a query parameter (422).
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from api.ray_serve.metrics import STALE_S, board, merge_metrics
from api.ray_serve.replica import ForwardedRequest, ResponseHead

logger = logging.getLogger("continuum.ray_serve")
PROMPT_PATHS = ("/v1/chat/completions", "/v1/completions")
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]

app = FastAPI(title="Continuum (Ray Serve ingress)")


def _text(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(v) for v in value)
    if isinstance(value, dict):
        return _text(value.get("text") or value.get("content") or "")
    return ""


def prompt_text(path: str, body: bytes) -> str:
    """The text whose prefix decides the replica: a completion's prompt (the first of a batch;
    token ids as decimal text) or a chat request's messages (role and content of each, in
    order). "" for other requests or bodies that are not JSON objects."""
    if path not in PROMPT_PATHS:
        return ""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return ""
    if not isinstance(data, dict):
        return ""
    if path == "/v1/chat/completions":
        messages = data.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(f"<{m.get('role')}>{_text(m.get('content'))}\n"
                       for m in messages if isinstance(m, dict))
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt) + " "
    return prompt if isinstance(prompt, str) else ""


def _failure(path: str, message: str) -> JSONResponse:
    if path.startswith("/v2"):
        return JSONResponse({"error": message}, status_code=503)
    return JSONResponse({"error": {"message": message, "type": "service_unavailable",
                                   "param": None, "code": "replica_failed"}}, status_code=503)


def _sse_error(message: str) -> bytes:
    error = {"error": {"message": message, "type": "service_unavailable", "param": None,
                       "code": "replica_failed"}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


@serve.deployment(name="ContinuumIngress")
@serve.ingress(app)
class ContinuumIngress:
    """HTTP front of the replicas (see the module docstring). `replicas`: the handle of the
    `ContinuumReplica` deployment."""

    def __init__(self, replicas: DeploymentHandle) -> None:
        self.replicas = replicas.options(stream=True)
        self.app_name = serve.get_replica_context().app_name

    @app.get("/health")
    async def health(self) -> Response:
        """Liveness of the ingress itself."""
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Every replica's metrics with a `replica` label, and their sums (`replica="all"`)."""
        texts = await board(self.app_name).fresh.remote(STALE_S)
        body = merge_metrics(texts)
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.api_route("/{path:path}", methods=METHODS)
    async def forward(self, request: Request, path: str) -> Response:
        """Forward to a replica and pass its response through (see the module docstring)."""
        body = await request.body()
        url_path = request.url.path
        target = url_path + (f"?{request.url.query}" if request.url.query else "")
        fwd = ForwardedRequest(request.method, target, list(request.headers.items()), body,
                               prompt_text(url_path, body))
        stream = self.replicas.forward.remote(fwd)
        try:
            head: ResponseHead = await stream.__anext__()
        except Exception as e:
            stream.cancel()
            logger.warning("replica failed before responding to %s: %s", url_path, e)
            return _failure(url_path, f"the replica serving this request failed: "
                                      f"{type(e).__name__}")
        headers = dict(head.headers)
        headers["x-continuum-replica"] = head.replica_id
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(self._body(stream, sse), status_code=head.status,
                                 headers=headers)

    async def _body(self, stream, sse: bool):
        finished = False
        try:
            async for chunk in stream:
                yield chunk
            finished = True
        except Exception as e:
            logger.warning("replica failed mid-response: %s", e)
            if not sse:
                raise
            finished = True
            yield _sse_error(f"the replica serving this request failed: {type(e).__name__}")
        finally:
            if not finished:        # the client went away: abort the replica's request
                stream.cancel()
