"""Test model (python backend, iterative sequence, not decoupled), after Triton's qa
`wrong_return_type`: it asks for every request to run again but returns a response for it
instead of None, which the python backend refuses."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return responses
