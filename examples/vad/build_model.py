"""The Silero VAD ONNX model with its recurrent state and audio context as Triton implicit state.

Silero's `silero_vad.onnx` (PyPI `silero-vad`) takes `input` [B, 64 + 512] (the previous
chunk's last 64 samples, then the new 512-sample chunk at 16 kHz), `state` [2, B, 128] (batch
second) and `sr` (int64 scalar) and gives `output` [B, 1] (speech probability) and `stateN`.
The package's own `OnnxWrapper` keeps the state and the 64-sample context between calls. This
graph edit moves both into tensors Triton can carry between a sequence's requests, batch first:

    audio [B, 512], state_in [B, 2, 128], context_in [B, 64]
      -> probability [B, 1], state_out [B, 2, 128], context_out [B, 64]

with `sr` fixed to 16000. Nodes are only added around the original graph (Concat, Transpose,
Slice, Constant, Identity); its weights and operators are unchanged.
"""

from __future__ import annotations

from pathlib import Path

CHUNK, CONTEXT, STATE = 512, 64, 128


def build(source: Path, target: Path) -> None:
    """Write the batch-first model made from `source` (the package's `silero_vad.onnx`) to
    `target` (atomically). Raises onnx's errors for a file that is not that model."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(source))
    g = model.graph
    originals = {"input", "state", "sr"}
    kept = [i for i in g.input if i.name not in originals]
    del g.input[:]
    g.input.extend(kept + [
        helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["B", CHUNK]),
        helper.make_tensor_value_info("state_in", TensorProto.FLOAT, ["B", 2, STATE]),
        helper.make_tensor_value_info("context_in", TensorProto.FLOAT, ["B", CONTEXT])])

    def const(name, value):
        return helper.make_node("Constant", [], [name],
                                value=numpy_helper.from_array(np.asarray(value), name))

    head = [
        helper.make_node("Concat", ["context_in", "audio"], ["input"], axis=1),
        helper.make_node("Transpose", ["state_in"], ["state"], perm=[1, 0, 2]),
        const("sr", np.array(16000, dtype=np.int64)),
    ]
    tail = [
        helper.make_node("Transpose", ["stateN"], ["state_out"], perm=[1, 0, 2]),
        const("vad_ctx_start", np.array([-CONTEXT], dtype=np.int64)),
        const("vad_ctx_end", np.array([np.iinfo(np.int64).max], dtype=np.int64)),
        const("vad_ctx_axis", np.array([1], dtype=np.int64)),
        helper.make_node("Slice", ["input", "vad_ctx_start", "vad_ctx_end", "vad_ctx_axis"],
                         ["context_out"]),
        helper.make_node("Identity", ["output"], ["probability"]),
    ]
    nodes = head + list(g.node) + tail
    del g.node[:]
    g.node.extend(nodes)
    del g.output[:]
    g.output.extend([
        helper.make_tensor_value_info("probability", TensorProto.FLOAT, ["B", 1]),
        helper.make_tensor_value_info("state_out", TensorProto.FLOAT, ["B", 2, STATE]),
        helper.make_tensor_value_info("context_out", TensorProto.FLOAT, ["B", CONTEXT])])
    onnx.checker.check_model(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    onnx.save(model, str(tmp))
    tmp.replace(target)
