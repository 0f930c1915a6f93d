"""Test model for the batching tests (python backend).

IN (INT32 [batch, 1]) -> OUT = IN, EXEC (INT64: this instance's execution number, from 1) and
BATCH (INT32: the number of requests in the execution). Sleeps the config parameter `delay_ms`
per execution, plus (IN - 1000) ms for an IN of 1000 or more. IN == -1 fails that request
alone; IN == -2 raises, failing the whole batch.
"""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

_counter = [0]
_lock = threading.Lock()


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        self.delay = float(params.get("delay_ms", {}).get("string_value", "0")) / 1000

    def execute(self, requests):
        with _lock:
            _counter[0] += 1
            execution = _counter[0]
        inputs = [pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() for r in requests]
        extra = max([int(x.max()) - 1000 for x in inputs if x.max() >= 1000] or [0])
        time.sleep(self.delay + extra / 1000)
        if any((x == -2).any() for x in inputs):
            raise RuntimeError("execution failed on purpose")
        responses = []
        for x in inputs:
            if (x == -1).any():
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("request failed on purpose")))
                continue
            n = x.shape[0]
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUT", x),
                pb_utils.Tensor("EXEC", np.full((n, 1), execution, dtype=np.int64)),
                pb_utils.Tensor("BATCH", np.full((n, 1), len(requests), dtype=np.int32))]))
        return responses
