"""The model repository: Triton's folder layout, model control modes, load and unload.

Owns: `DIR/<model>/config.pbtxt` + `DIR/<model>/<version>/<file>` → a `ModelRuntime` (or
`EnsembleRuntime`) per served version, each model's state (READY / UNAVAILABLE with the
reason) for `/v2/repository/index`, and model lookup for the routes (404 unknown, 503 not
ready). `--model-control-mode none` loads every model at start and refuses load / unload;
`explicit` loads the `--load-model` names (`*` = all) at start and then what the client asks.
Loading an ensemble loads its composing models first. A model that fails to load is
UNAVAILABLE with the error as its reason; the server and the other models keep serving.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from triton_compat.config import ConfigError, load_config, select_versions
from triton_compat.ensemble import EnsembleRuntime
from triton_compat.errors import InferError
from triton_compat.runtime import ModelRuntime
from triton_compat.sequence.runtime import SequenceRuntime

logger = logging.getLogger("continuum.triton")


@dataclass
class ModelEntry:
    """A model of the repository: its config and its loaded versions."""

    name: str
    config: object = None
    runtimes: dict = field(default_factory=dict)   # version -> runtime
    state: str = "UNAVAILABLE"
    reason: str = "unloaded"


class ModelRepository:
    """Models of one repository folder. Thread-safe (one lock around load / unload)."""

    def __init__(self, root: str | Path, control_mode: str = "none",
                 load_models: list[str] | None = None) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ValueError(f"--model-repository {root}: not a directory")
        if control_mode not in ("none", "explicit"):
            raise ValueError(f"--model-control-mode must be none or explicit, got {control_mode}")
        self.control_mode = control_mode
        self.lock = threading.RLock()
        self.models: dict[str, ModelEntry] = {}
        # models served without a folder (the LLM as a Triton model): name -> model
        self.builtin: dict[str, object] = {}
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
        """Model folders of the repository, sorted."""
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and not p.name.startswith("."))

    def index(self, ready_only: bool = False) -> list[dict]:
        """Entries of `/v2/repository/index`: name, version, state, reason."""
        out = []
        with self.lock:
            for name, model in sorted(self.builtin.items()):
                if model.ready() or not ready_only:
                    out.append({"name": name, "version": "1",
                                "state": "READY" if model.ready() else "UNAVAILABLE",
                                "reason": "" if model.ready() else "loading"})
            for name in self.names():
                entry = self.models.get(name)
                if entry is None:
                    if not ready_only:
                        out.append({"name": name})
                    continue
                if entry.runtimes:
                    out += [{"name": name, "version": str(v), "state": entry.state,
                             "reason": entry.reason} for v in sorted(entry.runtimes)]
                elif not ready_only:
                    out.append({"name": name, "state": entry.state, "reason": entry.reason})
        return out

    def load(self, name: str, config_override: str | None = None,
             _startup: bool = False) -> None:
        """(Re)load `name` and, for an ensemble, its composing models. `config_override`: the
        model's configuration as JSON, used instead of its config.pbtxt (Triton's `config`
        load parameter).

        Raises InferError: 400 in control mode none (after start-up) or for a load failure,
        404 for a name not in the repository."""
        if self.control_mode == "none" and not _startup:
            raise InferError("explicit model load / unload is not allowed if model control "
                             "mode is NONE (start with --model-control-mode explicit)")
        if name not in self.names():
            raise InferError(f"failed to load '{name}', failed to poll from model "
                             f"repository: no model folder '{name}' in {self.root}", 404)
        with self.lock:
            self._unload(name)
            entry = self.models[name] = ModelEntry(name)
            try:
                entry.config = config = load_config(self.root / name, config_override)
                versions = select_versions(config, self.root / name)
                if config.backend == "ensemble":
                    for step in config.ensemble_scheduling.step:
                        dep = self.models.get(step.model_name)
                        if dep is None or dep.state != "READY":
                            self.load(step.model_name, _startup=True)
                for v in versions:
                    entry.runtimes[v] = (
                        EnsembleRuntime(config, v, self.runtime) if config.backend == "ensemble"
                        else SequenceRuntime(config, self.root / name, v)
                        if config.HasField("sequence_batching")
                        else ModelRuntime(config, self.root / name, v))
            except (ConfigError, InferError) as e:
                for rt in entry.runtimes.values():
                    rt.close()
                entry.runtimes, entry.state, entry.reason = {}, "UNAVAILABLE", str(e)
                raise InferError(f"load failed for model '{name}': {e}") from None
            entry.state, entry.reason = "READY", ""
            logger.info("loaded model %s versions %s", name, versions)

    def unload(self, name: str) -> None:
        """Unload `name` (waits for its queued and running requests). Raises InferError."""
        if self.control_mode == "none":
            raise InferError("explicit model load / unload is not allowed if model control "
                             "mode is NONE (start with --model-control-mode explicit)")
        with self.lock:
            if name not in self.models and name not in self.names():
                raise InferError(f"failed to unload '{name}': unknown model", 404)
            self._unload(name)

    def _unload(self, name: str) -> None:
        entry = self.models.get(name)
        if entry is None:
            return
        for rt in entry.runtimes.values():
            rt.close()
        entry.runtimes, entry.state, entry.reason = {}, "UNAVAILABLE", "unloaded"

    def runtime(self, name: str, version: str | int | None = None):
        """The runtime serving `name` at `version` (None / '' / -1: the latest loaded one).

        Raises InferError: 404 unknown model or version, 503 model not ready."""
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
            raise InferError(f"Request for unknown model: '{name}' is not ready "
                             f"({entry.reason if entry else 'unloaded'})", 503)
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
        """True when every model loaded at start (or since) is READY."""
        return all(e.state == "READY" for e in self.models.values()
                   if e.reason != "unloaded")

    def close(self) -> None:
        """Unload everything (finalize python models)."""
        with self.lock:
            for name in list(self.models):
                self._unload(name)
