"""How the server stops: in-flight accounting, the drain on SIGTERM / SIGINT, the exit status.

Owns: `Lifecycle` (the draining flag, the count of requests in flight, the exit status),
`InFlightGate` (pure ASGI middleware: counts every `/v1` and `/v2` request while it runs,
streams included, and refuses new ones with 503 in the protocol's own error shape once the
server drains) and `Server` (a `uvicorn.Server` whose first SIGTERM / SIGINT starts a drain,
whose second stops at once (a third: without waiting for connections), and which never
re-raises the signal, so a drained server exits 0).

A drain (vLLM's `--shutdown-timeout`, Triton's `--exit-timeout-secs`): readiness answers 503 and
new requests get 503; requests in flight run for up to `timeout` seconds; then the engine aborts
what is left (their streams end with finish_reason "abort", then `[DONE]`); then uvicorn stops
and the app's lifespan stops the engine process. A dead engine drains with timeout 0 and exit
status 1, so that a supervisor restarts the server (vLLM does the same).

In: signals, `begin_drain` calls (any thread). Out: `Server.should_exit`, `Lifecycle.exit_code`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Generator

import uvicorn
from fastapi.responses import JSONResponse

from api.errors import APIError, error_response
from engine.log_config import log_http_request, verbose

logger = logging.getLogger("continuum.api")

ABORT_GRACE_S = 5.0       # after the abort, how long the last responses get to go out (s)
NOT_COUNTED = ("/v2/health/",)     # probes: answered during a drain, never waited for
# The routes whose requests vLLM's `--enable-server-load-tracking` counts (its `/load`): those
# that run the model. Prefixes: `/v1/messages` covers `/v1/messages/count_tokens`, as there.
LOAD_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
               "/v1/embeddings", "/invocations")


class Lifecycle:
    """The server's stop state, shared by the middleware, the routes and `Server`.

    `shutdown_timeout`: seconds in-flight requests get after a SIGTERM / SIGINT (0: abort them
    at once). `abort_all()` is set by the app: it aborts every engine request.
    """

    def __init__(self, shutdown_timeout: float = 0.0) -> None:
        self.shutdown_timeout = shutdown_timeout
        self.draining = False
        self.in_flight = 0
        self.track_load = False                  # --enable-server-load-tracking
        self.load = 0                            # LOAD_ROUTES requests in flight (if tracked)
        self._count_lock = threading.Lock()     # gRPC worker threads count too
        self.exit_code = 0
        self.server: uvicorn.Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.abort_all: Callable[[], None] = lambda: None
        self._task: asyncio.Task | None = None

    def enter(self) -> None:
        """One more request in flight (any thread)."""
        with self._count_lock:
            self.in_flight += 1

    def leave(self) -> None:
        """One request fewer in flight (any thread)."""
        with self._count_lock:
            self.in_flight -= 1

    def begin_drain(self, reason: str, timeout: float, exit_code: int = 0) -> None:
        """Start a drain (idempotent; any thread). `timeout` in seconds; `exit_code` is the
        process's exit status once the server has stopped."""
        if self.loop is None:          # not serving yet: nothing is in flight
            self.draining, self.exit_code = True, exit_code
            if self.server is not None:
                self.server.should_exit = True
            return
        self.loop.call_soon_threadsafe(self._start, reason, timeout, exit_code)

    def _start(self, reason: str, timeout: float, exit_code: int) -> None:
        self.exit_code = max(self.exit_code, exit_code)
        if self._task is not None:
            return
        self.draining = True
        logger.info("%s: draining %d request(s) in flight for up to %g s (Waiting for in-flight "
                    "requests to complete, in tritonserver's words)", reason, self.in_flight,
                    timeout)
        self._task = self.loop.create_task(self._drain(timeout))

    async def _wait_idle(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def _drain(self, timeout: float) -> None:
        await self._wait_idle(timeout)
        if self.in_flight:
            logger.info("aborting %d request(s) still in flight", self.in_flight)
            self.abort_all()
            await self._wait_idle(ABORT_GRACE_S)
        if self.server is not None:
            self.server.should_exit = True

    def force(self) -> None:
        """Stop now (a second signal): abort what runs and stop without waiting for the drain.
        Safe in a signal handler: the abort itself runs on the event loop."""
        if self.server is None or self.loop is None:
            return
        logger.info("second signal: stopping now")
        self.loop.call_soon_threadsafe(self._stop_now)

    def _stop_now(self) -> None:
        self.draining = True
        self.abort_all()
        self.server.should_exit = True


def _refusal(path: str) -> JSONResponse:
    message = "the server is shutting down"
    if path.startswith("/v2"):
        return JSONResponse({"error": message}, status_code=503)
    return error_response(APIError(503, message, "service_unavailable", None,
                                   "shutting_down"))


class InFlightGate:
    """Pure ASGI middleware: counts `/v1` and `/v2` requests in flight (until their response,
    stream or not, has been sent); refuses new ones with 503 while the server drains. With
    `lifecycle.track_load` it also counts the LOAD_ROUTES requests for `/load`."""

    def __init__(self, app, lifecycle: Lifecycle) -> None:
        self.app, self.lifecycle = app, lifecycle

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and verbose():
            log_http_request(scope["method"], path)
        if self.lifecycle.track_load and scope["type"] == "http" and path.startswith(LOAD_ROUTES):
            self.lifecycle.load += 1               # (the event loop's thread only)
            try:
                await self._counted(scope, receive, send, path)
            finally:
                self.lifecycle.load -= 1
            return
        await self._counted(scope, receive, send, path)

    async def _counted(self, scope, receive, send, path: str) -> None:
        if (scope["type"] != "http" or not path.startswith(("/v1", "/v2"))
                or path.startswith(NOT_COUNTED) or path == "/v2"):
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining:
            await _refusal(path)(scope, receive, send)
            return
        self.lifecycle.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.leave()


class Server(uvicorn.Server):
    """uvicorn's server with Continuum's signals: the first SIGTERM / SIGINT drains (see the
    module docstring), a second stops at once, a third also skips waiting for connections to
    close; the app's shutdown (which stops the engine) runs in every case, and the signal is
    not re-raised afterwards."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.signals = 0                # SIGTERM / SIGINT received so far
        lifecycle.server = self

    def handle_exit(self, sig: int, frame) -> None:
        """Signal handler (main thread). Counted, not inferred from the stop state: with
        `--shutdown-timeout 0` the first signal's drain ends at once, and a second one a few
        milliseconds later (two Ctrl-C, or `timeout` and `kill` both signalling) is a second,
        not a third."""
        self.signals += 1
        if self.signals == 1:
            self.lifecycle.begin_drain(signal.Signals(sig).name,
                                       self.lifecycle.shutdown_timeout)
        elif self.signals == 2:
            self.lifecycle.force()
        else:
            self.force_exit = True

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's, and the app's lifespan shutdown even after a forced exit: uvicorn skips
        it then, which leaves the lifespan task to be cancelled at loop close (a traceback)
        and the engine process to its parent-death watch."""
        await super().shutdown(sockets)
        if self.force_exit:
            await self.lifespan.shutdown()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's, without re-raising the captured signal once the server has stopped."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
