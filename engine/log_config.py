"""The process's logging under Triton's log settings (`--log-verbose`, `--log-info`,
`--log-warning`, `--log-error`, `--log-format`, `--log-file`), for every logger of the server
and of the engine core process (OpenAI and v2 faces alike); the logging extension that changes
them at run time is `triton_compat/frontend/log_settings.py`.

Owns: the one `LogSettings` of the process (`SETTINGS`), the handler on the root logger (the
console, or `--log-file`), the filter that drops info / warning / error records when their
switch is off and debug records unless the verbose level is 1 or more, and tritonserver
2.51's two layouts (`default`: `<level><MMDD> <hh:mm:ss.uuuuuu> <pid> <file>:<line>] <message>`;
`ISO8601`: `<YYYY-MM-DDThh:mm:ssZ> <level> <pid> <file>:<line>] <message>`; level I, W or E,
verbose records I), the message a JSON string unless `TRITON_SERVER_ESCAPE_LOG_MESSAGES=0`, as
2.51 escapes it against log injection (qa/L0_logging/log_format_test.py checks both).
In: the settings at start (`configure`), changes (`set_setting`). Out: the settings
(`as_dict`, `verbose()`: verbose level 1 or more logs each v2 infer request, and
`access_logged`: the v2 routes' access lines, at that level only). The engine core
process logs with the settings it started with (`CONTINUUM_LOG_SETTINGS`); changes made over
the network reach the server process.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass

FORMATS = ("default", "ISO8601")     # --log-format values, tritonserver's names
ENV = "CONTINUUM_LOG_SETTINGS"      # how the engine core process gets the start settings
ESCAPE_ENV = "TRITON_SERVER_ESCAPE_LOG_MESSAGES"   # tritonserver's: "0" logs messages raw


@dataclass
class LogSettings:
    """Triton's log settings; `log_verbose_level` 0 = no verbose (debug) records."""

    log_file: str = ""
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "default"


SETTINGS = LogSettings()


class _SwitchFilter(logging.Filter):
    """Drops the records whose level is switched off in `SETTINGS`."""

    def filter(self, record: logging.LogRecord) -> bool:
        s = SETTINGS
        if record.levelno >= logging.ERROR:
            return s.log_error
        if record.levelno >= logging.WARNING:
            return s.log_warning
        if record.levelno >= logging.INFO:
            return s.log_info
        return s.log_verbose_level > 0


class _TritonFormatter(logging.Formatter):
    """tritonserver's record layouts: `default` `I1128 03:18:46.123456 29630 file.py:12] msg`,
    ISO8601 `2026-11-28T03:18:46Z I 29630 file.py:12] msg` (levels I, W, E; verbose records
    are I, as tritonserver writes them). The message, traceback included, is one JSON string
    where escaping is on (a newline or a forged record in a request's text stays inside it)."""

    def __init__(self, iso8601: bool) -> None:
        super().__init__()
        self.iso8601 = iso8601
        self.escape = os.environ.get(ESCAPE_ENV, "1") != "0"

    def format(self, record: logging.LogRecord) -> str:
        level = "I" if record.levelno < logging.WARNING else record.levelname[0]
        if self.iso8601:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created))
            head = f"{stamp} {level}"
        else:
            t = time.localtime(record.created)
            micros = int(record.created % 1 * 1e6)
            head = f"{level}{time.strftime('%m%d %H:%M:%S', t)}.{micros:06d}"
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        if self.escape:
            message = json.dumps(message, ensure_ascii=False)
        return f"{head} {record.process} {record.filename}:{record.lineno}] {message}"


_HANDLER: logging.Handler | None = None
logger = logging.getLogger("continuum.http")     # the verbose request lines


def configure(settings: LogSettings | None = None) -> None:
    """Install `settings` (default: the engine core's inherited ones from `CONTINUUM_LOG_SETTINGS`,
    else Triton's defaults) as the process's logging: one handler on the root logger (the file
    `log_file`, appended to, or stderr), the switch filter, the format, and the `continuum`
    loggers at DEBUG when verbose. Raises OSError when the log file cannot be opened."""
    global _HANDLER
    if settings is None:
        inherited = os.environ.get(ENV)
        settings = LogSettings(**json.loads(inherited)) if inherited else LogSettings()
    for field, value in asdict(settings).items():
        setattr(SETTINGS, field, value)
    os.environ[ENV] = json.dumps(asdict(settings))      # for the processes this one spawns
    handler: logging.Handler = (logging.FileHandler(settings.log_file) if settings.log_file
                                else logging.StreamHandler())
    handler.addFilter(_SwitchFilter())
    root = logging.getLogger()
    if _HANDLER is not None:
        root.removeHandler(_HANDLER)
        _HANDLER.close()
    for old in list(root.handlers):        # a basicConfig of before: one handler only
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    _HANDLER = handler
    _apply()


def _apply() -> None:
    """The format and the verbose level of `SETTINGS` onto the installed handler."""
    if _HANDLER is not None:
        _HANDLER.setFormatter(_TritonFormatter(SETTINGS.log_format == "ISO8601"))
    logging.getLogger("continuum").setLevel(
        logging.DEBUG if SETTINGS.log_verbose_level > 0 else logging.NOTSET)


def verbose(level: int = 1) -> bool:
    """Whether the verbose level is at least `level` (request logging is level 1)."""
    return SETTINGS.log_verbose_level >= level


def access_logged(url: bytes) -> bool:
    """Whether an HTTP request to `url` (its request-target) gets uvicorn's access line, the
    server's access log being on: the OpenAI routes and the rest always, as `vllm serve`;
    the v2 routes (Triton's face) at verbose level 1 or more only, as tritonserver logs nothing
    per request at its default verbosity. Formatting a line cost the v2 HTTP path 12-47 % of
    its rate (perf_analyzer on `simple`, concurrency 16, AMD EPYC Zen 3)."""
    return not (url.startswith(b"/v2/") or url == b"/v2") or SETTINGS.log_verbose_level > 0


# libevhtp's method numbers, as tritonserver's verbose request lines print them
_EVHTP_METHODS = {"GET": 0, "HEAD": 1, "POST": 2, "PUT": 3, "DELETE": 4, "OPTIONS": 8,
                  "PATCH": 15}


def log_http_request(method: str, path: str) -> None:
    """tritonserver's `--log-verbose 1` line for each HTTP request: `HTTP request: 2 /v2/...`
    (the method as libevhtp numbers it)."""
    logger.debug("HTTP request: %d %s", _EVHTP_METHODS.get(method, -1), path, stacklevel=2)


def as_dict() -> dict:
    """The settings as `GET /v2/logging` answers them."""
    return asdict(SETTINGS)


def set_setting(name: str, value) -> None:
    """Change one setting (a `LogSettings` field other than log_file, already checked) and
    apply it at once."""
    setattr(SETTINGS, name, value)
    _apply()
