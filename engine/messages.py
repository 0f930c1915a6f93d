"""The typed messages between the front end (`engine.async_llm`) and the engine core's loop
(`engine.core_proc`), whichever carries them: a queue (thread back end) or a pipe (process back
end, pickled). Each side dispatches on the message's type, as vLLM's `EngineCoreRequestType`
and SGLang's `TypeBasedDispatcher` do.

Front end -> core: `AddRequest`, `AbortRequests`, `FinishSequences` (a stop string the front
end found), `AbortAll`, `LoraCall`, `Stop`.
Core -> front end: `FlagsChecked` (first, from a core `continuum serve` spawned before its
own checks: the verdict on the flags that need torch), `Ready` (once, the process back end),
`Acknowledged` (per `AddRequest` and `LoraCall`: `error` None or the exception to raise to the
caller), `engine.outputs.
EngineCoreOutputs` (per step, and after aborts that changed the scheduler without a step),
`Dead` (the core stopped itself and says why), `LoraAdapters` (after every LoRA call, to every
front end: the adapters the core serves now).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from scheduler.request import SamplingParams


@dataclass(slots=True)
class AddRequest:
    """Queue a request; `arrival_time` in seconds of `time.monotonic()` (one clock for every
    process of the host)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0


@dataclass(slots=True)
class AbortRequests:
    """Finish requests (with their forked choices) as aborted."""

    request_ids: list[str]


@dataclass(slots=True)
class FinishSequences:
    """Finish sequences a stop string ended (not their sibling choices)."""

    sequence_ids: list[str]


@dataclass(slots=True)
class AbortAll:
    """Abort every request (a server shutting down)."""


@dataclass(slots=True)
class LoraCall:
    """Load (`op` "add": `name`, `path`) or unload ("remove": `name`) a LoRA adapter between
    steps; `call_id` names the acknowledgement."""

    call_id: str
    op: Literal["add", "remove"]
    name: str
    path: str | None = None


@dataclass(slots=True)
class Stop:
    """Leave the loop after the current step."""


@dataclass(slots=True)
class FlagsChecked:
    """A core spawned early (`engine.async_llm.spawn_engine_core(check_flags=True)`) checked
    the device / dtype / quantization flags (`engine.flag_checks.flag_error`): `error` None, or
    the one-line reason, after which it exits without building."""

    error: str | None = None


@dataclass(slots=True)
class Ready:
    """The core process built its engine; `info` is `engine.core_proc.engine_info`."""

    info: dict = field(default_factory=dict)


@dataclass(slots=True)
class Acknowledged:
    """An `AddRequest` (`call_id` = its request id) or a `LoraCall` was done (`error` None) or
    refused (`error`: the exception the caller gets)."""

    call_id: str
    error: BaseException | None = None


@dataclass(slots=True)
class Dead:
    """The core stopped itself: `reason`, one line."""

    reason: str


@dataclass(slots=True)
class LoraAdapters:
    """The adapters the core serves after a LoRA call, name -> path; sent to every front end so
    that several API processes (`--api-server-count`) list the same adapters."""

    paths: dict[str, str] = field(default_factory=dict)
