"""Python stand-in for the ONNX identity models of Triton's qa_identity_model_repository
(`onnx_zero_<n>_<type>`, written by qa/common/gen_qa_identity_models.py): every input
INPUTi comes back unchanged as OUTPUTi, for any data type, in one response per request.

tools/triton_qa copies this file as `1/model.py` next to the generated config (backend
python instead of onnxruntime_onnx), so that http_test.py runs on tritonserver 2.51 from
nvidia-pytriton (no onnxruntime backend) and on Continuum alike.
"""
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Identity over every input of the model config."""

    def initialize(self, args):
        """Remember the INPUTi -> OUTPUTi name pairs of the config."""
        config = json.loads(args["model_config"])
        self.pairs = [(i["name"], i["name"].replace("INPUT", "OUTPUT", 1))
                      for i in config["input"]]

    def execute(self, requests):
        """One response per request, OUTPUTi = INPUTi."""
        responses = []
        for request in requests:
            outputs = [pb_utils.Tensor(out, pb_utils.get_input_tensor_by_name(request, inp).as_numpy())
                       for inp, out in self.pairs]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
