"""Model configuration: `config.pbtxt` parsed with Triton's own protobuf schema.

Owns: the backends and their default file names, the config errors, the version policy (which numeric version folders are
served), the datatype names (config `TYPE_FP32` ↔ wire `FP32`), the dynamic batcher's settings
as a `scheduler.dynamic_batcher.BatcherConfig`, and the JSON form served at `.../config`. Reading a
model's config.pbtxt is `triton_compat.core.config_loader`'s.
"""

from __future__ import annotations

import functools
from pathlib import Path

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
