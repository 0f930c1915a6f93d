"""Reading a model's configuration: `DIR/<model>/config.pbtxt` (or a load's JSON override) into
`tritonclient.grpc.model_config_pb2.ModelConfig` with Triton's own protobuf schema
(`google.protobuf.text_format`, so an unknown field or a wrong type is a `ConfigError` naming
the file, line and field), completed as Triton completes it: the defaults it fills in
(version policy latest 1, one CPU instance named `<model>_<i>`, the platform), the backend of a
config naming none (the one whose default file is in a version folder), a python model's own
`auto_complete_config` (`triton_compat.core.auto_complete`; such a model may have no config.pbtxt
at all), and the checks of its inputs, outputs, batcher and sequence controls.
Also its outputs' class labels (`load_labels`: the files their `label_filename` names, read at
load for the classification extension). Flows in: a model folder; flows out: a `ModelConfig`
or a `ConfigError` / `LoadError`.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from triton_compat.core.auto_complete import complete
from triton_compat.core.backends.ragged import check_batch_io
from triton_compat.core.config import BACKENDS, ConfigError
from triton_compat.core.sequence.spec import check_controls

PLATFORM_TO_BACKEND = {"pytorch_libtorch": "pytorch", "onnxruntime_onnx": "onnxruntime",
                       "ensemble": "ensemble"}


def load_config(model_dir: Path, override: str | None = None) -> mc.ModelConfig:
    """Parse and complete `model_dir/config.pbtxt`, or `override` instead of the file: the
    model's configuration as JSON (the repository load's `config` parameter, Triton's model
    configuration override). Raises ConfigError."""
    path = model_dir / "config.pbtxt"
    if override is not None:
        try:
            config = json_format.Parse(override, mc.ModelConfig())
        except json_format.ParseError as e:
            raise ConfigError(f"Invalid config override: {e}") from None
        path = Path("the 'config' parameter")
    elif not path.exists() and detect_backend(model_dir) == "python":
        config = mc.ModelConfig()    # auto-completed by the model (Triton's minimal config)
    else:
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the model configuration: {e}") from None
        try:
            config = text_format.Parse(text, mc.ModelConfig())
        except text_format.ParseError as e:
            raise ConfigError(f"{path}: {e}") from None
    if not config.name:
        config.name = model_dir.name
    elif config.name != model_dir.name:
        raise ConfigError(f"{path}: field 'name': model name '{config.name}' does not match "
                          f"its directory '{model_dir.name}'")
    if not config.backend:
        config.backend = PLATFORM_TO_BACKEND.get(config.platform, "") or \
            ("" if config.platform else detect_backend(model_dir))
    if config.backend not in BACKENDS:
        raise ConfigError(f"{path}: field 'backend': unsupported backend "
                          f"'{config.backend or config.platform}' (supported: "
                          f"{', '.join(BACKENDS)})")
    if config.backend == "python":     # the model's auto_complete_config, if it has one
        config = complete(config, model_dir)
        config.name = config.name or model_dir.name
    config.platform = BACKENDS[config.backend][0]
    if config.max_batch_size < 0:
        raise ConfigError(f"{path}: field 'max_batch_size' must be >= 0")
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if config.backend != "ensemble" and not config.instance_group:
        group = config.instance_group.add()     # Triton's: named as the model (instance `<m>_0`)
        group.name, group.count, group.kind = config.name, 1, mc.ModelInstanceGroup.KIND_CPU
    for i, group in enumerate(config.instance_group):
        if not group.name:                 # Triton's default: instances `<model>_<i>_<j>`
            group.name = f"{config.name}_{i}"
        if group.count < 1:
            group.count = 1
    _check_io(config, path)
    if config.HasField("sequence_batching"):
        check_controls(config)
    return config


def detect_backend(model_dir: Path) -> str:
    """The backend of a model whose config names none: the first of BACKENDS whose default
    file is in a version folder (Triton core's auto-complete of the backend field), else ''."""
    for backend, (_, filename) in BACKENDS.items():
        if filename and any(p.is_dir() and p.name.isdigit() and (p / filename).is_file()
                            for p in model_dir.iterdir()):
            return backend
    return ""


def _check_io(config: mc.ModelConfig, path: Path) -> None:
    if config.backend == "ensemble" and not config.HasField("ensemble_scheduling"):
        raise ConfigError(f"{path}: field 'ensemble_scheduling' is required for an ensemble")
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen = set()
        for t in tensors:
            if t.name in seen:
                raise ConfigError(f"{path}: field '{kind}': duplicate name '{t.name}'")
            seen.add(t.name)
            if t.data_type == mc.TYPE_INVALID:
                raise ConfigError(f"{path}: field '{kind}.data_type' of '{t.name}' is missing")
            if any(d < -1 or d == 0 for d in t.dims) and not (kind == "input" and t.dims == []):
                raise ConfigError(f"{path}: field '{kind}.dims' of '{t.name}': dimensions "
                                  "must be positive or -1")
    if (problem := check_batch_io(config)) is not None:
        raise ConfigError(f"{path}: {problem}")
    if config.HasField("dynamic_batching") and config.max_batch_size == 0:
        raise ConfigError(f"{path}: field 'dynamic_batching' needs max_batch_size > 0")
    db = config.dynamic_batching
    if any(s < 1 or s > config.max_batch_size for s in db.preferred_batch_size):
        raise ConfigError(f"{path}: field 'preferred_batch_size' must be in "
                          f"1..max_batch_size ({config.max_batch_size})")
    if db.priority_levels and not 0 < db.default_priority_level <= db.priority_levels:
        raise ConfigError(f"{path}: field 'default_priority_level' must be in "
                          f"1..priority_levels ({db.priority_levels})")


def load_labels(config, model_dir: Path) -> dict[str, list[str]]:
    """{output name: labels, line by line} of each output with a `label_filename` (relative to
    `model_dir`, as Triton reads it at load). Raises ConfigError when a file cannot be read."""
    labels = {}
    for out in config.output:
        if not out.label_filename:
            continue
        path = model_dir / out.label_filename
        try:
            labels[out.name] = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"failed to read label file '{path}' of output '{out.name}': "
                              f"{e}") from None
    return labels
