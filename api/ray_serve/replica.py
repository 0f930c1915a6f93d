"""One data-parallel replica: a whole Continuum server inside a Ray Serve replica.

Owns: `ContinuumReplica`, the replica deployment. Its constructor builds the same server as
`continuum serve` from the same flags (`api.server.build_app` with its lifespan, which starts the
engine process; the OpenAI routes; KServe v2 HTTP with `--model-repository`) and runs it with
Continuum's own `uvicorn` `Server` in a thread, on a free loopback port (only this replica
talks to it; KServe v2 gRPC is off); it returns once `/health/ready` answers 200, so Ray Serve
routes nothing to a replica that is still loading. A thread puts the server's `/metrics` on the
application's `MetricsBoard` every second. Ray Serve then calls:
- `forward(ForwardedRequest)`, a streaming method: the request goes to the local server over
  HTTP; out come a `ResponseHead` (status, headers, replica id), then the body's bytes as the
  server sends them (SSE events unchanged). Cancelling the call closes the connection, which
  aborts the engine request as a client disconnect does.
- `check_health()`: the server's `/health/ready`; a failure makes Ray replace the replica.
- `__del__` when Ray scales the replica down or the app stops: Ray Serve has already stopped
  routing to it and waited for its requests (`graceful_shutdown_timeout_s` = `--shutdown-timeout`
  + margin); then Continuum's own drain runs (readiness 503, new requests 503, what is left
  aborted after `--shutdown-timeout`), uvicorn stops, the lifespan stops the engine process.

In: `ForwardedRequest` (from the ingress). Out: `ResponseHead` then `bytes` chunks.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

import httpx
from ray import serve

from api.ray_serve.config import replica_config
from api.ray_serve.metrics import PUBLISH_PERIOD_S, board

logger = logging.getLogger("continuum.ray_serve")
READY_TIMEOUT_S = 900.0        # model load + warm-up of one replica (seconds)
HEALTH_TIMEOUT_S = 5.0         # one /health/ready probe (seconds)
# Headers of one hop (and those the outer server sets itself): never forwarded either way.
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
              "upgrade", "te", "trailer", "proxy-connection", "date", "server"}


@dataclass
class ForwardedRequest:
    """An HTTP request as the ingress received it. `prompt` is the text the prefix-aware router
    matches (the prompt, or the chat messages' text; "" for requests without one)."""

    method: str
    path: str                     # with the query string
    headers: list[tuple[str, str]]
    body: bytes
    prompt: str = ""


@dataclass
class ResponseHead:
    """First item of `forward`'s stream: the replica's status code and headers."""

    status: int
    headers: list[tuple[str, str]]
    replica_id: str


def _build_server(argv: list[str], host: str, port: int):
    """(uvicorn `Server`, `ServerState`) of `continuum serve ARGV` on host:port, as
    `api.launch.serve` builds them, from the same checked `ServeConfig`, without gRPC (only this
    replica reaches it). Raises ValueError for a bad flag."""
    import dataclasses

    from api.launch import build_server

    config = dataclasses.replace(replica_config(argv), host=host, port=port, grpc_port=0)
    return build_server(config)


@serve.deployment(name="ContinuumReplica")
class ContinuumReplica:
    """A Continuum server (engine, OpenAI API, v2 HTTP) as one Ray Serve replica.

    `argv`: the `continuum serve` flags (its --host / --port are replaced by 127.0.0.1 and a
    free port). Raises RuntimeError if the server is not ready in `READY_TIMEOUT_S`
    seconds or its engine fails to start (Ray Serve then retries the replica).
    """

    def __init__(self, argv: list[str]) -> None:
        host = "127.0.0.1"
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self.server, self.state = _build_server(argv, host, sock.getsockname()[1])
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="continuum-replica-server", daemon=True)
        self.thread.start()
        self._wait_ready()
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.app_name = context.app_name
        self.client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=10),
                                        limits=httpx.Limits(max_connections=None))
        self.stopping = threading.Event()
        threading.Thread(target=self._publish_metrics, name="continuum-replica-metrics",
                         daemon=True).start()
        logger.info("replica %s serves on %s", self.replica_id, self.url)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.state.load_error or not self.thread.is_alive():
                raise RuntimeError(f"replica server failed to start: {self.state.load_error}")
            try:
                if httpx.get(f"{self.url}/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"replica server not ready in {READY_TIMEOUT_S:.0f} s")

    def _publish_metrics(self) -> None:
        metrics_board = board(self.app_name)
        while not self.stopping.wait(PUBLISH_PERIOD_S):
            try:
                text = httpx.get(f"{self.url}/metrics", timeout=5).text
                metrics_board.put.remote(self.replica_id, text)
            except httpx.HTTPError:
                pass

    async def forward(self, request: ForwardedRequest):
        """Send `request` to this replica's server; yield a `ResponseHead`, then the body's
        bytes as they arrive. Raises httpx.HTTPError if the server cannot be reached."""
        headers = [(k, v) for k, v in request.headers if k.lower() not in HOP_BY_HOP]
        async with self.client.stream(request.method, request.path, headers=headers,
                                      content=request.body) as r:
            yield ResponseHead(r.status_code, [(k, v) for k, v in r.headers.multi_items()
                                               if k.lower() not in HOP_BY_HOP],
                               self.replica_id)
            async for chunk in r.aiter_raw():
                yield chunk

    async def check_health(self) -> None:
        """Ray Serve's health check: this replica's `/health/ready`. Raises RuntimeError when it
        is not 200 (the engine died, or the server drains)."""
        try:
            r = await self.client.get("/health/ready", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as e:
            raise RuntimeError(f"replica server unreachable: {e}") from None
        if r.status_code != 200:
            raise RuntimeError(f"replica not ready: /health/ready {r.status_code}")

    async def __del__(self) -> None:
        """Ray Serve stops this replica: Continuum's drain, then the engine process stops."""
        import asyncio

        self.stopping.set()
        board(self.app_name).remove.remote(self.replica_id)
        lifecycle = self.state.lifecycle
        lifecycle.begin_drain("Ray Serve stops this replica", lifecycle.shutdown_timeout)
        await asyncio.to_thread(self.thread.join, lifecycle.shutdown_timeout + 10)
        if self.state.llm is not None:
            self.state.llm.shutdown()
        await self.client.aclose()

