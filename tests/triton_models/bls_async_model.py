"""Async BLS test model (`async def execute`, one response per request): INPUT0 / INPUT1
(INT32 [16]) go to `simple` twice at once (`async_exec`, gathered), the second call with the
inputs swapped, and IN = INPUT0[:3] to the decoupled `repeat` (`async_exec(decoupled=True)`).
OUTPUT0 = the first call's sum, OUTPUT1 = the second call's difference (INPUT1 - INPUT0),
COUNT = the responses `repeat` sent (the flag-only final one included)."""

import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


def _simple(a, b):
    return pb_utils.InferenceRequest(
        model_name="simple", requested_output_names=["OUTPUT0", "OUTPUT1"],
        inputs=[pb_utils.Tensor("INPUT0", a[None]), pb_utils.Tensor("INPUT1", b[None])])


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            y = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            stream = pb_utils.InferenceRequest(
                model_name="repeat", requested_output_names=["OUT"],
                inputs=[pb_utils.Tensor("IN", x[:3])]).async_exec(decoupled=True)
            first, second, repeated = await asyncio.gather(
                _simple(x, y).async_exec(), _simple(y, x).async_exec(), stream)
            for r in (first, second):
                if r.has_error():
                    raise pb_utils.TritonModelException(r.error().message())
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", pb_utils.get_output_tensor_by_name(
                    first, "OUTPUT0").as_numpy()[0]),
                pb_utils.Tensor("OUTPUT1", pb_utils.get_output_tensor_by_name(
                    second, "OUTPUT1").as_numpy()[0]),
                pb_utils.Tensor("COUNT", np.array([len(list(repeated))], np.int32))]))
        return responses
