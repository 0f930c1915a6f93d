"""deploy/: the Kubernetes manifest and the Ray Serve config, checked without a cluster.

- kubernetes.yaml: a Deployment and a Service of the right kinds and API versions; probes on
  `/health/ready` (readiness) and `/health` (liveness) at the container's port; the command is a
  valid `continuum serve` command line (Continuum's own parser) that listens on 0.0.0.0;
  `terminationGracePeriodSeconds` covers the preStop sleep plus `--shutdown-timeout`; the
  Service selects the pods and targets the container's port.
- ray-serve.yaml: valid by Ray Serve's own schema (`ServeDeploySchema`); its import path is the
  documented builder; its `args` are valid `continuum serve` flags and give the deployment
  options that matter (autoscaling bounds, graceful shutdown past --shutdown-timeout, router).
"""

import importlib
from pathlib import Path

import pytest
import yaml

from api.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _k8s() -> dict:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()) if d]
    return {d["kind"]: d for d in docs}


def test_kubernetes_manifest_probes_grace_period_and_service():
    docs = _k8s()
    assert set(docs) == {"Deployment", "Service"}
    dep, svc = docs["Deployment"], docs["Service"]
    assert dep["apiVersion"] == "apps/v1" and svc["apiVersion"] == "v1"
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    args = build_parser().parse_args(container["command"][1:])
    assert container["command"][0] == "continuum" and args.command == "serve"
    assert args.host == "0.0.0.0" and args.port in ports.values()

    for probe, path in (("readinessProbe", "/health/ready"), ("livenessProbe", "/health")):
        get = container[probe]["httpGet"]
        assert get["path"] == path
        assert ports.get(get["port"], get["port"]) == args.port

    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert args.shutdown_timeout > 0
    assert grace >= float(pre_stop[1]) + args.shutdown_timeout

    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (svc_port,) = svc["spec"]["ports"]
    assert ports.get(svc_port["targetPort"], svc_port["targetPort"]) == args.port


def test_ray_serve_config_is_valid_and_builds_the_documented_app():
    schema = pytest.importorskip("ray.serve.schema", reason="needs ray[serve] (the test extra)")
    from api.ray_serve.config import argv_from_dict, data_parallel_config, replica_args

    config = schema.ServeDeploySchema.model_validate(
        yaml.safe_load((DEPLOY / "ray-serve.yaml").read_text()))
    (app,) = config.applications
    assert app.import_path == "api.ray_serve.app:build_app" and app.route_prefix == "/"
    module, name = app.import_path.split(":")
    assert callable(getattr(importlib.import_module(module), name))

    args = replica_args(argv_from_dict({"data-parallel-backend": "ray", **app.args}))
    dp = data_parallel_config(args)
    opts = dp.replica_options()
    assert opts["num_replicas"] == "auto"
    scaling = opts["autoscaling_config"]
    assert 1 <= scaling["min_replicas"] <= scaling["max_replicas"]
    assert scaling["target_ongoing_requests"] > 0
    assert args.shutdown_timeout > 0
    assert opts["graceful_shutdown_timeout_s"] > args.shutdown_timeout
    assert opts["request_router_config"]["request_router_class"].endswith(
        "PrefixAffinityRouter")
    assert config.http_options.port == 8000


def test_bad_data_parallel_flags_fail_with_one_line():
    from api.ray_serve.config import data_parallel_config

    def check(argv: list[str]) -> str:
        with pytest.raises(ValueError) as e:
            data_parallel_config(build_parser().parse_args(["serve", *argv]))
        return str(e.value)

    assert check(["--num-replicas", "2"]) == \
        "--num-replicas need(s) --data-parallel-backend ray"
    assert check(["--data-parallel-backend", "ray", "--max-replicas", "3"]) == \
        "--max-replicas need(s) --num-replicas auto"
    assert "must be >= 1 and >= --min-replicas" in check(
        ["--data-parallel-backend", "ray", "--num-replicas", "auto", "--min-replicas", "3",
         "--max-replicas", "2"])
    assert check(["--data-parallel-backend", "ray", "--num-replicas", "0"]) == \
        "--num-replicas must be >= 1 or auto, got 0"
