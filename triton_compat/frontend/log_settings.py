"""Triton's logging extension: `GET|POST /v2/logging` and gRPC `LogSettings`, over the
process's log settings (`engine/log_config.py`).

Owns: the checks of a settings update and their texts. In: a dict of the protocol's names (and
over gRPC which field of each value is set). Out: the settings as the protocol shows them.
Reference: Triton's protocol/extension_logging.md; tritonserver 2.51's `HandleLogging`
(http_server.cc) and `LogSettings` (grpc_server.cc): the order, the texts, the partial update
(settings before a bad one stay applied), and the log file fixed at start.
"""

from __future__ import annotations

from engine.log_config import FORMATS, as_dict, set_setting  # noqa: F401  (as_dict: the API's)
from triton_compat.errors import InferError

def update(changes: dict, typed: dict | None = None) -> dict:
    """Apply a settings update in the protocol's order (log_file, log_info, log_warning,
    log_error, log_verbose_level, log_format); a setting whose value is None (HTTP's null) is
    skipped. `typed`, over gRPC: name -> which field of the message's value is set ("bool",
    "uint32", "string"), checked as Triton checks it. Returns `as_dict()`.

    Raises InferError: 501 / UNIMPLEMENTED for log_file ("log file location can not be
    updated through network protocol"), 400 for a value of the wrong type or an unknown
    log_format (Triton's texts; tritonserver 2.51 answers HTTP's wrong JSON types 500 and an
    unknown format 503, docs/triton-conformance.md). Settings before the bad one stay applied,
    as in 2.51."""
    if changes.get("log_file") is not None:
        raise InferError("log file location can not be updated through network protocol", 501)
    for name, kind in (("log_info", "bool"), ("log_warning", "bool"), ("log_error", "bool"),
                       ("log_verbose_level", "uint32"), ("log_format", "string")):
        value = changes.get(name)
        if value is None:
            continue
        _check(name, kind, value, typed)
        if name == "log_format" and value not in FORMATS:   # HTTP's text names the flag
            flag = "log_format" if typed is not None else "--log_format"
            raise InferError(f"invalid argument for {flag}, got: {value}")
        set_setting(name, value)
    return as_dict()


def _check(name: str, kind: str, value, typed: dict | None) -> None:
    """Raise InferError(400) unless `value` is of `kind` (Triton's texts, gRPC's and HTTP's)."""
    if typed is not None:
        if typed.get(name) != kind:
            expect = {"bool": "boolean", "uint32": "int32", "string": "string"}[kind]
            raise InferError(f"expect {expect} for '{name}'")
        return
    ok = {"bool": isinstance(value, bool),
          "uint32": isinstance(value, int) and not isinstance(value, bool) and value >= 0,
          "string": isinstance(value, str)}[kind]
    if not ok:
        what = {"bool": "boolean", "uint32": "unsigned-integer", "string": "string"}[kind]
        raise InferError(f"attempt to access JSON non-{what} as {what}")
