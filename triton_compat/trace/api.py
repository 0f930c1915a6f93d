"""The trace API of both protocols: `GET|POST /v2[/models/{m}]/trace/setting` and gRPC
`TraceSetting` read or update a model's (or the global) trace setting through this one
function, with tritonserver 2.51's checks and texts.
"""

from __future__ import annotations

from triton_compat.errors import InferError
from triton_compat.trace.settings import parse_update


def trace_settings(ctx, model: str, update) -> dict:
    """A model's (or, for '', the global) trace setting of `ctx` (a `V2Context`) after
    `update` (a body in HTTP's JSON shape, gRPC's through `settings.grpc_body`; None: read
    only). Raises InferError: 400 for a model that is not ready (tritonserver's text) or a bad
    update, 501 for trace_file."""
    if model and not _model_ready(ctx, model):
        raise InferError(f"Request for unknown model : {model}")
    if update is not None:
        ctx.tracer.update(model, parse_update(update))
    return ctx.tracer.setting(model).as_dict()


def _model_ready(ctx, model: str) -> bool:
    try:
        ctx.repository().runtime(model, "")     # raises for a model with no ready version
    except InferError:
        return False
    return True
