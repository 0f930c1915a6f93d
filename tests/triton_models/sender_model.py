"""A model that is not decoupled answering through its response sender (python backend
24.06+): OUT (INT32 [1]) = IN * 10, sent from a thread after `execute` has returned None,
with the final flag."""

import threading

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            threading.Thread(target=self.answer, daemon=True,
                             args=(request.get_response_sender(), value)).start()
        return None

    def answer(self, sender, value):
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value * 10)]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
