"""Trace settings: `--trace-config`, the global and per-model settings of the trace API, and
which requests are sampled — tritonserver 2.51's rules (`tracer.cc`, `http_server.cc`,
`grpc_server.cc`), its defaults (level OFF, rate 1000, count -1, log_frequency 0, mode triton)
and its texts.

Owns: `TraceSetting` (one setting and its sampling counters: every `rate`-th request is traced
while `count` lasts; the traces it collected until they are written: every `log_frequency`
traces to an indexed file, when `count` runs out likewise, else to the main file when the
setting is replaced or the server stops) and `TraceManager` (the global setting, the models'
settings — a model's fields not set fall back to the global ones, and follow them —, updates,
GET answers). A setting is replaced, never changed, so traces in flight keep theirs.
In: flags, updates (parsed from HTTP JSON, or gRPC through `grpc_body`, by `parse_update`). Out: `sample(model) -> Trace | None`, settings as the API shows them.
"""

from __future__ import annotations

import itertools
import re
import threading
from dataclasses import dataclass, field

from triton_compat.errors import InferError
from triton_compat.trace.record import Trace, TraceFile

LEVELS = ("TIMESTAMPS", "TENSORS")
UINT32_MAX, INT32_MAX, INT32_MIN = 2**32 - 1, 2**31 - 1, -2**31
_FIELDS = ("level", "rate", "count", "log_frequency")
CLEAR = object()                      # an update's value: back to the fallback setting


@dataclass
class TraceSetting:
    """One trace setting (see the module docstring); `level` empty = OFF; `specified`: the
    fields a model's setting sets itself (the rest follow the global setting)."""

    level: frozenset
    rate: int
    count: int
    log_frequency: int
    file: TraceFile
    mode: str = "triton"
    options: dict = field(default_factory=dict)     # the mode's other --trace-config keys
    specified: frozenset = frozenset()
    sampled: int = 0                  # requests seen (rate counts them)
    collected: int = 0                # traces written to the stream
    in_stream: int = 0                # traces in `stream`, not yet in a file
    live: int = 0                     # traces sampled and not finished
    retired: bool = False             # replaced: flushed once its last trace finishes
    stream: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def invalid_reason(self) -> str | None:
        """Why this setting traces nothing (tritonserver's reasons), or None."""
        if not self.level:
            return "tracing is disabled"
        if self.rate == 0:
            return "sample rate must be non-zero"
        if self.mode == "triton" and not self.file.path:
            return "trace file name is not given"
        return None

    def sample(self, force: bool = False) -> bool:
        """Whether this request is traced: every `rate`-th one while `count` (-1: no end)
        lasts; always when `force` (a propagated OpenTelemetry context), as tritonserver."""
        with self.lock:
            if self.invalid_reason() is not None:
                return False
            hit = False
            if self.count != 0 or force:
                self.sampled += 1
                hit = self.sampled % self.rate == 0
                if hit and self.count > 0:
                    self.count -= 1
                elif hit and self.count == 0:
                    hit = False
            if hit or force:
                self.live += 1
                return True
            return False

    def write(self, trace: Trace, exporter=None) -> None:
        """A finished trace: exported (opentelemetry), or into the stream, and the stream to
        an indexed file every `log_frequency` traces and when `count` ran out."""
        if exporter is not None:
            exporter.export(trace)
        with self.lock:
            self.live -= 1
            if self.mode == "triton":
                self.stream += trace.parts
                self.in_stream += 1
                self.collected += 1
                if (self.count == 0 and self.collected == self.sampled) or \
                        (self.log_frequency and self.in_stream >= self.log_frequency):
                    parts, self.stream, self.in_stream = self.stream, [], 0
                    self.file.save(parts, indexed=True)
            if self.retired and self.live == 0:
                self._flush()

    def retire(self) -> None:
        """Replaced by a new setting: its traces are written once the last one finished."""
        with self.lock:
            self.retired = True
            if self.live == 0:
                self._flush()

    def _flush(self) -> None:
        """What tritonserver writes when a setting goes: the traces not yet in a file, to an
        indexed file with `log_frequency`, else to the main file. Caller holds the lock."""
        if self.mode == "triton" and self.in_stream:
            parts, self.stream, self.in_stream = self.stream, [], 0
            self.file.save(parts, indexed=self.log_frequency != 0)

    def as_dict(self) -> dict:
        """The setting as the trace API answers it (every value a string, the level a list)."""
        out = {"trace_level": [x for x in LEVELS if x in self.level] or ["OFF"],
               "trace_rate": str(self.rate), "trace_count": str(self.count)}
        if self.mode == "triton":
            out.update(log_frequency=str(self.log_frequency), trace_file=self.file.path)
        out["trace_mode"] = self.mode
        out.update({k: v for k, v in self.options.items() if k not in ("file", "log-frequency")})
        return out


class TraceManager:
    """The trace settings of the server (see the module docstring). `exporter`: the
    OpenTelemetry exporter in opentelemetry mode (`otel.OtelExporter`), else None."""

    def __init__(self, level: frozenset = frozenset(), rate: int = 1000, count: int = -1,
                 log_frequency: int = 0, file: str = "", mode: str = "triton",
                 options: dict | None = None, exporter=None) -> None:
        self.files = {file: TraceFile(file)}
        args = dict(level=frozenset(level), rate=rate, count=count, log_frequency=log_frequency,
                    file=self.files[file], mode=mode, options=dict(options or {}))
        self.default = TraceSetting(**args)
        self.global_setting = TraceSetting(**args)
        self.models: dict[str, TraceSetting] = {}
        self.fallback_models: set[str] = set()
        self.exporter = exporter
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def setting(self, model: str = "") -> TraceSetting:
        """The setting a request to `model` is traced with ('' : the global one)."""
        return self.models.get(model) or self.global_setting

    def sample(self, model: str, headers=None) -> Trace | None:
        """A new trace for a request to `model`, or None (the common case: checked first,
        without a lock). `headers` (a mapping, lower-case keys): in opentelemetry mode a
        valid W3C `traceparent` there parents the trace and forces it, as in tritonserver."""
        setting = self.models.get(model) or self.global_setting
        if not setting.level:
            return None
        context = None
        if self.exporter is not None and headers is not None and "traceparent" in headers:
            context = _propagated(headers)
        if not setting.sample(force=context is not None):
            return None
        return Trace(next(self._ids), setting, self.exporter, context)

    def update(self, model: str, new: dict) -> None:
        """Apply `new` ({field: value or CLEAR}) to `model`'s setting ('' : the global one,
        then the models that fall back to it). Raises InferError(400) for a setting that
        would trace nothing but is not OFF (tritonserver's text)."""
        with self._lock:
            self._update(model, new)
            if not model:
                for name in list(self.fallback_models):
                    self._update(name, {})

    def _update(self, model: str, new: dict) -> None:
        current = self.models.get(model) if model else self.global_setting
        fallback = self.global_setting if model else self.default
        values, specified = {}, set()
        for name in _FIELDS:
            was = current is not None and name in current.specified
            keep = new.get(name) is not CLEAR and (was or name in new)
            if keep:
                specified.add(name)
            values[name] = (new[name] if name in new and new[name] is not CLEAR else
                            getattr(current, name) if keep else getattr(fallback, name))
        if model:
            if not specified:                   # all back to the global setting
                old = self.models.pop(model, None)
                self.fallback_models.discard(model)
                if old is not None:
                    old.retire()
                return
            # the trace file is never a model's own: a model's setting always follows the
            # global one in part (tritonserver's fallback_used_models_)
            self.fallback_models.add(model)
        setting = TraceSetting(**values, file=fallback.file, mode=fallback.mode,
                               options=fallback.options, specified=frozenset(specified))
        reason = setting.invalid_reason()
        if reason is not None and setting.level:
            raise InferError(f"Attempting to set invalid trace setting :{reason}")
        old = current
        if model:
            self.models[model] = setting
        else:
            self.global_setting = setting
        if old is not None:
            old.retire()

    def close(self) -> None:
        """The server stops: every setting's traces written, the main files closed."""
        with self._lock:
            for setting in [self.global_setting, *self.models.values()]:
                setting.retire()
            for f in self.files.values():
                f.close()
        if self.exporter is not None:
            self.exporter.shutdown()


def _propagated(headers):
    """The OpenTelemetry context of a valid `traceparent` (and `tracestate`), else None."""
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    context = TraceContextTextMapPropagator().extract(
        {k: headers[k] for k in ("traceparent", "tracestate") if k in headers})
    return context if otel_trace.get_current_span(context).get_span_context().is_valid \
        else None


# --------------------------------------------------------------------------- parsing
def _stoi(text: str):
    """C++'s std::stoi: leading space, a sign, digits, anything after ignored. Returns the
    int, "invalid" or "range"."""
    m = re.match(r"\s*([+-]?\d+)", text)
    if m is None:
        return "invalid"
    value = int(m.group(1))
    return value if INT32_MIN <= value <= INT32_MAX else "range"


def _number(name: str, text: str) -> int:
    """A trace API number (a string), as tritonserver parses it: trace_rate and log_frequency
    are uint32 (a negative value wraps, as C++'s cast does), trace_count >= -1.
    Raises InferError(400) with tritonserver's texts."""
    value = _stoi(text)
    low, high = (-1, INT32_MAX) if name == "trace_count" else (0, UINT32_MAX)
    if value == "invalid":
        raise InferError(f"Unable to parse '{name}', got: {text}")
    if value == "range":
        raise InferError(f"Unable to parse '{name}', value is out of range [ {low}, {high} ], "
                         f"got: {text}")
    if name == "trace_count":
        if value < -1:
            raise InferError(f"Unable to parse 'trace_count'. Expecting value >= -1, "
                             f"got:{text}")
        return value
    return value & UINT32_MAX


def _levels(values: list) -> frozenset | None:
    """The levels of a trace_level list (unknown names ignored, as tritonserver does); None
    when it names no level. Raises InferError(400) for OFF with others."""
    level, named = set(), False
    for v in values:
        if v == "OFF":
            if len(values) != 1:
                raise InferError("Expect only one trace level 'OFF' is specified")
            named = True
        elif v in LEVELS:
            level.add(v)
            named = True
    return frozenset(level) if named else None


_KEYS = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count",
         "log_frequency": "log_frequency"}
TRACE_FILE = "trace file location can not be updated through network protocol"


def parse_update(body: dict) -> dict:
    """The update ({field: value or CLEAR}, `TraceManager.update`'s) of a trace-setting body:
    HTTP's JSON, or gRPC's map through `grpc_body`. Raises InferError: 501 for trace_file, 400
    for a bad value (wrong JSON types too: 500 in tritonserver 2.51)."""
    if "trace_file" in body:
        raise InferError(TRACE_FILE, 501)
    new = {}
    for key, name in _KEYS.items():
        if key not in body:
            continue
        value = body[key]
        if value is None:
            new[name] = CLEAR
        elif key == "trace_level":
            if not isinstance(value, list):
                raise InferError("attempt to access JSON non-array as array")
            if not all(isinstance(v, str) for v in value):
                raise InferError("attempt to access JSON non-string as string")
            if (level := _levels(value)) is not None:
                new[name] = level
        elif not isinstance(value, str):
            raise InferError("attempt to access JSON non-string as string")
        else:
            new[name] = _number(key, value)
    return new


def grpc_body(settings) -> dict:
    """A gRPC `TraceSettingRequest.settings` map in the HTTP body's shape, for `parse_update`:
    a value with no strings is null (clears the field), trace_level a list, the others their
    first string (as tritonserver reads them)."""
    return {key: (list(v.value) if key == "trace_level" else v.value[0]) if len(v.value) else None
            for key, v in settings.items()}


def parse_trace_config(flags: list[str]) -> dict:
    """`--trace-config` values ("[mode,]key=value", repeatable; global keys rate, level,
    count, mode; triton: file, log-frequency; opentelemetry: url, resource,
    bsp_max_queue_size, bsp_schedule_delay, bsp_max_export_batch_size) as `TraceManager`'s
    keyword arguments, with `options` the chosen mode's keys. Raises ValueError naming the
    flag."""
    level, out, per_mode = set(), {}, {"triton": {}, "opentelemetry": {}}
    for flag in flags:
        mode, _, rest = flag.partition(",") if "," in flag else ("", "", flag)
        key, eq, value = rest.partition("=")
        if not eq:
            raise ValueError(f"--trace-config {flag}: expected [mode,]setting=value")
        if mode:
            if mode not in per_mode:
                raise ValueError(f"--trace-config {flag}: unknown mode {mode!r} (triton, "
                                 "opentelemetry)")
            allowed = ("file", "log-frequency") if mode == "triton" else (
                "url", "resource", "bsp_max_queue_size", "bsp_schedule_delay",
                "bsp_max_export_batch_size")
            if key not in allowed:
                raise ValueError(f"--trace-config {flag}: unknown {mode} setting {key!r}")
            if key == "resource":
                per_mode[mode].setdefault("resource", []).append(value)
            else:
                per_mode[mode][key] = value
        elif key == "level":
            if value != "OFF" and value not in LEVELS:
                raise ValueError(f"--trace-config {flag}: unknown level (OFF, TIMESTAMPS, "
                                 "TENSORS)")
            level = set() if value == "OFF" else level | {value}
        elif key in ("rate", "count"):
            out[key] = _flag_int(flag, value, -1 if key == "count" else 0)
        elif key == "mode":
            if value not in per_mode:
                raise ValueError(f"--trace-config {flag}: mode must be triton or opentelemetry")
            out["mode"] = value
        else:
            raise ValueError(f"--trace-config {flag}: unknown setting {key!r} (level, rate, "
                             "count, mode, triton,file=, triton,log-frequency=, "
                             "opentelemetry,url=, ...)")
    mode = out.get("mode", "triton")
    options = per_mode[mode]
    out.update(level=frozenset(level), mode=mode, file=options.get("file", ""),
               log_frequency=_flag_int("log-frequency", options.get("log-frequency", "0"), 0),
               options={k: v for k, v in options.items() if k != "resource"},
               resource=options.get("resource", []))
    return out


def _flag_int(flag: str, value: str, low: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"--trace-config {flag}: expected an integer") from None
    if number < low:
        raise ValueError(f"--trace-config {flag}: must be >= {low}")
    return number
