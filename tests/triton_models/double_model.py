"""Test model (python backend, no batching): OUT = 2 * IN, INT32 [1]; a step after a decoupled
one in the tests' ensembles."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", 2 * pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests]
