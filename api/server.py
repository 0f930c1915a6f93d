"""The HTTP server: FastAPI app with the OpenAI routes, health, metrics and version.

Owns: the app's state (the engine front `ProcessAsyncLLM`, the tokenizer, metrics, readiness),
request parsing (pydantic; errors → OpenAI's 400 naming the parameter), auth (`--api-key`,
Bearer token on `/v1/*`), the chat template, and client-disconnect handling (the request is
aborted; its KV blocks are freed at the next engine step).

Start-up: the server listens at once; the engine loads in the background (`/health` answers,
`/health/ready` and `/v1/*` give 503 until the model is loaded and warmed up).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import traceback
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from api.chat import (chat_context, completion_context, completion_prompts, engine_params,
                      prepare_chat, request_constraint)
from api.errors import APIError, bad_request, engine_error, error_response
from api import embeddings, lora, messages, openapi, responses, sagemaker, tokenization
from api.lifecycle import InFlightGate, Lifecycle
from api.metrics import Metrics
from api.network import grpc_credentials
from api.respond import respond
from api.protocol import ChatCompletionRequest, CompletionRequest, drop_nulls, split_unknown
from engine.async_llm import ProcessAsyncLLM
from engine.heap import freeze_heap
from api.serve_config import ServeConfig
from triton_compat.frontend.http_infer import read_body
from engine.config import EngineConfig
from scheduler.request import ParamError, QueueFullError, SamplingParams

logger = logging.getLogger("continuum.api")
VERSION = "0.1.0"


@dataclass
class ServerState:
    """The server's runtime state, shared by the routes; its settings are `config` (a frozen
    `api.serve_config.ServeConfig`), read through the properties below. `llm` and `tokenizer`
    are set once the engine is ready; `repository` once the v2 model repository has loaded."""

    config: ServeConfig
    llm: ProcessAsyncLLM | None = None
    tokenizer: object = None
    info: dict = field(default_factory=dict)
    ready: bool = False
    load_error: str | None = None
    started: float = field(default_factory=time.time)
    metrics: Metrics | None = None
    repository: object = None                 # triton_compat ModelRepository once loaded
    repository_error: str | None = None
    grammars: object = None                   # engine.structured GrammarCompiler (validation)
    v2: object = None                         # triton_compat V2Context
    stuck: bool = False                       # a model's code still ran at shutdown
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    lora_paths: dict[str, str] = field(default_factory=dict)    # served LoRA adapters (api.lora)
    tracer: object = None                     # api.tracing.RequestTracer (--otlp-traces-endpoint)
    engine_conn: object = None                # --api-server-count: this process's engine pipe
    engine_started: tuple | None = None       # engine.async_llm.spawn_engine_core's, if early
    api_server_index: int = 0                 # which of --api-server-count's processes

    @property
    def engine_config(self) -> EngineConfig | None:
        """The LLM's engine config; None with --no-llm."""
        return None if self.config.no_llm else self.config.engine

    @property
    def served_model_name(self) -> str:
        """The LLM's name on both APIs."""
        return self.config.served_model_name

    @property
    def api_key(self) -> str | None:
        """--api-key (or CONTINUUM_API_KEY); None: no auth."""
        return self.config.api_key

    @property
    def base_url(self) -> str:
        """The OpenAI base URL the ready line prints."""
        return f"http://{self.config.host}:{self.config.port}/v1"

    @property
    def http_max_input_size(self) -> int:
        """Largest request body, bytes (/v1 and /v2)."""
        return self.config.http_max_input_size

    def __post_init__(self) -> None:
        self.lora_paths = dict(self.config.engine.lora_modules)
        self.metrics = Metrics(self.served_model_name)
        if self.config.network.otlp_traces_endpoint:
            from api.tracing import RequestTracer
            self.tracer = RequestTracer(self.config.network.otlp_traces_endpoint)
        self.lifecycle.abort_all = self.abort_all

    def abort_all(self) -> None:
        """The drain's deadline passed: abort every engine request (streams end with "abort")
        and answer every v2 request still in flight with 503."""
        if self.llm is not None:
            self.llm.abort_all()
        if self.repository is not None:
            self.repository.abort_all("the server is shutting down")

    def on_lora(self, paths: dict[str, str]) -> None:
        """The engine's adapters after a LoRA call (from any API process): listed here too."""
        self.lora_paths = dict(paths)

    def engine_died(self, message: str) -> None:
        """The engine process is gone (from the pipe's reader): stop the server, exit status 1."""
        self.lifecycle.begin_drain(message, 0.0, exit_code=1)

    def load_repository(self) -> None:
        """Load the Triton model repository (runs in a thread; failures are logged)."""
        from triton_compat.core.repository import ModelRepository
        try:
            c = self.config
            repository = ModelRepository(c.model_repository, c.model_control_mode,
                                         list(c.load_models))
            if self.engine_config is not None:      # the LLM, as Triton's vLLM backend shows it
                from triton_compat.core.llm_model import LLMModel
                repository.builtin[self.served_model_name] = LLMModel(
                    self.served_model_name, lambda: self.llm if self.ready else None,
                    lambda: self.tokenizer, lambda: list(self.lora_paths)
                    if self.config.engine.enable_lora else None)
            self.repository = repository
            freeze_heap()
            logger.info("v2 models (repository %s): %s", self.config.model_repository,
                        ", ".join(f"{m['name']} {m.get('state', '')}"
                                  for m in self.repository.index()) or "none")
        except Exception as e:
            self.repository_error = f"{type(e).__name__}: {e}"
            where = traceback.extract_tb(e.__traceback__)[-1]      # one line, with its place
            logger.error("model repository failed to load: %s (%s:%d in %s)",
                         self.repository_error, where.filename, where.lineno, where.name)

    def all_ready(self) -> bool:
        """Everything this server serves is ready: the LLM (if any) and the repository."""
        llm_ok = self.engine_config is None or (self.ready and self.llm is not None
                                                 and self.llm.is_alive)
        repo_ok = self.repository is not None and self.repository.ready()
        return llm_ok and repo_ok and not self.lifecycle.draining

    def load(self) -> None:
        """Start the engine process, load the tokenizer, warm up (runs in a thread)."""
        try:
            t0 = time.perf_counter()
            llm = ProcessAsyncLLM(self.engine_config, on_stats=self.metrics.on_engine_stats,
                                  on_dead=self.engine_died, on_lora=self.on_lora,
                                  conn=self.engine_conn, started=self.engine_started,
                                  reader_loop=self.lifecycle.loop)
            self.tokenizer = llm.tokenizer          # the one its output processor uses
            from engine.structured.grammar import GrammarCompiler
            self.grammars = GrammarCompiler(self.tokenizer, llm.info.get("vocab_size"))
            self.info, self.llm = llm.info, llm
            self.metrics.set_cache_config(llm.info)

            async def warm_up():
                rid = f"warmup-{uuid.uuid4().hex}"     # unique over --api-server-count's
                async for _ in llm.generate(rid, [1, 2, 3], SamplingParams(max_tokens=2)):
                    pass

            asyncio.run(warm_up())
            freeze_heap()
            self.ready = True
            n = self.config.api_server_count
            logger.info("ready in %.1f s (%s, %s on %s%s). Point the OpenAI SDK at "
                        "base_url=%r, model=%r", time.perf_counter() - t0,
                        self.info["architecture"], self.info["dtype"], self.info["device"],
                        f"; API process {self.api_server_index + 1} of {n}" if n > 1 else "",
                        self.base_url, self.served_model_name)
        except Exception as e:
            self.load_error = f"{type(e).__name__}: {e}"
            if self.lifecycle.draining:          # stopped while loading: nothing failed
                return
            logger.error("engine failed to start: %s", self.load_error)
            self.lifecycle.begin_drain("engine failed to start", 0.0, exit_code=1)


class BearerAuth:
    """Pure ASGI middleware: `Authorization: Bearer KEY` on `/v1/*` (401 otherwise); also
    `x-api-key: KEY`, the header the `anthropic` SDK sends (vLLM takes only the bearer form).

    Not Starlette's `BaseHTTPMiddleware`: that wraps `receive` and hides client disconnects
    from the routes, which must abort the requests of clients that went away.
    """

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected, self.key = app, f"Bearer {api_key}".encode(), api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            if headers.get(b"authorization") != self.expected \
                    and headers.get(b"x-api-key") != self.key:
                err = APIError(401, "invalid or missing API key", "authentication_error",
                               None, "invalid_api_key")
                response = messages.error_response(err) \
                    if scope["path"].startswith("/v1/messages") else error_response(err)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ParamError):
        return bad_request(str(cause), cause.param)
    param = ".".join(str(x) for x in err.get("loc", ())) or None
    msg = err.get("msg", "invalid request").removeprefix("Value error, ")
    if param is None and "stream_options" in msg:
        param = "stream_options"
    return bad_request(f"{param}: {msg}" if param else msg, param)


def _too_large(size: int, limit: int) -> APIError:
    """OpenAI's 413 for a body past `--http-max-input-size` (`size` bytes so far)."""
    return APIError(413, f"request body is larger than {limit} bytes (--http-max-input-size)",
                    "invalid_request_error")


async def _parse(request: Request, model, limit: int, strict: bool = False):
    """The body as `model` (a pydantic model class, or a function of the JSON object that
    returns the class, for a route with two body shapes); fields it does not define are
    refused if `strict` (`--strict-openai`), else dropped with vLLM's warning line. Raises
    APIError 400 / 413."""
    try:
        data = json.loads(await read_body(request, limit, _too_large))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    if not isinstance(model, type):
        model = model(data)
    data = drop_nulls(model, data)
    if not strict:
        data, ignored = split_unknown(model, data)
        if ignored:
            logger.warning("The following fields were present in the request but ignored: %s",
                           set(ignored))
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


def _front(app: FastAPI, state: ServerState):
    """The pure-ASGI layers in front of the FastAPI app, outermost first: the drain gate, the
    restricted-API check, the API key, then the v2 infer fast path. They sit outside
    FastAPI's own middleware stack (error, telemetry and body-limit layers), which cost more
    than a small model's whole inference (measured with perf_analyzer on `simple`)."""
    outer = app
    if state.v2 is not None:
        from triton_compat.frontend.http_infer import InferFastPath
        outer = InferFastPath(outer, state.v2, state.http_max_input_size)
    if state.api_key:
        outer = BearerAuth(outer, api_key=state.api_key)
    if state.config.http_restrictions:
        from triton_compat.frontend.restricted import RestrictedAPI
        outer = RestrictedAPI(outer, restrictions=state.config.http_restrictions)
    return InFlightGate(outer, lifecycle=state.lifecycle)


def protocol_route(state: ServerState):
    """The v2 infer route the HTTP protocol answers below ASGI (http_infer.InferRoute; see
    api/http_protocol.py), or None: no v2 layer, or `--http-restricted-api` rules, which the
    ASGI layers check."""
    if state.v2 is None or state.config.http_restrictions:
        return None
    from triton_compat.frontend.http_infer import InferRoute
    return InferRoute(state.v2, state.http_max_input_size, state.lifecycle)


def build_app(state: ServerState, load_in_background: bool = True):
    """The ASGI app: the FastAPI app behind `_front`'s layers. With `load_in_background`, the
    engine starts in a thread at start-up."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.lifecycle.loop = asyncio.get_running_loop()
        from triton_compat.core import bls  # BLS: python models call the repository
        bls.install(lambda: state.repository, state.lifecycle.loop)
        if state.repository is None:
            threading.Thread(target=state.load_repository, name="continuum-repository",
                             daemon=True).start()
        if load_in_background and state.llm is None and state.engine_config is not None:
            threading.Thread(target=state.load, name="continuum-load", daemon=True).start()
        grpc_server = await _start_grpc(state)
        if state.config.metrics_port:        # Triton's separate metrics port
            from prometheus_client import start_http_server
            start_http_server(state.config.metrics_port, state.config.host,
                              registry=state.metrics.registry)
        yield
        if grpc_server is not None:
            await asyncio.to_thread(lambda: grpc_server.stop(1.0).wait())
        if state.llm is not None:
            state.llm.shutdown()
        if state.repository is not None and not state.repository.close():
            state.stuck = True          # a model's code still runs: do not wait for it at exit
        if state.v2 is not None:
            state.v2.shm.close()
            state.v2.tracer.close()         # traces not yet in a file, and the files' ends
        if state.tracer is not None:
            state.tracer.shutdown()

    app = FastAPI(title="Continuum", version=VERSION, lifespan=lifespan)
    state.lifecycle.track_load = state.config.enable_server_load_tracking

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc)

    _install_v2(app, state)

    def engine_or_503() -> ProcessAsyncLLM:
        if state.engine_config is None:
            raise APIError(404, "this server serves no LLM (started with --no-llm)",
                           "NotFoundError", "model", "model_not_found")
        if state.load_error:
            raise APIError(503, f"engine failed to start: {state.load_error}",
                           "service_unavailable")
        if not state.ready:
            raise APIError(503, "the model is still loading", "service_unavailable",
                           headers={"Retry-After": "5"})
        return state.llm


    @app.get("/health")
    async def health():
        alive = state.load_error is None and (state.llm is None or state.llm.is_alive)
        return Response(status_code=200 if alive else 503)

    @app.get("/health/ready")
    async def ready():
        return Response(status_code=200 if state.all_ready() else 503)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/load")
    async def load():
        """vLLM's `/load`: the model-running requests in flight (api/lifecycle.py LOAD_ROUTES),
        counted under --enable-server-load-tracking, else 0."""
        return {"server_load": state.lifecycle.load}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        if state.engine_config is None:
            return {"object": "list", "data": embeddings.model_cards(state)}
        return {"object": "list", "data": [{
            "id": state.served_model_name, "object": "model", "created": int(state.started),
            "owned_by": "continuum", "root": state.info.get("model_dir"),
            "max_model_len": state.info.get("max_model_len")}, *lora.model_cards(state),
            *embeddings.model_cards(state)]}

    def refuse_if_full() -> None:
        """Overload: refuse before reading the body (a refusal must cost next to nothing)."""
        if state.ready and state.llm is not None:
            try:
                state.llm.check_capacity()
            except QueueFullError as e:
                raise engine_error(e, None) from None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        refuse_if_full()
        body = await _parse(request, ChatCompletionRequest, state.http_max_input_size,
                            state.config.strict_openai)
        body.model = body.model or state.served_model_name      # vLLM's default
        adapter = lora.resolve_model(state, body.model)
        llm = engine_or_503()
        prompt, so, tool_parsing = await prepare_chat(state, body)
        ctx = chat_context(state, request, body, prompt, tool_parsing)
        params = engine_params(state, body, prompt, so, adapter)
        return await respond(request, llm, ctx, body=body, prompts=[prompt], params=params,
                              param="messages", state=state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        refuse_if_full()
        body = await _parse(request, CompletionRequest, state.http_max_input_size,
                            state.config.strict_openai)
        body.model = body.model or state.served_model_name      # vLLM's default
        adapter = lora.resolve_model(state, body.model)
        llm = engine_or_503()
        raw, prompts = completion_prompts(state, body)
        if len(prompts) > llm.capacity:
            raise bad_request(f"{len(prompts)} prompts are more requests than the server holds "
                              f"(--max-num-seqs + --max-waiting-requests = {llm.capacity})",
                              "prompt")
        ctx = completion_context(state, request, body, raw, prompts)
        params = engine_params(state, body, min(prompts, key=len),
                               await request_constraint(state, body), adapter)
        return await respond(request, llm, ctx, body=body, prompts=prompts, params=params,
                              param="prompt", state=state)

    sagemaker.install(app, health, chat_completions, completions,
                      lambda request: read_body(request, state.http_max_input_size, _too_large))
    embeddings.install(app, state, partial(_parse, strict=state.config.strict_openai))
    lora.install(app, state, _parse)
    tokenization.install(app, state, partial(_parse, strict=state.config.strict_openai),
                         engine_or_503)
    for module in (responses, messages):
        module.install(app, state, partial(_parse, strict=state.config.strict_openai),
                       engine_or_503, refuse_if_full, partial(respond, state=state))
    schemas: dict = {"ChatCompletionRequest": ChatCompletionRequest,
                     "CompletionRequest": CompletionRequest}
    schemas |= tokenization.SCHEMAS | {"ResponsesRequest": responses.ResponsesRequest,
                                       "MessagesRequest": messages.MessagesRequest,
                                       "CountTokensRequest": messages.CountTokensRequest}
    bodies = {("post", "/v1/chat/completions"): "ChatCompletionRequest",
              ("post", "/v1/completions"): "CompletionRequest",
              ("post", "/v1/responses"): "ResponsesRequest",
              ("post", "/v1/messages"): "MessagesRequest",
              ("post", "/v1/messages/count_tokens"): "CountTokensRequest", **tokenization.BODIES}
    from triton_compat.frontend.openapi_schemas import BODIES, SCHEMAS
    schemas |= SCHEMAS
    bodies |= BODIES

    def model_names() -> dict[str, list[str]]:
        repo = state.repository
        return {"/v1": [state.served_model_name] if state.engine_config else [],
                # the LLM's Triton face is decoupled (its /infer is Triton's 501): not listed
                "/v2": [m["name"] for m in repo.index() if m["name"] not in repo.builtin]
                if repo is not None else []}

    openapi.install(app, schemas, bodies, model_names)
    return _front(app, state)


def _install_v2(app: FastAPI, state: ServerState) -> None:
    """The KServe v2 / Triton layer: its routes on `app`, its metrics, `state.v2`. It serves
    the LLM as a model, and the model repository when there is one."""
    from api.http_protocol import requests_in_progress
    from triton_compat.frontend import routes
    from triton_compat.frontend.context import V2Context
    from triton_compat.frontend.metrics import TritonCollector
    from triton_compat.frontend.shared_memory import SharedMemoryManager
    c = state.config
    state.v2 = V2Context(lambda: state.repository, state.all_ready, VERSION,
                         SharedMemoryManager(c.allow_client_shm), state.lifecycle,
                         c.grpc_restrictions, busy=lambda: requests_in_progress() > 1,
                         tracer=trace_manager(c.trace))
    routes.install(app, state.v2, state.http_max_input_size)
    state.metrics.register(TritonCollector(lambda: state.repository))


def trace_manager(trace: dict):
    """The `TraceManager` of `--trace-config` (`ServeConfig.trace`), with its OpenTelemetry
    exporter in opentelemetry mode."""
    from triton_compat.trace import TraceManager
    args = {k: v for k, v in trace.items() if k != "resource"}
    if args.get("mode") == "opentelemetry":
        from triton_compat.trace.otel import OtelExporter
        args["exporter"] = OtelExporter(args.get("options", {}), trace.get("resource", []))
    return TraceManager(**args)


async def _start_grpc(state: ServerState):
    """Start KServe v2 gRPC on the running loop unless its port is 0. A port that cannot be
    bound stops the server (exit status 1) with one line."""
    c = state.config
    if state.v2 is None or not c.grpc_port:
        return None
    from triton_compat.frontend.grpc.server import start
    try:
        return start(state.v2, c.grpc_host, c.grpc_port, grpc_credentials(c.network))
    except RuntimeError as e:
        logger.error("%s", e)
        state.lifecycle.begin_drain("gRPC failed to start", 0.0, exit_code=1)
        return None


