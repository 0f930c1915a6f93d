"""The data-parallel application: build it, run it from `continuum serve`, or from `serve run`.

Owns: `bind_app` (the Ray Serve application: N `ContinuumReplica` behind one `ContinuumIngress`),
`build_app` (the import path `api.ray_serve.app:build_app` for `serve run` / `serve deploy`
and `deploy/ray-serve.yaml`: its `args` are `continuum serve` flags), and `serve_ray` (what
`continuum serve --data-parallel-backend ray` runs: join the Ray cluster at `--ray-address` or
start a local single-node one, start Serve's HTTP proxy on --host/--port, run the app, and on
SIGTERM / SIGINT delete it, which drains every replica through its shutdown path).

In: `serve` argv (and the parsed namespace). Out: a running Serve application named
`APP_NAME`; the process's exit status (0 after a clean stop, 1 if the app failed to deploy).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from ray import serve
from ray.serve import Application

from api.ray_serve.config import (DataParallelConfig, argv_from_dict, data_parallel_config,
                                  replica_args)
from api.ray_serve.ingress import ContinuumIngress
from api.ray_serve.replica import ContinuumReplica

logger = logging.getLogger("continuum.ray_serve")
APP_NAME = "continuum"


def bind_app(argv: list[str], dp: DataParallelConfig) -> Application:
    """The Serve application: replicas that each run `continuum serve ARGV`, deployed with
    `dp`'s options, behind the ingress."""
    replicas = ContinuumReplica.options(**dp.replica_options()).bind(list(argv))
    return ContinuumIngress.options(**dp.ingress_options()).bind(replicas)


def build_app(args: dict) -> Application:
    """Ray Serve application builder (`serve run api.ray_serve.app:build_app key=value ...`, or
    `import_path` + `args` of a config file): `args` maps `continuum serve` flag names (`-` or
    `_`) to values, e.g. {"num-replicas": 2, "max-model-len": 1024}. Host and port are Serve's
    (`http_options`), not flags. Raises ValueError for a bad flag or combination."""
    flags = dict(args)
    flags.setdefault("data-parallel-backend", "ray")
    argv = argv_from_dict(flags)
    try:
        parsed = replica_args(argv)
    except SystemExit:
        raise ValueError(f"bad continuum serve flags: {' '.join(argv)}") from None
    return bind_app(argv, data_parallel_config(parsed))


def _start_ray(address: str | None, dp: DataParallelConfig) -> None:
    """Join the cluster at `address`, or start a local single-node one with enough CPUs for
    the replicas (Ray itself binds the node's address; Continuum's replica servers listen on
    127.0.0.1)."""
    import ray

    if address is not None:
        ray.init(address=address, namespace="serve", log_to_driver=False)
        return
    replicas = dp.num_replicas or dp.max_replicas
    num_cpus = max(os.cpu_count() or 1, int(replicas * dp.replica_num_cpus + 0.999))
    ray.init(num_cpus=num_cpus, include_dashboard=False,
             namespace="serve", log_to_driver=False)


def serve_ray(argv: list[str], config, dp: DataParallelConfig) -> None:
    """Run the data-parallel app until SIGTERM / SIGINT, then delete it (every replica drains
    for up to --shutdown-timeout) and exit 0; exit 1 if it fails to deploy."""
    import ray

    _start_ray(dp.ray_address, dp)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    code = 0
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(bind_app(argv, dp), name=APP_NAME, route_prefix="/", blocking=False)
        logger.info("ready: %s replica(s) behind http://%s:%d (router: %s)",
                    dp.num_replicas or f"{dp.min_replicas}..{dp.max_replicas}", config.host,
                    config.port, dp.request_router)
        stop.wait()
        logger.info("stopping: replicas drain for up to %g s", config.shutdown_timeout)
    except Exception as e:
        logger.error("the Ray Serve app failed: %s", e)
        code = 1
    finally:
        try:
            serve.delete(APP_NAME)          # waits for every replica's drain
            _remove_board()
            # A cluster this process started stops with ray.shutdown() (serve.shutdown() first
            # would only kill the controller mid-call: a raylet warning); a joined cluster
            # keeps Serve, its proxy and its other applications.
        finally:
            ray.shutdown()
    sys.exit(code)


def _remove_board() -> None:
    import ray

    from api.ray_serve.metrics import NAMESPACE
    try:
        ray.kill(ray.get_actor(f"metrics:{APP_NAME}", namespace=NAMESPACE))
    except ValueError:         # never created
        pass
