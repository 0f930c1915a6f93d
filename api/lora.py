"""LoRA on the OpenAI server, with vLLM's flags and bodies.

Owns (the flags are `api.lora_flags`): which names the `model` field may take
(the base, or an adapter → `SamplingParams.lora_name`), the adapters' `/v1/models` cards
(`parent` = the base), and `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter`, refused
unless `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is true (vLLM's variable) and LoRA is on.

In: request bodies. Out: the adapter of a request, responses. Errors: a bad adapter at run
time is a 400 naming it; an unknown model or adapter the OpenAI 404 vLLM gives.
"""

from __future__ import annotations

import logging
import os

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from api.errors import APIError
from engine.lora.errors import LoraError

logger = logging.getLogger("continuum.api")

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def resolve_model(state, name: str) -> str | None:
    """The LoRA adapter a request's `model` names (None for the base model). Raises APIError
    404 in vLLM's words for a name that is neither."""
    if name == state.served_model_name:
        return None
    if name in state.lora_paths:
        return name
    raise APIError(404, f"The model `{name}` does not exist. Valid aliases: "
                        f"{state.served_model_name}.", "NotFoundError", "model", "model_not_found")


def model_cards(state) -> list[dict]:
    """`/v1/models` entries of the adapters: `root` their directory, `parent` the base."""
    return [{"id": name, "object": "model", "created": int(state.started),
             "owned_by": "continuum", "root": path, "parent": state.served_model_name,
             "max_model_len": state.info.get("max_model_len")}
            for name, path in state.lora_paths.items()]


def runtime_updates_allowed() -> bool:
    """Whether `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is true (1 / true / yes)."""
    return os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true", "yes")


class LoadLoraAdapterRequest(BaseModel):
    """`POST /v1/load_lora_adapter` (vLLM's body)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    """`POST /v1/unload_lora_adapter` (vLLM's body)."""

    lora_name: str
    lora_int_id: int | None = None                 # accepted, unused (as in vLLM)


def _invalid(message: str) -> APIError:
    return APIError(400, message, "InvalidUserInput", None, None)


def install(app, state, parse) -> None:
    """Add vLLM's runtime adapter routes to `app` when `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is
    true (else they do not exist: 404, as in vLLM). `parse` is the server's body parser."""
    if not runtime_updates_allowed():
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await parse(request, LoadLoraAdapterRequest, state.http_max_input_size)
        name = body.lora_name
        if not name or not body.lora_path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        if name == state.served_model_name:
            raise _invalid(f"The lora adapter '{name}' conflicts with a served base model.")
        if name in state.lora_paths and not body.load_inplace:
            raise _invalid(f"The lora adapter '{name}' has already been loaded. If you want to "
                           "load the adapter in place, set 'load_inplace' to True.")
        llm = _engine(state)
        try:
            if name in state.lora_paths:               # load_inplace
                await llm.lora("remove", name)
                state.lora_paths.pop(name, None)
            await llm.lora("add", name, body.lora_path)
        except LoraError as e:                          # a bad adapter: the client's fault
            raise _invalid(str(e)) from None
        state.lora_paths[name] = body.lora_path
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await parse(request, UnloadLoraAdapterRequest, state.http_max_input_size)
        name = body.lora_name
        if not name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        if name not in state.lora_paths:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError",
                           None, None)
        try:
            await _engine(state).lora("remove", name)
        except LoraError as e:
            raise _invalid(str(e)) from None
        state.lora_paths.pop(name, None)
        logger.info("Removed LoRA adapter: name '%s'", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _engine(state):
    """The engine client; 400 when LoRA is off, 503 while the engine loads."""
    if state.engine_config is None or not state.engine_config.enable_lora:
        raise _invalid("LoRA is not enabled: start the server with --enable-lora")
    if state.llm is None or not state.ready:
        raise APIError(503, "the engine is still loading", "service_unavailable")
    return state.llm
