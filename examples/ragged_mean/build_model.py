"""Build examples/model_repository/ragged_mean/1/model.onnx: the per-sequence mean of
variable-length sequences batched without padding (Triton's ragged batching).

Inputs: VALUES float32 [T] — every request's values concatenated (the server gathers the
ragged input), OFFSETS float32 [R + 1] — the batch input BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO
(request r owns VALUES[OFFSETS[r]:OFFSETS[r + 1]]). Outputs: MEAN float32 [R, 1] (one row per
request) and CENTERED float32 [T] (each value minus its own sequence's mean, which the server
scatters back to each request in its input's shape: BATCH_SCATTER_WITH_INPUT_SHAPE).

The segments as a [R, T] 0/1 matrix S (S[r, t] = OFFSETS[r] <= t < OFFSETS[r + 1]):
MEAN = S @ VALUES / counts, CENTERED = VALUES - S^T @ MEAN. Built with the `onnx` helper
(opset 17); nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def graph() -> onnx.ModelProto:
    """The model (module docstring)."""
    def const(name, value):
        return helper.make_node("Constant", [], [name],
                                value=numpy_helper.from_array(np.asarray(value), name))

    nodes = [
        const("zero", np.float32(0)), const("one", np.float32(1)),
        const("i0", np.array([0], np.int64)), const("i1", np.array([1], np.int64)),
        const("iend", np.array([np.iinfo(np.int64).max], np.int64)),
        const("im1", np.array([-1], np.int64)), const("col", np.array([-1, 1], np.int64)),
        helper.make_node("Shape", ["VALUES"], ["t_shape"]),
        helper.make_node("Cast", ["t_shape"], ["t_f"], to=TensorProto.FLOAT),
        helper.make_node("Squeeze", ["t_f", "i0"], ["t"]),
        helper.make_node("Range", ["zero", "t", "one"], ["pos"]),               # [T]
        helper.make_node("Unsqueeze", ["pos", "i0"], ["pos_row"]),             # [1, T]
        helper.make_node("Slice", ["OFFSETS", "i0", "im1"], ["starts"]),       # [R]
        helper.make_node("Slice", ["OFFSETS", "i1", "iend"], ["ends"]),        # [R]
        helper.make_node("Unsqueeze", ["starts", "i1"], ["starts_col"]),       # [R, 1]
        helper.make_node("Unsqueeze", ["ends", "i1"], ["ends_col"]),
        helper.make_node("GreaterOrEqual", ["pos_row", "starts_col"], ["after"]),
        helper.make_node("Less", ["pos_row", "ends_col"], ["before"]),
        helper.make_node("And", ["after", "before"], ["inside"]),
        helper.make_node("Cast", ["inside"], ["seg"], to=TensorProto.FLOAT),    # [R, T]
        helper.make_node("Reshape", ["VALUES", "col"], ["v_col"]),             # [T, 1]
        helper.make_node("MatMul", ["seg", "v_col"], ["sums"]),               # [R, 1]
        helper.make_node("Sub", ["ends_col", "starts_col"], ["counts"]),
        helper.make_node("Div", ["sums", "counts"], ["MEAN"]),
        helper.make_node("Transpose", ["seg"], ["seg_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["seg_t", "MEAN"], ["own_mean"]),          # [T, 1]
        helper.make_node("Sub", ["v_col", "own_mean"], ["centered_col"]),
        helper.make_node("Reshape", ["centered_col", "im1"], ["CENTERED"]),
    ]
    g = helper.make_graph(
        nodes, "ragged_mean",
        [helper.make_tensor_value_info("VALUES", TensorProto.FLOAT, ["T"]),
         helper.make_tensor_value_info("OFFSETS", TensorProto.FLOAT, ["R1"])],
        [helper.make_tensor_value_info("MEAN", TensorProto.FLOAT, ["R", 1]),
         helper.make_tensor_value_info("CENTERED", TensorProto.FLOAT, ["T"])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def build(target: Path) -> None:
    """Write the model to `target` (its folder made)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(graph(), str(target))
