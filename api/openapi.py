"""The request bodies in `/openapi.json`: routes parse their bodies themselves (to answer errors in
their protocol's own shape), so FastAPI cannot see them; this module documents them, so that
clients, generators and API fuzzers (schemathesis) see every route's body.

Owns: `install(app, schemas, bodies)`: adds the component schemas (pydantic models or plain
JSON schemas) to the generated document and points each listed route's request body at one.
In: the app, its schemas and routes; out: `app.openapi`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def _components(schemas: dict[str, type[BaseModel] | dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name, schema in schemas.items():
        if isinstance(schema, dict):
            out[name] = schema
            continue
        js = schema.model_json_schema(ref_template=REF)
        out.update(js.pop("$defs", {}))
        out[name] = js
    return out


def install(app: FastAPI, schemas: dict[str, type[BaseModel] | dict],
            bodies: dict[tuple[str, str], str],
            model_names: Callable[[], dict[str, list[str]]] = dict) -> None:
    """Make `app.openapi()` include `schemas` (name → pydantic model or JSON schema) as
    components and give each route in `bodies` ((method, path) → schema name) a required JSON
    request body of that schema. `model_names()` maps a path prefix ("/v1", "/v2") to the
    model names served there now: the document lists them as the `model` field's or path
    parameter's values (so it is rebuilt on every call). Call after every route is added."""
    components = _components(schemas)

    def openapi() -> dict:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        doc.setdefault("components", {}).setdefault("schemas", {}).update(
            copy.deepcopy(components))
        for (method, path), name in bodies.items():
            op = doc["paths"].get(path, {}).get(method)
            if op is not None:
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": REF.format(model=name)}}}}
        _name_models(doc, model_names())
        return doc

    app.openapi = openapi


def _name_models(doc: dict, names: dict[str, list[str]]) -> None:
    """Restrict the `model` body fields (/v1) and path parameters (/v2) to the served names."""
    schemas = doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        values = next((v for prefix, v in names.items() if path.startswith(prefix) and v), None)
        if values is None:
            continue
        enum = {"type": "string", "enum": list(values)}
        for op in ops.values():
            for param in op.get("parameters", []):
                if param["name"] == "model":
                    param["schema"] = enum
            ref = (op.get("requestBody", {}).get("content", {}).get("application/json", {})
                   .get("schema", {}).get("$ref", ""))
            props = schemas.get(ref.rsplit("/", 1)[-1], {}).get("properties", {})
            if "model" in props:
                props["model"] = enum
