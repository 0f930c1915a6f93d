"""Data parallelism over Ray Serve: N full Continuum servers behind one ingress.

Modules: `config` (the `--data-parallel-backend` flags → Ray Serve deployment options),
`replica` (a Continuum server inside a Ray Serve replica), `ingress` (the HTTP front that
forwards to replicas through a streaming `DeploymentHandle`), `routing` (prefix-aware and random
request routers on `ray.serve.request_router`), `metrics` (per-replica and summed `/metrics`),
`app` (the application: `continuum serve --data-parallel-backend ray`, or
`serve run api.ray_serve.app:build_app`).

Imports nothing at package level: `api.cli` imports `config` without needing Ray installed.
"""
