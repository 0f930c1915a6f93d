"""The data-parallel flags of `continuum serve` (api/serve_flags.py) as the Ray Serve options they
become.

Owns: the frozen `DataParallelConfig` built from parsed flags (a bad combination raises ValueError, which the CLI
prints as one line and exits 2), `replica_config` (how a replica rebuilds the same server from
the same argv: the CLI's own checked `ServeConfig`, api/serve_config.py), and `argv_from_dict` (the `args:` of a Ray Serve config file → that argv).

In: parsed `argparse.Namespace`, or a dict from `deploy/ray-serve.yaml`. Out: a
`DataParallelConfig`, whose `replica_options()` / `ingress_options()` are keyword arguments of
Ray Serve's `Deployment.options` (num_replicas or autoscaling_config, request_router_config,
graceful_shutdown_timeout_s, health checks, ray_actor_options).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from api.serve_config import serve_config
from api.serve_flags import ROUTERS, serve_parser

SHUTDOWN_MARGIN_S = 15.0     # past --shutdown-timeout: abort grace + engine stop (seconds)
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 10.0
INGRESS_MAX_ONGOING = 10_000  # the ingress only forwards; replicas bound the real work


_DP_ONLY = ("num_replicas", "min_replicas", "max_replicas", "target_ongoing_requests",
            "ray_address")


@dataclass(frozen=True)
class DataParallelConfig:
    """Replica count or autoscaling bounds, routing and per-replica resources (validated).

    `num_replicas` None means autoscaling between `min_replicas` and `max_replicas` aiming at
    `target_ongoing_requests` per replica. `shutdown_timeout` in seconds (the replica's
    `--shutdown-timeout`). Raises ValueError naming the bad flag.
    """

    num_replicas: int | None = 1
    min_replicas: int = 1
    max_replicas: int = 4
    target_ongoing_requests: float = 16.0
    request_router: str = "prefix-aware"
    router_imbalanced_threshold: float = 8.0
    replica_num_cpus: float = 1.0
    ray_address: str | None = None
    shutdown_timeout: float = 0.0
    max_ongoing_requests: int = 1280     # per replica: --max-num-seqs + --max-waiting-requests

    def __post_init__(self) -> None:
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"--num-replicas must be >= 1 or auto, got {self.num_replicas}")
        if self.min_replicas < 0:
            raise ValueError(f"--min-replicas must be >= 0, got {self.min_replicas}")
        if self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"--max-replicas ({self.max_replicas}) must be >= 1 and >= "
                             f"--min-replicas ({self.min_replicas})")
        if self.target_ongoing_requests <= 0:
            raise ValueError("--target-ongoing-requests must be > 0")
        if self.request_router not in ROUTERS:
            raise ValueError(f"--request-router must be one of {', '.join(ROUTERS)}")
        if self.replica_num_cpus <= 0:
            raise ValueError(f"--replica-num-cpus must be > 0, got {self.replica_num_cpus}")

    def replica_options(self) -> dict:
        """Keyword arguments of `Deployment.options` for the replica deployment."""
        from api.ray_serve.routing import router_config

        opts: dict = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "graceful_shutdown_timeout_s": self.shutdown_timeout + SHUTDOWN_MARGIN_S,
            "health_check_period_s": HEALTH_CHECK_PERIOD_S,
            "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
            "ray_actor_options": {"num_cpus": self.replica_num_cpus, "runtime_env": {
                "env_vars": {"OMP_NUM_THREADS": str(math.ceil(self.replica_num_cpus))}}},
        }
        routing = router_config(self.request_router, self.router_imbalanced_threshold)
        if routing is not None:
            opts["request_router_config"] = routing
        if self.num_replicas is None:
            opts["num_replicas"] = "auto"
            opts["autoscaling_config"] = {
                "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": max(1, self.min_replicas),
                "target_ongoing_requests": self.target_ongoing_requests}
        else:
            opts["num_replicas"] = self.num_replicas
        return opts

    @staticmethod
    def ingress_options() -> dict:
        """Keyword arguments of `Deployment.options` for the ingress (no CPU of its own: it
        only parses a body and forwards bytes)."""
        return {"num_replicas": 1, "max_ongoing_requests": INGRESS_MAX_ONGOING,
                "ray_actor_options": {"num_cpus": 0}}


def data_parallel_config(args: argparse.Namespace) -> DataParallelConfig | None:
    """The `DataParallelConfig` of parsed `serve` flags; None without
    `--data-parallel-backend ray`. Raises ValueError for a bad combination."""
    if args.data_parallel_backend != "ray":
        given = [f"--{k.replace('_', '-')}" for k in _DP_ONLY if getattr(args, k) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need(s) --data-parallel-backend ray")
        return None
    if args.no_llm:
        raise ValueError("--data-parallel-backend ray serves replicas of an LLM; it does not "
                         "go with --no-llm")
    auto = args.num_replicas == "auto"
    scaling = [f"--{k.replace('_', '-')}" for k in
               ("min_replicas", "max_replicas", "target_ongoing_requests")
               if getattr(args, k) is not None]
    if scaling and not auto:
        raise ValueError(f"{', '.join(scaling)} need(s) --num-replicas auto")
    num = None
    if not auto:
        try:
            num = int(args.num_replicas or 1)
        except ValueError:
            raise ValueError(f"--num-replicas must be a number or auto, got "
                             f"{args.num_replicas!r}") from None
    defaults = DataParallelConfig()
    return DataParallelConfig(
        num_replicas=num,
        min_replicas=_default(args.min_replicas, defaults.min_replicas),
        max_replicas=_default(args.max_replicas, defaults.max_replicas),
        target_ongoing_requests=_default(args.target_ongoing_requests,
                                         defaults.target_ongoing_requests),
        request_router=args.request_router,
        router_imbalanced_threshold=args.router_imbalanced_threshold,
        replica_num_cpus=args.replica_num_cpus, ray_address=args.ray_address,
        shutdown_timeout=args.shutdown_timeout,
        max_ongoing_requests=(args.max_num_seqs or 256) + args.max_waiting_requests)


def _default(value, default):
    return default if value is None else value


def argv_from_dict(flags: dict) -> list[str]:
    """`continuum serve` argv from a dict of flag names (with `-` or `_`) to values, as in the
    `args:` of a Ray Serve config file: True → `--flag`, False → `--no-flag` (store_true flags:
    omitted), lists → the flag repeated, key `model` → the positional model path."""
    argv: list[str] = []
    store_true = {"enable_auto_tool_choice", "no_llm"}
    for key, value in flags.items():
        name = key.replace("-", "_")
        if name == "model":
            argv.insert(0, str(value))
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            if name not in store_true:
                argv.append("--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def replica_args(argv: list[str]) -> argparse.Namespace:
    """The parsed `serve` flags of argv (after `serve`). argparse errors raise SystemExit(2)
    after printing the usage line."""
    return serve_parser().parse_args(argv)


def replica_config(argv: list[str]):
    """The `ServeConfig` a replica serves for `continuum serve ARGV`, checked as the CLI checks
    it (api/serve_config.py). Raises ValueError naming a bad flag."""
    return serve_config(replica_args(argv))
