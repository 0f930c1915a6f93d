"""A python-backend model that runs an ONNX file with onnxruntime: the same code serves in
Continuum and in Triton's python backend, so a protocol benchmark compares the servers, not
their backends. Config parameters: `onnx_path` (the .onnx file), `threads` (intra-op threads,
default 1). Inputs and outputs are the ONNX graph's, by name; requests are run as one batch."""

import json

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(params.get("threads", "1"))
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(params["onnx_path"], options,
                                            providers=["CPUExecutionProvider"])
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]

    def execute(self, requests):
        feeds = {n: [pb_utils.get_input_tensor_by_name(r, n).as_numpy() for r in requests]
                 for n in self.inputs}
        sizes = [len(a) for a in feeds[self.inputs[0]]]
        results = self.session.run(self.outputs,
                                   {n: np.concatenate(v) for n, v in feeds.items()})
        responses, start = [], 0
        for size in sizes:
            tensors = [pb_utils.Tensor(n, r[start:start + size])
                       for n, r in zip(self.outputs, results)]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            start += size
        return responses
