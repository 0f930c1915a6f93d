"""`--api-server-count N` (vLLM's flag): N API processes over one engine core.

Owns the launcher, the process `continuum serve` runs: it binds --port once, spawns the engine
core (`engine.core_proc.engine_core_main` over N pipes, `engine.core_clients`) and N API
processes (`api.launch.serve_api_process`), each a whole server (OpenAI routes, v2 HTTP, gRPC
when asked) accepting on the shared socket, with its own tokenizer and output processor; the
kernel spreads the connections over them. Prometheus metrics are shared through
prometheus-client's multiprocess directory, made here and removed at exit.

Signals: the API processes run in their own process group, so a terminal's Ctrl-C reaches the
launcher alone, which passes every SIGINT / SIGTERM on to each of them (the first drains, a
second stops at once, as one server). The engine core leaves when the last API process has
left. If the launcher dies, its API processes get SIGTERM (`PR_SET_PDEATHSIG`). Exit status:
the highest of the API processes' (0 after a drain, 1 if the engine died).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
from multiprocessing.connection import wait

logger = logging.getLogger("continuum.server")

_PR_SET_PDEATHSIG = 1
_CORE_EXIT_TIMEOUT = 10.0           # seconds the core may take to leave once the APIs have


def serve_api_servers(config) -> int:
    """Run config.api_server_count API processes over one engine core until they stop;
    returns the exit status (see the module docstring)."""
    from engine.core_proc import engine_core_main

    from api.launch import check_port
    check_port(config.host, config.port)
    n = config.api_server_count
    metrics_dir = tempfile.mkdtemp(prefix="continuum-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir      # inherited by the children
    sock = _listen(config.host, config.port)
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(n)]
    core = ctx.Process(target=engine_core_main, args=(config.engine, [c for _, c in pipes]),
                       name="continuum-engine-core")
    core.start()
    apis = [ctx.Process(target=_api_main, args=(config, front, i, sock),
                        name=f"continuum-api-{i}") for i, (front, _) in enumerate(pipes)]
    for p in apis:
        p.start()
    for front, child in pipes:          # the children hold their ends; the core must see
        front.close()                   # an API process's end close when it exits
        child.close()
    sock.close()
    logger.info("%d API processes over one engine core (pids %s; engine core %d)", n,
                ", ".join(str(p.pid) for p in apis), core.pid)
    try:
        return _supervise(apis, core)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _supervise(apis: list, core) -> int:
    """Pass signals on to the API processes; once one exits unasked, stop the others; wait
    for all and the core. Returns the exit status."""
    signalled = False

    def forward(sig, _frame):
        nonlocal signalled
        signalled = True
        for p in apis:
            if p.exitcode is None:
                os.kill(p.pid, sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    running = list(apis)
    while running:
        done = wait([p.sentinel for p in running])
        ended = [p for p in running if p.sentinel in done]
        for p in ended:
            p.join()
            running.remove(p)
        if ended and running and not signalled:     # one left unasked: the others follow
            logger.error("API process %s exited (status %s): stopping the others",
                         ended[0].name, ended[0].exitcode)
            forward(signal.SIGTERM, None)
    core.join(_CORE_EXIT_TIMEOUT)
    if core.exitcode is None:
        core.terminate()
        core.join()
    return 1 if any(p.exitcode for p in apis) else 0


def _listen(host: str, port: int) -> socket.socket:
    """The shared listening socket (uvicorn's `Config.bind_socket`: SO_REUSEADDR, inheritable);
    uvicorn calls listen() in each API process."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _api_main(config, engine_conn, index: int, sock: socket.socket) -> None:
    """An API process: its own process group (signals come from the launcher), SIGTERM if the
    launcher dies, logging as the launcher's, then `api.launch.serve_api_process`."""
    os.setpgrp()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):       # not Linux: the launcher's signals still reach it
        pass
    from triton_compat.frontend.grpc.core_env import import_grpc
    import_grpc()
    from engine.log_config import configure
    configure(config.log)
    from api.launch import serve_api_process
    serve_api_process(config, engine_conn, index, [sock])
