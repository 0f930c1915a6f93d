"""Test model for the sequence batcher tests (python backend).

IN (INT32 [1, 1]) with the server's control inputs START (INT32), END (FP32), READY (BOOL),
CORRID (the config's type) and the implicit state ACC (INT32 [1, 1], zero at START) ->
OUT = ACC + IN (the sequence's running sum; also written to the state output ACC_OUT),
CTRL (FP32 [1, 3]: START, END, READY as the model saw them), CORR (CORRID echoed), FLAGS
(INT32: request.flags()), BATCH (INT32: requests in the execution, padding included).
Sleeps the config parameter `delay_ms` per execution. A padding request (READY false) gets
zeros and leaves nothing behind.
"""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _value(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        self.delay = float(params.get("delay_ms", {}).get("string_value", "0")) / 1000

    def execute(self, requests):
        time.sleep(self.delay)
        responses = []
        for r in requests:
            x, acc = _value(r, "IN"), _value(r, "ACC")
            ready = bool(_value(r, "READY").reshape(-1)[0])
            total = (acc + x).astype(np.int32) if ready else np.zeros_like(x)
            ctrl = np.array([[float(_value(r, "START").reshape(-1)[0]),
                              float(_value(r, "END").reshape(-1)[0]), float(ready)]],
                            dtype=np.float32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUT", total), pb_utils.Tensor("ACC_OUT", total),
                pb_utils.Tensor("CTRL", ctrl),
                pb_utils.Tensor("CORR", _value(r, "CORRID").reshape(1, 1)),
                pb_utils.Tensor("FLAGS", np.array([[r.flags()]], dtype=np.int32)),
                pb_utils.Tensor("BATCH", np.array([[len(requests)]], dtype=np.int32))]))
        return responses
