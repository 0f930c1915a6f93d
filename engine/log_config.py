"""The process's logging under Triton's log settings (`--log-verbose`, `--log-info`,
`--log-warning`, `--log-error`, `--log-format`, `--log-file`), for every logger of the server
and of the engine core process (OpenAI and v2 faces alike); the logging extension that changes
them at run time is `triton_compat/frontend/log_settings.py`.

Owns: the one `LogSettings` of the process (`SETTINGS`), the handler on the root logger (the
console, or `--log-file`), the filter that drops info / warning / error records when their
switch is off and debug records unless the verbose level is 1 or more, and the two formats
(`default`: this server's `time name: message`; `ISO8601`: tritonserver's
`<YYYY-MM-DDThh:mm:ssZ> <level> <pid> <file>:<line>] <message>`).
In: the settings at start (`configure`), changes (`set_setting`). Out: the settings
(`as_dict`, `verbose()`: verbose level 1 or more logs each v2 infer request). The engine core
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
_DEFAULT_FORMAT = "%(asctime)s %(name)s: %(message)s"


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


class _Iso8601Formatter(logging.Formatter):
    """tritonserver's ISO8601 layout: `2026-11-28T03:18:46Z I 29630 file.py:12] message`
    (levels I, W, E, and V for verbose)."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created))
        level = "V" if record.levelno < logging.INFO else record.levelname[0]   # verbose: V
        text = f"{stamp} {level} {record.process} " \
               f"{record.filename}:{record.lineno}] {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


_HANDLER: logging.Handler | None = None


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
        _HANDLER.setFormatter(_Iso8601Formatter() if SETTINGS.log_format == "ISO8601"
                              else logging.Formatter(_DEFAULT_FORMAT))
    logging.getLogger("continuum").setLevel(
        logging.DEBUG if SETTINGS.log_verbose_level > 0 else logging.NOTSET)


def verbose(level: int = 1) -> bool:
    """Whether the verbose level is at least `level` (request logging is level 1)."""
    return SETTINGS.log_verbose_level >= level


def as_dict() -> dict:
    """The settings as `GET /v2/logging` answers them."""
    return asdict(SETTINGS)


def set_setting(name: str, value) -> None:
    """Change one setting (a `LogSettings` field other than log_file, already checked) and
    apply it at once."""
    setattr(SETTINGS, name, value)
    _apply()
