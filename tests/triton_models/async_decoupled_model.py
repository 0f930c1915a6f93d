"""Decoupled test model with `async def execute`: a request with KEY k and PARTNER p
(BYTES [1]) marks k as arrived, then waits (up to 60 s) until p has arrived too, and answers
IN_FLIGHT (INT32 [1]) = how many of its coroutines were running when it got past the wait,
then the final flag. Two requests that wait for each other both complete only if the second
one's execution starts while the first one's coroutine still waits: with one instance, that is
the async execute concurrency of Triton's python backend. A partner that never arrives ends
the request with an error response."""

import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.arrived = {}          # key -> asyncio.Event (created on the instance's loop)
        self.in_flight = 0

    def _event(self, key):
        return self.arrived.setdefault(key, asyncio.Event())

    async def execute(self, requests):
        await asyncio.gather(*(self.answer(r) for r in requests))

    async def answer(self, request):
        def text(name):
            return pb_utils.get_input_tensor_by_name(request, name).as_numpy()[0].decode()

        sender = request.get_response_sender()
        self.in_flight += 1
        try:
            self._event(text("KEY")).set()
            await asyncio.wait_for(self._event(text("PARTNER")).wait(), 60)
            response = pb_utils.InferenceResponse([
                pb_utils.Tensor("IN_FLIGHT", np.array([self.in_flight], np.int32))])
        except asyncio.TimeoutError:
            response = pb_utils.InferenceResponse(
                error=pb_utils.TritonError("the partner request never came"))
        finally:
            self.in_flight -= 1
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
