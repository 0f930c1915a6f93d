"""Test model for iterative sequences (python backend, decoupled), after Triton's
qa/L0_iterative_sequence model: a request with IN = n gets n responses, OUT = n-1, ..., 0, one
per execution; the model asks for the request to be run again
(`set_release_flags(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)`) until it has sent the last one.
BATCH (INT32) is the number of requests in the execution that sent the response. Each
execution sleeps the config parameter `delay_ms`.
"""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.left = {}           # correlation id -> responses still to send
        params = json.loads(args["model_config"]).get("parameters", {})
        self.delay = float(params.get("delay_ms", {}).get("string_value", "0")) / 1000

    def execute(self, requests):
        time.sleep(self.delay)
        for r in requests:
            cid = r.correlation_id()
            if r.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START or \
                    cid not in self.left:
                self.left[cid] = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                                     .reshape(-1)[0])
            self.left[cid] -= 1
            n = self.left[cid]
            response = pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUT", np.array([[n]], np.int32)),
                pb_utils.Tensor("BATCH", np.array([[len(requests)]], np.int32))])
            final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if n <= 0 else 0
            r.get_response_sender().send(response, flags=final)
            if n > 0:
                r.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            else:
                del self.left[cid]
        return None
