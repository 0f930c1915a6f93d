"""Starting a server from its `ServeConfig` (api/serve_config.py): `build_server` makes the
uvicorn server (OpenAI routes, v2 HTTP, and v2 gRPC when config.grpc_port) and its
`ServerState` (TLS, CORS and root path from api/network.py); `serve` runs it until it stops and exits with the lifecycle's status. Shared by
`continuum serve` (api/cli.py) and each Ray Serve replica (api/ray_serve/replica.py).
"""

from __future__ import annotations

import logging
import os
import sys


def build_server(config):
    """(uvicorn-based `Server`, `ServerState`) of `continuum serve` from its `ServeConfig`
    (api/serve_config.py), for config.host:config.port (the server binds there unless given
    sockets), with KServe v2 gRPC on config.grpc_host:grpc_port (port 0: none). The v2 layer
    always serves the LLM as a model, and the model repository when there is one."""
    import uvicorn

    from api.http_protocol import HttpToolsProtocol
    from api.lifecycle import Lifecycle, Server
    from api.server import ServerState, build_app

    from api.network import uvicorn_kwargs, with_cors

    lifecycle = Lifecycle(config.shutdown_timeout)
    state = ServerState(config, lifecycle=lifecycle)
    net = config.network
    uv_config = uvicorn.Config(with_cors(build_app(state), net), host=config.host,
                               port=config.port, log_level=config.uvicorn_log_level,
                               timeout_graceful_shutdown=5,
                               http=HttpToolsProtocol,    # a response's writes as one send
                               # the access log logs at info: below that level it would only
                               # cost its formatting on every request
                               access_log=config.uvicorn_log_level in ("trace", "debug", "info")
                               and not net.disable_uvicorn_access_log, **uvicorn_kwargs(net))
    return Server(uv_config, lifecycle), state


def _check_port(host: str, port: int) -> None:
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


def serve(config) -> None:
    """Run the server of `config` (a `ServeConfig`) until it stops; exits with the lifecycle's
    status (0 after a drain, 1 if the engine died or failed to start, or the port is taken)."""
    _check_port(config.host, config.port)
    server, state = build_server(config)
    server.run()
    if state.llm is not None:            # after a forced stop the lifespan did not run
        state.llm.shutdown()
    if state.stuck:                      # a model's thread never returns: exit without it
        logging.shutdown()
        os._exit(server.lifecycle.exit_code)
    sys.exit(server.lifecycle.exit_code)
