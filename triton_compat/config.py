"""Model configuration: `config.pbtxt` parsed with Triton's own protobuf schema.

Owns: reading `DIR/<model>/config.pbtxt` into `tritonclient.grpc.model_config_pb2.ModelConfig`
(`google.protobuf.text_format`, so an unknown field or a wrong type is a `ConfigError` naming the
file, line and field), the defaults Triton fills in (version policy latest 1, one CPU instance,
the backend's default file name), the version policy (which numeric version folders are
served), the datatype names (config `TYPE_FP32` ↔ wire `FP32`), the dynamic batcher's settings
as a `scheduler.dynamic_batcher.BatcherConfig`, and the JSON form served at `.../config`. A
config naming no backend gets the one whose default file is in a version folder; a python
model may have no config.pbtxt at all, and its `auto_complete_config` completes its config
(`triton_compat.auto_complete`), as Triton's auto-complete does.
"""

from __future__ import annotations

import functools
from pathlib import Path

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from tritonclient.grpc import model_config_pb2 as mc

from scheduler.dynamic_batcher import BatcherConfig, QueuePolicy

# backend name -> (platform reported in metadata, default model file name)
BACKENDS = {
    "python": ("python", "model.py"),
    "pytorch": ("pytorch_libtorch", "model.pt"),
    "onnxruntime": ("onnxruntime_onnx", "model.onnx"),
    "ensemble": ("ensemble", ""),
}
PLATFORM_TO_BACKEND = {"pytorch_libtorch": "pytorch", "onnxruntime_onnx": "onnxruntime",
                       "ensemble": "ensemble"}


class ConfigError(Exception):
    """A config.pbtxt that cannot be served; the message names the file and the field."""


class LoadError(ConfigError):
    """The model's own code failed while its config was completed (a python model's
    `auto_complete_config`): in Triton the backend runs it at the model's load, so this fails
    that load, as an instance that fails to start does."""


@functools.lru_cache(maxsize=None)
def wire_datatype(config_type: int) -> str:
    """`TYPE_FP32` (enum value) -> `FP32`; `TYPE_STRING` -> `BYTES` (KServe v2 names)."""
    name = mc.DataType.Name(config_type).removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


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
        from triton_compat.auto_complete import complete
        config = complete(config, model_dir)
        config.name = config.name or model_dir.name
    config.platform = BACKENDS[config.backend][0]
    if config.max_batch_size < 0:
        raise ConfigError(f"{path}: field 'max_batch_size' must be >= 0")
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if config.backend != "ensemble" and not config.instance_group:
        group = config.instance_group.add()
        group.count, group.kind = 1, mc.ModelInstanceGroup.KIND_CPU
    for i, group in enumerate(config.instance_group):
        if not group.name:                 # Triton's default: instances `<model>_<i>_<j>`
            group.name = f"{config.name}_{i}"
        if group.count < 1:
            group.count = 1
    _check_io(config, path)
    if config.HasField("sequence_batching"):
        from triton_compat.sequence.spec import check_controls
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
    if config.HasField("dynamic_batching") and config.max_batch_size == 0:
        raise ConfigError(f"{path}: field 'dynamic_batching' needs max_batch_size > 0")
    db = config.dynamic_batching
    if any(s < 1 or s > config.max_batch_size for s in db.preferred_batch_size):
        raise ConfigError(f"{path}: field 'preferred_batch_size' must be in "
                          f"1..max_batch_size ({config.max_batch_size})")
    if db.priority_levels and not 0 < db.default_priority_level <= db.priority_levels:
        raise ConfigError(f"{path}: field 'default_priority_level' must be in "
                          f"1..priority_levels ({db.priority_levels})")


def select_versions(config: mc.ModelConfig, model_dir: Path) -> list[int]:
    """The numeric version folders served under the config's version policy, ascending.

    Raises ConfigError when a `specific` version is missing or no version folder exists."""
    found = sorted(int(p.name) for p in model_dir.iterdir()
                   if p.is_dir() and p.name.isdigit() and int(p.name) > 0)
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        chosen = found
    elif which == "specific":
        missing = [v for v in policy.specific.versions if v not in found]
        if missing:
            raise ConfigError(f"{model_dir}: version {missing[0]} named by "
                              "version_policy.specific has no folder")
        chosen = sorted(policy.specific.versions)
    else:
        chosen = found[-max(1, policy.latest.num_versions):] if found else []
    if not chosen:
        raise ConfigError(f"{model_dir}: no version folder (e.g. {model_dir}/1/)")
    return chosen


def batcher_config(config: mc.ModelConfig) -> BatcherConfig:
    """The scheduler's view of `dynamic_batching` (or the default scheduler without it)."""
    if not config.HasField("dynamic_batching"):
        return BatcherConfig(max_batch_size=config.max_batch_size)
    db = config.dynamic_batching

    def policy(p: mc.ModelQueuePolicy) -> QueuePolicy:
        return QueuePolicy(mc.ModelQueuePolicy.TimeoutAction.Name(p.timeout_action),
                           p.default_timeout_microseconds, p.allow_timeout_override,
                           p.max_queue_size)

    return BatcherConfig(
        max_batch_size=config.max_batch_size, dynamic=True,
        preferred_batch_sizes=tuple(sorted(db.preferred_batch_size)),
        max_queue_delay_us=db.max_queue_delay_microseconds,
        priority_levels=db.priority_levels, default_priority_level=db.default_priority_level,
        default_policy=policy(db.default_queue_policy),
        level_policies={int(k): policy(v) for k, v in db.priority_queue_policy.items()})


def config_to_json(config: mc.ModelConfig, defaults: bool = False) -> dict:
    """The config as JSON: protobuf JSON with the proto field names and 64-bit integers as JSON
    numbers (protobuf's JSON writes them as strings). `defaults`: also the fields left at
    their default (`max_batch_size: 0`, `optional: false`, empty lists), as tritonserver writes
    the config at `/v2/models/{m}/config` and in a python model's `args["model_config"]`."""
    return _ints(MessageToDict(config, preserving_proto_field_name=True,
                               always_print_fields_with_no_presence=defaults),
                 config.DESCRIPTOR)


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def _ints(value, descriptor):
    for key, item in list(value.items()):
        field = descriptor.fields_by_name.get(key)
        if field is None:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            vfield = field.message_type.fields_by_name["value"]
            if vfield.message_type is not None:
                for k, v in item.items():
                    _ints(v, vfield.message_type)
        elif field.message_type is not None:
            for v in (item if isinstance(item, list) else [item]):
                _ints(v, field.message_type)
        elif field.type in _INT64:
            value[key] = [int(v) for v in item] if isinstance(item, list) else int(item)
    return value
