"""Starting a server from its `ServeConfig` (api/serve_config.py): `build_server` makes the
uvicorn server (OpenAI routes, v2 HTTP, and v2 gRPC when config.grpc_port) and its
`ServerState` (TLS, CORS and root path from api/network.py); `serve` runs it until it stops and exits with the lifecycle's status. Shared by
`continuum serve` (api/cli.py) and each Ray Serve replica (api/ray_serve/replica.py).
"""

from __future__ import annotations

import logging
import os
import sys


def build_server(config, engine_conn=None, index: int = 0, started: tuple | None = None):
    """(uvicorn-based `Server`, `ServerState`) of `continuum serve` from its `ServeConfig`
    (api/serve_config.py), for config.host:config.port (the server binds there unless given
    sockets), with KServe v2 gRPC on config.grpc_host:grpc_port (port 0: none). The v2 layer
    always serves the LLM as a model, and the model repository when there is one. With
    `engine_conn`, API process `index` of --api-server-count over an engine core already
    started (api/api_servers.py); with `started`, this process's own engine core already
    spawned (`engine.async_llm.spawn_engine_core`)."""
    import uvicorn

    from api.http_protocol import HttpToolsProtocol
    from api.lifecycle import Lifecycle, Server
    from api.server import ServerState, build_app, protocol_route

    from api.network import uvicorn_kwargs, with_cors
    from engine.halt_poll import halt_poll

    lifecycle = Lifecycle(config.shutdown_timeout)
    state = ServerState(config, lifecycle=lifecycle, engine_conn=engine_conn,
                        engine_started=started, api_server_index=index)
    net = config.network
    app = with_cors(build_app(state), net)
    route = protocol_route(state)
    if route:                      # built and started now, not on the first v2 connection
        halt_poll()
    uv_config = uvicorn.Config(app, host=config.host,
                               port=config.port, log_level=config.uvicorn_log_level,
                               timeout_graceful_shutdown=5,
                               # a response's writes as one send; v2 infers without ASGI
                               http=HttpToolsProtocol.answering(route) if route else
                               HttpToolsProtocol,
                               # the access log logs at info: below that level it would only
                               # cost its formatting on every request
                               access_log=config.uvicorn_log_level in ("trace", "debug", "info")
                               and not net.disable_uvicorn_access_log, **uvicorn_kwargs(net))
    return Server(uv_config, lifecycle), state


def check_port(host: str, port: int) -> None:
    """Exit 1 with one line when `host:port` cannot be bound (taken by another server): found
    before the engine's process is spawned, which a later bind failure would leave to die with
    a traceback."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            print(f"continuum: error: --port {port}: cannot listen on {host}:{port} "
                  f"({e.strerror})", file=sys.stderr)
            sys.exit(1)


def serve(config, started: tuple | None = None) -> None:
    """Run the server of `config` (a `ServeConfig`) until it stops; exits with the lifecycle's
    status (0 after a drain, 1 if the engine died or failed to start, or the port is taken).
    One API process; api/api_servers.py runs --api-server-count N > 1 of them. `started`: its
    engine core's process already started (`engine.async_llm.spawn_engine_core`, after the
    port's check)."""
    if started is None:
        check_port(config.host, config.port)
    server, state = build_server(config, started=started)
    server.run()
    _exit(server, state)


def serve_api_process(config, engine_conn, index: int, sockets: list) -> None:
    """One of --api-server-count's API processes: the server of `config` on the launcher's
    listening `sockets`, over the engine core's pipe `engine_conn`; exits as `serve`."""
    server, state = build_server(config, engine_conn, index)
    server.run(sockets=sockets)
    _exit(server, state)


def _exit(server, state) -> None:
    """After the server stopped: the engine front shut down, then exit with the lifecycle's
    status (at once, past threads, if a model's code still runs)."""
    if state.llm is not None:            # after a forced stop the lifespan did not run
        state.llm.shutdown()
    if state.stuck:                      # a model's thread never returns: exit without it
        logging.shutdown()
        os._exit(server.lifecycle.exit_code)
    sys.exit(server.lifecycle.exit_code)
