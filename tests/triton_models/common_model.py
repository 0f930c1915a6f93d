"""Sibling-import test model: `model_common.py` beside this file (each model of the test has
its own) is imported at load, `model_lazy.py` inside `execute`; VALUE (BYTES [2]) holds their
VALUE strings, as Triton's qa `python_models/response_sender` imports its `model_common`."""

import numpy as np
import triton_python_backend_utils as pb_utils
from model_common import VALUE


class TritonPythonModel:
    def execute(self, requests):
        import model_lazy

        value = np.array([VALUE.encode(), model_lazy.VALUE.encode()], np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("VALUE", value)])
                for _ in requests]
