"""The model repository: Triton's folder layout, model control modes, load and unload.

Owns: `DIR/<model>/config.pbtxt` + `DIR/<model>/<version>/<file>` → a `ModelRuntime` (or
`EnsembleRuntime`) per served version, each model's state (READY / UNAVAILABLE with the
reason) for `/v2/repository/index`, and model lookup for the routes (404 unknown, 503 not
ready). `--model-control-mode none` loads every model at start and refuses load / unload;
`explicit` loads the `--load-model` names (`*` = all) at start and then what the client asks.
Loading an ensemble loads its composing models first. A model that fails to load is
UNAVAILABLE with the error as its reason; the server and the other models keep serving.
Models served without a folder (`builtin`: the LLM as Triton's vLLM backend shows it) are
served whether or not there is a repository folder (`root` None).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from triton_compat.core.config import ConfigError, LoadError, select_versions
from triton_compat.core.config_loader import load_config, load_labels
from triton_compat.core.ensemble import EnsembleRuntime
from triton_compat.core.runtime import ModelRuntime
from triton_compat.core.sequence.runtime import SequenceRuntime
from triton_compat.errors import InferError

logger = logging.getLogger("continuum.triton")


# tritonserver 2.51's refusal of a load / unload without explicit model control (UNAVAILABLE:
# HTTP 503); its text names polling whatever the mode, as 2.51's does.
NO_MODEL_CONTROL = "explicit model load / unload is not allowed if polling is enabled"


@dataclass
class ModelEntry:
    """A model of the repository: its config and its loaded versions."""

    name: str
    config: object = None
    runtimes: dict = field(default_factory=dict)   # version -> runtime
    state: str = "UNAVAILABLE"
    reason: str = "unloaded"
    stamp: tuple = ()                              # its files when loaded (`_stamp`)
    versions: list = field(default_factory=list)   # versions last loaded (or tried)
    labels: dict = field(default_factory=dict)     # output -> its label_filename's lines


def _stamp(folder: Path) -> tuple:
    """What identifies a model folder's contents: (path, size, mtime) of every file."""
    out = []
    for p in sorted(folder.rglob("*")):
        try:
            st = p.stat()
        except OSError:
            continue
        if p.is_file():
            out.append((str(p), st.st_size, st.st_mtime_ns))
    return tuple(out)


class ModelRepository:
    """Models of one repository folder. Thread-safe (one lock around load / unload)."""

    def __init__(self, root: str | Path | None, control_mode: str = "none",
                 load_models: list[str] | None = None) -> None:
        self.root = Path(root) if root is not None else None     # None: builtin models only
        if self.root is not None and not self.root.is_dir():
            raise ValueError(f"--model-repository {root}: not a directory")
        if control_mode not in ("none", "explicit"):
            raise ValueError(f"--model-control-mode must be none or explicit, got {control_mode}")
        self.control_mode = control_mode
        self.lock = threading.RLock()
        self.models: dict[str, ModelEntry] = {}
        # models served without a folder (the LLM as a Triton model): name -> model
        self.builtin: dict[str, object] = {}
        # models whose last load failed before any version loaded: the server is not ready
        # until they load or are unloaded (Triton's strict readiness)
        self.failed: set[str] = set()
        names = self.names()
        if control_mode == "explicit" and "*" not in (load_models or []):
            unknown = [n for n in load_models or [] if n not in names]
            if unknown:
                raise ValueError(f"--load-model {unknown[0]}: no such model in {self.root}")
            names = list(load_models or [])
        for name in names:
            if name in self.models and self.models[name].state == "READY":
                continue                 # already loaded as a step of an ensemble
            try:
                self.load(name, _startup=True)
            except InferError as e:
                logger.error("model %s failed to load: %s", name, e)

    def names(self) -> list[str]:
        """Model folders of the repository, sorted (none without a folder)."""
        if self.root is None:
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and not p.name.startswith("."))

    def index(self, ready_only: bool = False) -> list[dict]:
        """Entries of `/v2/repository/index`: name, version, state, reason."""
        out = []
        with self.lock:
            for name, model in sorted(self.builtin.items()):
                if model.ready():
                    out.append({"name": name, "version": "1", "state": "READY"})
                elif not ready_only:
                    out.append({"name": name, "version": "1", "state": "LOADING",
                                "reason": "the engine is loading"})
            for name in self.names():
                entry = self.models.get(name)
                if entry is None:
                    if not ready_only:
                        out.append({"name": name})
                    continue
                # as tritonserver 2.51: no "reason" when there is none
                extra = {"reason": entry.reason} if entry.reason else {}
                versions = sorted(entry.runtimes) or entry.versions
                if ready_only and entry.state != "READY":
                    continue
                out += [{"name": name, "version": str(v), "state": entry.state, **extra}
                        for v in versions] or [{"name": name, "state": entry.state, **extra}]
        return out

    def load(self, name: str, config_override: str | None = None,
             _startup: bool = False) -> None:
        """(Re)load `name` and, for an ensemble, its composing models. `config_override`: the
        model's configuration as JSON, used instead of its config.pbtxt (Triton's `config`
        load parameter). As in tritonserver 2.51: loading a model already loaded whose files
        have not changed since, without an override, changes nothing; a reload that fails
        leaves the loaded versions serving.

        Raises InferError: 503 in control mode none (after start-up), 400 for a config that
        does not load ("failed to poll", 500 in Triton), 400 / 500 for a version that fails
        to load (Triton's texts), 404 for a name not in the repository."""
        if self.control_mode == "none" and not _startup:
            raise InferError(NO_MODEL_CONTROL, 503)
        if name not in self.names():
            raise InferError(f"failed to load '{name}', failed to poll from model "
                             f"repository: no model folder '{name}' in {self.root}", 404)
        with self.lock:
            old = self.models.get(name)
            stamp = _stamp(self.root / name)
            if config_override is None and old is not None and old.state == "READY" and \
                    old.stamp == stamp:
                return
            entry = ModelEntry(name, stamp=stamp)
            try:
                entry.config = load_config(self.root / name, config_override)
            except LoadError as e:                      # the model's code: a version failure
                raise self._failed(entry, old, 1, e) from None
            except ConfigError as e:
                if old is None or not old.runtimes:     # listed by name alone, as Triton
                    self.models.pop(name, None)
                raise InferError(f"failed to load '{name}', failed to poll from model "
                                 f"repository: {e}") from None
            self._load_versions(entry, old)
            logger.info("loaded model %s versions %s", name, sorted(entry.runtimes))

    def _load_versions(self, entry: ModelEntry, old: ModelEntry | None) -> None:
        """Start `entry`'s versions (an ensemble's steps first), then put it in place of
        `old`. Raises InferError with Triton's text for a version that fails, keeping `old`.
        Caller holds the lock."""
        name, config = entry.name, entry.config
        version = None
        try:
            versions = select_versions(config, self.root / name)
            entry.labels = load_labels(config, self.root / name)
            if config.backend == "ensemble":
                for step in config.ensemble_scheduling.step:
                    dep = self.models.get(step.model_name)
                    if dep is None or dep.state != "READY":
                        self.load(step.model_name, _startup=True)
            for version in versions:
                entry.runtimes[version] = (
                    EnsembleRuntime(config, version, self.runtime)
                    if config.backend == "ensemble"
                    else SequenceRuntime(config, self.root / name, version)
                    if config.HasField("sequence_batching")
                    else ModelRuntime(config, self.root / name, version))
        except (ConfigError, InferError) as e:
            for rt in entry.runtimes.values():
                rt.close()
            raise self._failed(entry, old, version or 1, e) from None
        if old is not None:
            for rt in old.runtimes.values():
                rt.close()
        entry.state, entry.reason, entry.versions = "READY", "", sorted(entry.runtimes)
        self.models[name] = entry
        self.failed.discard(name)

    def _failed(self, entry: ModelEntry, old: ModelEntry | None, version: int,
                error: Exception) -> InferError:
        """A version of `entry` failed to load: tritonserver 2.51's text, 400 (and its
        index reason). Unless `old` versions go on serving, the model is UNAVAILABLE and the
        server not ready until it loads (strict readiness; an unload does not clear it)."""
        invalid = isinstance(error, ConfigError) and not isinstance(error, LoadError) or \
            isinstance(error, InferError) and error.status == 400
        reason = f"{'Invalid argument' if invalid else 'Internal'}: {error}"
        if old is None or not old.runtimes:
            entry.runtimes, entry.reason, entry.versions = {}, reason, [version]
            self.models[entry.name] = entry
            self.failed.add(entry.name)
        return InferError(f"load failed for model '{entry.name}': version {version} is at "
                          f"UNAVAILABLE state: {reason};\n")

    def unload(self, name: str) -> None:
        """Unload `name` (waits for its queued and running requests). Raises InferError(503)
        in control mode none."""
        if self.control_mode == "none":
            raise InferError(NO_MODEL_CONTROL, 503)
        with self.lock:           # an unknown name succeeds, as in tritonserver 2.51
            self._unload(name)

    def _unload(self, name: str) -> None:
        entry = self.models.get(name)
        if entry is None or name in self.failed:   # a failed model stays as it is (Triton)
            return
        for rt in entry.runtimes.values():
            rt.close()
        entry.runtimes, entry.state, entry.reason = {}, "UNAVAILABLE", "unloaded"

    def labels(self, name: str) -> dict[str, list[str]]:
        """{output: labels} of model `name` (its outputs' `label_filename`s; empty for a
        built-in model or one without labels)."""
        entry = self.models.get(name)
        return entry.labels if entry is not None else {}

    def runtime(self, name: str, version: str | int | None = None):
        """The runtime serving `name` at `version` (None / '' / -1: the latest loaded one).

        Raises InferError: 404 unknown model or version, or a model with no loaded version
        (unloaded, failed, loading); 503 while the LLM loads."""
        if name in self.builtin:
            model = self.builtin[name]
            if str(version) not in ("None", "", "-1", "1"):
                raise InferError(f"Request for unknown model: '{name}' version {version} is "
                                 "not found", 404)
            if not model.ready():
                raise InferError(f"Request for unknown model: '{name}' is not ready "
                                 "(loading)", 503)
            return model
        entry = self.models.get(name)
        if entry is None and name not in self.names():
            raise InferError(f"Request for unknown model: '{name}' is not found", 404)
        if entry is None or entry.state != "READY" or not entry.runtimes:
            raise InferError(f"Request for unknown model: '{name}' has no available "
                             "versions", 404)                  # tritonserver 2.51's text
        if version in (None, "", -1, "-1"):
            return entry.runtimes[max(entry.runtimes)]
        try:
            v = int(version)
        except ValueError:
            v = None
        if v not in entry.runtimes:
            raise InferError(f"Request for unknown model: '{name}' version {version} is not "
                             "found", 404)
        return entry.runtimes[v]

    def stats_runtime(self, name: str, version: str | int | None = None):
        """`runtime`, for the statistics extension: raises InferError(400) with tritonserver
        2.51's texts for an unknown or unloaded model or version (gRPC INVALID_ARGUMENT), where
        the other model routes answer 404."""
        try:
            return self.runtime(name, version)
        except InferError as e:
            if e.status != 404 or " version " not in e.message:
                raise InferError(f"requested model '{name}' is not available") from None
            raise InferError("requested model version is not available for model "
                             f"'{name}'") from None

    def versions(self, name: str) -> list[str]:
        """The loaded versions of `name`, ascending, as strings."""
        if name in self.builtin:
            return ["1"]
        entry = self.models.get(name)
        return [str(v) for v in sorted(entry.runtimes)] if entry else []

    def all_runtimes(self) -> list:
        """(name, version, runtime) of every loaded version, for metrics."""
        with self.lock:
            return [(n, 1, m) for n, m in self.builtin.items() if m.ready()] + \
                [(n, v, rt) for n, e in self.models.items() for v, rt in e.runtimes.items()]

    def ready(self) -> bool:
        """True when every model loaded at start (or since) is READY and no version has failed
        to load since (tritonserver's strict readiness: a failed model counts until it
        loads)."""
        return not self.failed and all(e.state == "READY" for e in self.models.values()
                                       if e.reason != "unloaded")

    def abort_all(self, message: str) -> None:
        """Answer every v2 request still in flight with 503 `message` (the drain's deadline
        passed); the LLM's requests are aborted by its engine."""
        with self.lock:
            runtimes = [rt for e in self.models.values() for rt in e.runtimes.values()]
        for rt in runtimes:
            rt.abort_all(message)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Unload everything (finalize python models) within `timeout_s` seconds in all (a
        server's shutdown). Returns False when a model's code was still running after it
        (logged; the caller should not wait for its threads)."""
        deadline = time.monotonic() + timeout_s
        clean = True
        with self.lock:
            for entry in self.models.values():
                for rt in entry.runtimes.values():
                    clean = rt.close(max(0.0, deadline - time.monotonic())) and clean
                entry.runtimes, entry.state, entry.reason = {}, "UNAVAILABLE", "unloaded"
        return clean
