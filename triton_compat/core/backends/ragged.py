"""Ragged batching as Triton does it for the backends that receive one batched tensor
(onnxruntime, pytorch): `batch_input` and `batch_output` of a model config.

Owns: the load-time checks of `batch_input` / `batch_output` (Triton core's `ValidateBatchIO`,
its texts), and `RaggedBatching`, which an instance of such a model holds when its config
declares either: the ragged inputs (`allow_ragged_batch`) concatenated, without padding, into
one 1-D tensor of every request's elements in request order; the batch inputs Triton computes
from the batch formed; and the scatter of a `BATCH_SCATTER_WITH_INPUT_SHAPE` output back to
each request in its source input's shape. Flows in: the requests' numpy inputs; flows out: the
extra model inputs and each request's share of a batch output.

Source: Triton's docs/user_guide/ragged_batching.md; backend/src/backend_input_collector.cc
(`ProcessBatchInput`: element counts include the batch dimension, no batch dimension is added
to a batch input, `BATCH_MAX_ELEMENT_COUNT_AS_SHAPE` carries only its shape — Triton leaves its
data uninitialised, here it is zeros) and backend_output_responder.cc (`ProcessBatchOutput`:
the output's dims with a leading -1 where the model batches, each -1 taken from the request's
source input shape at that index; every request's bytes are skipped over, asked for or not).
Without a `batch_input` or `batch_output`, tensor.py keeps padding ragged inputs to the
longest request (a deviation: docs/triton-deviations.md).
"""

from __future__ import annotations

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

KIND = mc.BatchInput.Kind
ONE_SOURCE = {KIND.BATCH_ELEMENT_COUNT, KIND.BATCH_ACCUMULATED_ELEMENT_COUNT,
              KIND.BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO,
              KIND.BATCH_MAX_ELEMENT_COUNT_AS_SHAPE, KIND.BATCH_ITEM_SHAPE,
              KIND.BATCH_ITEM_SHAPE_FLATTEN}
DTYPES = {mc.TYPE_INT32: np.int32, mc.TYPE_FP32: np.float32}


def check_batch_io(config) -> str | None:
    """Triton's load-time checks of a config's `batch_input` and `batch_output`: the text of
    the first failure (`... for <model>`), else None."""
    inputs = {t.name for t in config.input}
    outputs = {t.name for t in config.output}
    for b in config.batch_input:
        kind = mc.BatchInput.Kind.Name(b.kind)
        if b.kind not in ONE_SOURCE:
            return f"unknown batch input kind '{kind}' for {config.name}"
        if len(b.source_input) != 1:
            return (f"batch input kind '{kind}' expects 1 source input, got "
                    f"{len(b.source_input)} for {config.name}")
        if b.data_type not in DTYPES:
            return f"batch input data type must be TYPE_INT32 or TYPE_FP32 for {config.name}"
        if b.source_input[0] not in inputs:
            return f"unknown source input name '{b.source_input[0]}' for {config.name}"
    targets: set[str] = set()
    for b in config.batch_output:
        kind = mc.BatchOutput.Kind.Name(b.kind)
        if len(b.source_input) != 1:
            return (f"batch output kind '{kind}' expects 1 source input, got "
                    f"{len(b.source_input)} for {config.name}")
        if b.source_input[0] not in inputs:
            return f"unknown source input name '{b.source_input[0]}' for {config.name}"
        for name in b.target_name:
            if name not in outputs:
                return f"unknown target output name '{name}' for {config.name}"
            if name in targets:
                return f"target output name '{name}' can only be specified once for {config.name}"
            targets.add(name)
    return None


def batch_input_tensor(kind: int, dtype, shapes: list[tuple[int, ...]]) -> np.ndarray:
    """The tensor of one `batch_input` for a batch whose requests' source input has `shapes`
    (batch dimension first). Element counts include the batch dimension; no batch dimension
    is added. Shapes: [R] (ELEMENT_COUNT, ACCUMULATED_ELEMENT_COUNT), [R + 1] (..._WITH_ZERO),
    [max count] (MAX_ELEMENT_COUNT_AS_SHAPE, zeros), [sum of batch sizes, rank - 1]
    (ITEM_SHAPE: each request's shape past the batch dimension once per batch row) and its
    flattening (ITEM_SHAPE_FLATTEN)."""
    counts = [int(np.prod(s)) if s else 0 for s in shapes]
    if kind == KIND.BATCH_ELEMENT_COUNT:
        return np.array(counts, dtype)
    if kind == KIND.BATCH_ACCUMULATED_ELEMENT_COUNT:
        return np.cumsum(counts).astype(dtype)
    if kind == KIND.BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO:
        return np.concatenate([[0], np.cumsum(counts)]).astype(dtype)
    if kind == KIND.BATCH_MAX_ELEMENT_COUNT_AS_SHAPE:
        return np.zeros(max(counts), dtype)
    rows = [list(s[1:]) for s in shapes for _ in range(s[0])]
    items = np.array(rows, dtype).reshape(len(rows), len(shapes[-1]) - 1)
    return items if kind == KIND.BATCH_ITEM_SHAPE else items.reshape(-1)


class RaggedBatching:
    """A batching model's `batch_input` / `batch_output` and ragged inputs, as Triton's
    onnxruntime and pytorch backends gather and scatter them. `targets`: the batch inputs'
    model input names (the model receives them after the configured inputs, in config order);
    `scattered`: the outputs split by their source input's shape."""

    def __init__(self, config) -> None:
        self.ragged = [t.name for t in config.input if t.allow_ragged_batch]
        self.inputs = [(b.kind, DTYPES[b.data_type], list(b.target_name), b.source_input[0])
                       for b in config.batch_input]
        self.targets = [name for *_, names, _ in self.inputs for name in names]
        dims = {t.name: list(t.reshape.shape if t.HasField("reshape") else t.dims)
                for t in config.output}
        lead = [-1] if config.max_batch_size > 0 else []
        self.scattered = {name: (lead + dims[name], b.source_input[0])
                          for b in config.batch_output for name in b.target_name[:1]}

    def gather(self, name: str, arrays: list[np.ndarray]) -> np.ndarray:
        """One input over the batch: a ragged one as a 1-D concatenation of every request's
        elements, any other along the batch dimension."""
        if name in self.ragged:
            return np.concatenate([a.reshape(-1) for a in arrays])
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    def batch_inputs(self, requests) -> dict[str, np.ndarray]:
        """Every batch input's tensor by target name."""
        out = {}
        for kind, dtype, names, source in self.inputs:
            tensor = batch_input_tensor(kind, dtype, [r.inputs[source].shape for r in requests])
            out.update({name: tensor for name in names})
        return out

    def scatter(self, name: str, output: np.ndarray, requests) -> list[np.ndarray]:
        """A `BATCH_SCATTER_WITH_INPUT_SHAPE` output's share of each request, in the output's
        dims with each -1 taken from the request's source input shape. Raises ValueError when
        the model's output holds fewer elements than the shares need."""
        template, source = self.scattered[name]
        flat, start, shares = output.reshape(-1), 0, []
        for r in requests:
            shape = r.inputs[source].shape
            want = [shape[d] if v == -1 and d < len(shape) else v for d, v in enumerate(template)]
            count = int(np.prod(want))
            if start + count > flat.size:
                raise ValueError(f"output '{name}' has {flat.size} elements, the requests' "
                                 f"source input '{source}' shapes need more")
            shares.append(flat[start:start + count].reshape(want))
            start += count
        return shares
