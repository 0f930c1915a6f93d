"""Decoupled test model, after Triton's repeat_int32 (qa/L0_decoupled): IN (INT32 [n]) ->
n responses, OUT = IN[i] and IDX = i, sent from a thread after `execute` returns, then a
flag-only final response. An IN holding -1 answers that element with an error response and
ends the request."""

import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)
            sender = request.get_response_sender()
            thread = threading.Thread(target=self.respond, args=(values, sender), daemon=True)
            thread.start()
            self.threads.append(thread)
        return None

    def respond(self, values, sender):
        for i, v in enumerate(values):
            if v == -1:
                sender.send(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("element -1 refused on purpose")),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUT", np.array([v], np.int32)),
                pb_utils.Tensor("IDX", np.array([i], np.uint32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join(5)
