"""A model's `sequence_batching` settings: control inputs, implicit state, request parameters.

Owns: the control tensors the server fills in (START / END / READY as `int32_false_true`,
`fp32_false_true` or `bool_false_true`, and CORRID as UINT64 / INT64 / UINT32 / INT32 /
STRING), the implicit states (`state`: input and output names, datatype, dims, the initial
value from `zero_data`, a `data_file` under the model's `initial_state/` folder, or zeros), the
checks Triton makes on them at load (its texts, from core `model_config_utils.cc`
GetBooleanSequenceControlProperties / GetTypedSequenceControlProperties and
`sequence_batch_scheduler.cc` GenerateInitialStateData), and reading a request's
`sequence_id` / `sequence_start` / `sequence_end` parameters (server `http_server.cc`).
Flows in: the parsed `ModelConfig`; flows out: `SequenceSpec`, numpy arrays per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import triton_to_np_dtype

from triton_compat.core.config import ConfigError, wire_datatype
from triton_compat.errors import InferError

# Triton's request flags (tritonserver.h TRITONSERVER_RequestFlag)
SEQUENCE_START, SEQUENCE_END = 1, 2
_KIND = mc.ModelSequenceBatching.Control
_BOOLEAN_KINDS = (_KIND.CONTROL_SEQUENCE_START, _KIND.CONTROL_SEQUENCE_END,
                  _KIND.CONTROL_SEQUENCE_READY)


@dataclass(frozen=True)
class Control:
    """One control input: its tensor name, kind (`mc.ModelSequenceBatching.Control.Kind`),
    wire datatype, and (false, true) values for the boolean kinds."""

    name: str
    kind: int
    datatype: str
    values: tuple = ()


@dataclass(frozen=True)
class State:
    """One implicit state: `initial` is the value a sequence starts from, batch dimension of
    1 first when the model batches."""

    input_name: str
    output_name: str
    datatype: str
    initial: np.ndarray


def sequence_params(params: dict) -> tuple[int | str, int]:
    """(correlation id, flags) from a request's `sequence_id` (uint or string, 0 / "" when
    absent), `sequence_start` and `sequence_end` parameters. Raises InferError(400) with
    Triton's texts for a value of another type (Triton sends them as 500, the code its JSON
    parser gives; here they are the client's error, as they are)."""
    corrid = params.get("sequence_id", 0)
    if isinstance(corrid, bool) or not isinstance(corrid, (int, str)) or \
            (isinstance(corrid, int) and corrid < 0):
        raise InferError("Unable to parse 'sequence_id': attempt to access JSON non-string "
                         "as string")
    flags = 0
    for key, bit in (("sequence_start", SEQUENCE_START), ("sequence_end", SEQUENCE_END)):
        value = params.get(key, False)
        if not isinstance(value, bool):
            raise InferError(f"Unable to parse '{key}': attempt to access JSON non-boolean "
                             "as boolean")
        flags |= bit if value else 0
    return corrid, flags


def sequence_tensors(config: mc.ModelConfig) -> tuple[list[str], list[str]]:
    """The tensors the sequence batcher adds to a model's own: (control and state inputs, in
    config order; state outputs that are not configured outputs)."""
    sb, outputs = config.sequence_batching, {t.name for t in config.output}
    inputs = [c.name for c in sb.control_input] + [s.input_name for s in sb.state]
    return inputs, [s.output_name for s in sb.state if s.output_name not in outputs]


def packed_corrid(corrid: int | str, datatype: str) -> np.ndarray:
    """The CORRID control value, one element of `datatype` (an integer type): the id, or for a
    string id what tritonserver 2.51 writes (SequenceBatch::SetControlTensors): the string's
    4-byte little-endian length and its bytes, cut to the integer's size ("abc" as UINT64 is
    0x0063626100000003)."""
    dtype = np.dtype(triton_to_np_dtype(datatype))
    if not isinstance(corrid, str):
        return np.array([corrid]).astype(dtype)
    raw = len(corrid.encode()).to_bytes(4, "little") + corrid.encode() + bytes(dtype.itemsize)
    return np.frombuffer(raw[:dtype.itemsize], dtype).copy()


def check_controls(config: mc.ModelConfig) -> None:
    """Triton's checks of the control inputs, made when the config is read (tritonserver 2.51
    refuses such a config at poll, before any version loads). Raises ConfigError."""
    spec = SequenceSpec.__new__(SequenceSpec)
    spec.model = config.name
    spec._controls(config.sequence_batching)


class SequenceSpec:
    """The control inputs and implicit states of one sequence model.

    Raises ConfigError from the constructor with Triton's load-time texts."""

    def __init__(self, config: mc.ModelConfig, model_dir: Path) -> None:
        sb, self.model = config.sequence_batching, config.name
        self.batching = config.max_batch_size > 0
        self.controls = self._controls(sb)
        corrid = [c for c in self.controls if c.kind == _KIND.CONTROL_SEQUENCE_CORRID]
        self.corrid_type = corrid[0].datatype if corrid else None
        self.corrid_name = corrid[0].name if corrid else None
        self.states = tuple(self._state(s, model_dir) for s in sb.state)
        names = [s.input_name for s in self.states]
        dup = [n for n in names if names.count(n) > 1]
        if dup:
            raise ConfigError(f"State input name '{dup[0]}' specified more than once.")

    def _controls(self, sb) -> tuple[Control, ...]:
        seen, kinds, out = set(), set(), []
        for ci in sb.control_input:
            if not ci.name:
                raise ConfigError(f"sequence batching control tensor must have a name for "
                                  f"{self.model}")
            if ci.name in seen:
                raise ConfigError(f"sequence batching control tensor '{ci.name}' is "
                                  f"specified for multiple control kinds for {self.model}")
            seen.add(ci.name)
            for c in ci.control:
                kind = _KIND.Kind.Name(c.kind)
                if c.kind in kinds:
                    raise ConfigError(f"sequence batching specifies multiple {kind} tensors "
                                      f"for {self.model}")
                kinds.add(c.kind)
                out.append(self._control(ci.name, c, kind))
        return tuple(out)

    def _control(self, name: str, c, kind: str) -> Control:
        pairs = (("int32_false_true", "INT32", c.int32_false_true),
                 ("fp32_false_true", "FP32", c.fp32_false_true),
                 ("bool_false_true", "BOOL", c.bool_false_true))
        if c.kind == _KIND.CONTROL_SEQUENCE_CORRID:
            if any(len(values) for _, _, values in pairs):
                raise ConfigError("sequence batching must not specify either "
                                  "'int32_false_true', 'fp32_false_true' or "
                                  f"'bool_false_true' for {kind} for {self.model}")
            datatype = wire_datatype(c.data_type)
            if datatype not in ("UINT64", "INT64", "UINT32", "INT32", "BYTES"):
                raise ConfigError("unexpected control data type, expected TYPE_UINT64, "
                                  "TYPE_INT64, TYPE_UINT32, TYPE_INT32, or TYPE_STRING for "
                                  f"{kind} for {self.model}")
            return Control(name, c.kind, datatype)
        if sum(1 for _, _, values in pairs if len(values)) > 1:
            raise ConfigError("sequence batching specifies more than one from "
                              "'int32_false_true', 'fp32_false_true' and 'bool_false_true' "
                              f"for {kind} for {self.model}")
        for field, datatype, values in pairs:
            if len(values):
                if len(values) != 2:
                    raise ConfigError(f"sequence batching control '{field}' must have "
                                      f"exactly 2 entries for {kind} for {self.model}")
                return Control(name, c.kind, datatype, tuple(values))
        raise ConfigError("sequence batching must specify either 'int32_false_true', "
                          f"'fp32_false_true' or 'bool_false_true' for {kind} for "
                          f"{self.model}")

    def _state(self, s, model_dir: Path) -> State:
        if len(s.initial_state) > 1:
            raise ConfigError(f"initial_state field for state input '{s.input_name}' must "
                              "contain exactly one or zero element. Found "
                              f"'{len(s.initial_state)}' elements.")
        datatype = wire_datatype(s.data_type)
        dtype = np.object_ if datatype == "BYTES" else triton_to_np_dtype(datatype)
        lead = [1] if self.batching else []
        if not s.initial_state:      # Triton: uninitialized, 1 for each variable dim
            shape = lead + [1 if d == -1 else d for d in s.dims]
            return State(s.input_name, s.output_name, datatype, np.zeros(shape, dtype))
        init = s.initial_state[0]
        name = s.input_name
        if init.data_type != s.data_type:
            raise ConfigError(f"The data type used for 'initial_state' field of state "
                              f"'{name}' does not match the state data type.")
        if not init.name:
            raise ConfigError(f"Field 'name' must be set when using initial_state for state "
                              f"input '{name}'.")
        if len(init.dims) != len(s.dims):
            raise ConfigError("Number of dimensions in 'initial_state' doesn't match the size "
                              f"of 'state' dimensions for state input '{name}'. "
                              f"{len(init.dims)} != {len(s.dims)}")
        for have, want in zip(init.dims, s.dims):
            if have == -1:
                raise ConfigError(f"'initial_state' field for state input name '{name}' "
                                  "contains variable dimensions.")
            if want != -1 and have != want:
                raise ConfigError(f"'initial_state' dim for input name '{name}' doesn't "
                                  f"match 'state' dim description. {have} != {want}")
        shape = lead + list(init.dims)
        which = init.WhichOneof("state_data")
        if which == "zero_data":
            value = np.zeros(shape, dtype)
        elif which == "data_file" and datatype != "BYTES":
            path = model_dir / "initial_state" / init.data_file
            try:
                data = path.read_bytes()
            except OSError as e:
                raise ConfigError(f"{path}: {e.strerror}") from None
            need = math.prod(init.dims) * np.dtype(dtype).itemsize
            if need > len(data):
                raise ConfigError(f"initial_state setting expects {need} bytes, but the data "
                                  f"provided from {init.data_file}only has {len(data)} bytes.")
            value = np.frombuffer(data[:need], dtype).reshape(shape).copy()
        else:
            raise ConfigError(f"initial_state setting expects state'{name}' to have "
                              "state_data set")
        return State(s.input_name, s.output_name, datatype, value)

    def check_corrid(self, corrid: int | str, request_id: str = "") -> None:
        """Raises InferError(400) for an integer id when the CORRID control is TYPE_STRING
        (the check of later Tritons' InferenceRequest::ValidateCorrelationId; tritonserver
        2.51 refuses it with a text that depends on memory contents,
        docs/triton-conformance.md). A string id on an integer CORRID runs, as in 2.51, with
        the CORRID value `packed_corrid` gives."""
        if self.corrid_type == "BYTES" and not isinstance(corrid, str):
            log = f"[request id: {request_id}] " if request_id else ""
            raise InferError(f"{log}sequence batching control '{self.corrid_name}' data-type "
                             f"is 'UINT64', but model '{self.model}' expects 'BYTES'")

    def control_inputs(self, flags: int, ready: bool, corrid: int | str) -> dict:
        """The control tensors of one request ([1, 1] when the model batches, else [1])."""
        shape = (1, 1) if self.batching else (1,)
        out = {}
        for c in self.controls:
            if c.kind == _KIND.CONTROL_SEQUENCE_CORRID:
                value = corrid if ready else (b"" if self.corrid_type == "BYTES" else 0)
                if c.datatype == "BYTES":
                    out[c.name] = np.full(shape, value.encode() if isinstance(value, str)
                                          else value, np.object_)
                else:
                    out[c.name] = packed_corrid(value, c.datatype).reshape(shape)
                continue
            on = {_KIND.CONTROL_SEQUENCE_START: flags & SEQUENCE_START,
                  _KIND.CONTROL_SEQUENCE_END: flags & SEQUENCE_END,
                  _KIND.CONTROL_SEQUENCE_READY: 1}[c.kind] and ready
            out[c.name] = np.full(shape, c.values[1 if on else 0],
                                  triton_to_np_dtype(c.datatype))
        return out

    def initial_states(self) -> dict[str, np.ndarray]:
        """A new sequence's state inputs, by input name."""
        return {s.input_name: s.initial for s in self.states}

