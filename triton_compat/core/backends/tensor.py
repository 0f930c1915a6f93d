"""Tensor backends (TorchScript, ONNX Runtime): the batch is one concatenated tensor per input.

Owns: concatenating the requests' inputs along the batch dimension (in config order), running
the model once, and splitting every output back along the batch dimension by each request's
batch size. Inputs that allow ragged batching: where the config declares a `batch_input` or
`batch_output`, as Triton (`ragged.RaggedBatching`: one 1-D tensor of every request's elements,
the batch inputs after the configured inputs, scattered outputs); else padded to the largest
shape in the batch with zeros (a tokenizer's attention mask padded the same way is the mask; a
deviation, docs/triton-deviations.md). Requests of differently shaped non-ragged inputs never
reach one batch (the batcher's shape key keeps them apart). A model failure fails every
request of the batch with the error (status 500).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from triton_compat.core.backends.base import Backend, BackendRequest, ExecTimes
from triton_compat.core.backends.ragged import RaggedBatching
from triton_compat.errors import InferError
from triton_compat.core.sequence.spec import sequence_tensors


def _pad(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Zero-pad arrays of equal rank to the elementwise-largest shape past the batch dim."""
    target = tuple(max(a.shape[i] for a in arrays) for i in range(1, arrays[0].ndim))
    out = []
    for a in arrays:
        if a.shape[1:] != target:
            widths = [(0, 0)] + [(0, t - s) for s, t in zip(a.shape[1:], target)]
            a = np.pad(a, widths)
        out.append(a)
    return out


def _dims(shape) -> str:
    """An ONNX input shape as Triton prints dims: [-1,3] (symbolic dims are -1)."""
    return "[" + ",".join(str(d) if isinstance(d, int) else "-1" for d in shape) + "]"


class BatchedTensorBackend(Backend):
    """Concatenate → `run` → split. Subclasses implement `run(inputs) -> outputs` (numpy)."""

    def __init__(self, config) -> None:
        self.name = config.name
        self.batching = config.max_batch_size > 0
        self.input_names = [t.name for t in config.input]
        self.ragged = {t.name for t in config.input if t.allow_ragged_batch}
        self.output_names = [t.name for t in config.output]
        self.rb = None                     # Triton's ragged batching, where the config asks
        if self.batching and (config.batch_input or config.batch_output):
            self.rb = RaggedBatching(config)
            self.input_names += self.rb.targets
        inputs, outputs = sequence_tensors(config)     # the sequence batcher's controls, states
        self.input_names += inputs
        self.output_names += outputs

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Execute the model on full-batch inputs; return every output by config name."""
        raise NotImplementedError

    def _gather(self, requests: list[BackendRequest]) -> dict[str, np.ndarray]:
        """The model's inputs for the batch (module docstring)."""
        if self.rb is not None:
            batch = self.rb.batch_inputs(requests)
            for name in self.input_names:
                if name not in batch:
                    batch[name] = self.rb.gather(name, [r.inputs[name] for r in requests])
            return batch
        batch = {}
        for name in self.input_names:
            arrays = [r.inputs[name] for r in requests]
            if name in self.ragged and len(arrays) > 1:
                arrays = _pad(arrays)
            batch[name] = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        return batch

    def _split(self, outputs: dict[str, np.ndarray], requests: list[BackendRequest]) -> list:
        """Each request's outputs: rows of the batch dimension by its batch size, a scattered
        output by its source input's shape. Raises ValueError for an output too small."""
        if not self.batching:
            return [{k: outputs[k] for k in requests[0].outputs}]
        scattered = {k: self.rb.scatter(k, outputs[k], requests)
                     for k in (self.rb.scattered if self.rb else ())}
        results, start = [], 0
        for i, r in enumerate(requests):
            n = r.batch_size
            results.append({k: scattered[k][i] if k in scattered else outputs[k][start:start + n]
                            for k in r.outputs})
            start += n
        return results

    def execute(self, requests: list[BackendRequest]) -> tuple[list, ExecTimes]:
        """Run the batch once; one dict of requested outputs per request."""
        t0 = time.perf_counter_ns()
        batch = self._gather(requests) if self.batching else requests[0].inputs
        t1 = time.perf_counter_ns()
        try:
            outputs = self.run(batch)
            t2 = time.perf_counter_ns()
            results = self._split(outputs, requests)
        except Exception as e:
            err = InferError(f"model '{self.name}' failed: {type(e).__name__}: {e}", 500)
            return [err] * len(requests), ExecTimes(t1 - t0, time.perf_counter_ns() - t1, 0)
        return results, ExecTimes(t1 - t0, t2 - t1, time.perf_counter_ns() - t2)


class TorchScriptBackend(BatchedTensorBackend):
    """`pytorch` backend: a TorchScript `model.pt` called with the inputs in config order;
    its result (a tensor, or a tuple / list of them) maps to the outputs in config order."""

    def __init__(self, config, path: Path) -> None:
        super().__init__(config)
        import torch

        self.torch = torch
        try:
            self.module = torch.jit.load(str(path), map_location="cpu").eval()
        except Exception as e:
            raise InferError(f"failed to load TorchScript model {path}: {e}", 500) from None

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Forward pass under `torch.inference_mode`."""
        torch = self.torch
        args = [torch.from_numpy(np.ascontiguousarray(inputs[n])) for n in self.input_names]
        with torch.inference_mode():
            result = self.module(*args)
        if isinstance(result, torch.Tensor):
            result = (result,)
        if len(result) != len(self.output_names):
            raise ValueError(f"the module returned {len(result)} tensors for "
                             f"{len(self.output_names)} configured outputs")
        return {n: t.numpy() for n, t in zip(self.output_names, result)}


class OnnxBackend(BatchedTensorBackend):
    """`onnxruntime` backend: `model.onnx` on ONNX Runtime's CPU provider; inputs and outputs
    by name. The config parameters `intra_op_thread_count` / `inter_op_thread_count` (Triton's
    onnxruntime_backend names; default 0 = ONNX Runtime's choice) size its thread pools.
    Raises InferError when a configured name is not in the model or a parameter is not an
    integer."""

    def __init__(self, config, path: Path) -> None:
        super().__init__(config)
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        for key in ("intra_op_thread_count", "inter_op_thread_count"):
            value = config.parameters[key].string_value if key in config.parameters else "0"
            try:
                setattr(options, key.replace("_thread_count", "_num_threads"), int(value))
            except ValueError:
                raise InferError(f"parameter '{key}' must be an integer, got '{value}'",
                                 500) from None
        try:
            self.session = ort.InferenceSession(str(path), options,
                                                providers=["CPUExecutionProvider"])
        except Exception as e:
            raise InferError(f"failed to load ONNX model {path}: {e}", 500) from None
        have = {i.name for i in self.session.get_inputs()} | \
            {o.name for o in self.session.get_outputs()}
        missing = [n for n in self.input_names + self.output_names if n not in have]
        if missing:
            raise InferError(f"{path}: the ONNX model has no tensor named '{missing[0]}' "
                             f"(it has {sorted(have)})", 500)
        shapes = {i.name: i.shape for i in self.session.get_inputs()}
        for name in self.rb.ragged if self.rb else ():      # Triton's onnxruntime backend's
            if len(shapes[name]) != 1:
                raise InferError(f"unable to load model '{self.name}', configuration expects "
                                 f"model provides input with shape [-1]  for ragged input "
                                 f"'{name}', model provides {_dims(shapes[name])}", 500)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One `InferenceSession.run` over all configured outputs."""
        values = self.session.run(self.output_names, {n: inputs[n] for n in self.input_names})
        return dict(zip(self.output_names, values))
