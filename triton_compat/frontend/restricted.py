"""Triton's restricted APIs over HTTP: `--http-restricted-api=<API>[,<API>...]:<key>=<value>`.

Owns: parsing the flag (repeatable; each API category in one group at most), the map of v2
routes to Triton's API categories, and `RestrictedAPI`, pure ASGI middleware that answers a
request to a restricted category without header `<key>: <value>` with 403 and
`{"error": "This API is restricted, expecting header '<key>'"}` before any route runs.
Reference: Triton server docs, "Limit Endpoint Access" (inference_protocols.md) and
`http_server.cc` (RESTRICTED_CATEGORY per handler).
"""

from __future__ import annotations

import re


CATEGORIES = ("health", "metadata", "inference", "shared-memory", "model-config",
              "model-repository", "statistics", "trace", "logging")

_MODEL = r"/v2/models/[^/]+(?:/versions/[^/]+)?"
_ROUTES = [   # (path regex, category); the first match wins
    (re.compile(r"/v2/health/.*"), "health"),
    (re.compile(rf"{_MODEL}/ready"), "health"),
    (re.compile(r"/v2/models/stats|" + rf"{_MODEL}/stats"), "statistics"),
    (re.compile(rf"{_MODEL}/config"), "model-config"),
    (re.compile(rf"{_MODEL}/(?:infer|generate|generate_stream)"), "inference"),
    (re.compile(r"/v2/repository(?:/.*)?"), "model-repository"),
    (re.compile(r"/v2/(?:system|cuda)sharedmemory(?:/.*)?"), "shared-memory"),
    (re.compile(r"/v2/trace/.*|" + rf"{_MODEL}/trace/.*"), "trace"),
    (re.compile(r"/v2/logging"), "logging"),
    (re.compile(r"/v2|" + _MODEL), "metadata"),
]


def parse_restrictions(specs: list[str], flag: str = "--http-restricted-api"
                       ) -> dict[str, tuple[str, str]]:
    """`--http-restricted-api` (or `--grpc-restricted-protocol`, named by `flag`) values →
    {category: (header key, value)}.

    Raises ValueError naming the flag on a bad group, an unknown category or a category given
    in two groups."""
    out: dict[str, tuple[str, str]] = {}
    for spec in specs:
        apis, sep, header = spec.partition(":")
        key, eq, value = header.partition("=")
        if not sep or not eq or not apis or not key:
            raise ValueError(f"{flag} {spec!r}: expected "
                             "<API>[,<API>...]:<key>=<value>")
        noun = "protocol" if "grpc" in flag else "api"     # tritonserver 2.51's texts
        for api in apis.split(","):
            if api not in CATEGORIES:
                raise ValueError(f"{flag}: unknown restricted {noun} {api!r} (one of "
                                 f"{', '.join(CATEGORIES)})")
            if api in out:
                raise ValueError(f"{flag}: {noun} {api!r} can not be specified in multiple "
                                 "config groups")
            out[api] = (key.lower(), value)
    return out


def category(path: str) -> str | None:
    """Triton's API category of a `/v2` path, or None for other paths."""
    for pattern, name in _ROUTES:
        if pattern.fullmatch(path):
            return name
    return None


class RestrictedAPI:
    """Pure ASGI middleware enforcing `restrictions` ({category: (header key, value)})."""

    def __init__(self, app, restrictions: dict[str, tuple[str, str]]) -> None:
        self.app, self.restrictions = app, restrictions

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v2"):
            rule = self.restrictions.get(category(scope["path"].rstrip("/") or "/"))
            if rule is not None:
                key, value = rule
                got = dict(scope["headers"]).get(key.encode("latin-1"))
                if got is None or got.decode("latin-1") != value:
                    from fastapi.responses import JSONResponse  # the flags import no FastAPI
                    response = JSONResponse(
                        {"error": f"This API is restricted, expecting header '{key}'"},
                        status_code=403)
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)
