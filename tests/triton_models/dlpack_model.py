"""DLPack test model (python backend, with torch): INPUT0 (FP32 [-1]) is read as a torch
tensor through `to_dlpack` and answered through `Tensor.from_dlpack`: OUTPUT0 = INPUT0 * 2
(from a torch tensor directly), OUTPUT1 = INPUT0 + 1 (from a DLPack capsule), HALF =
INPUT0 as FP16 (torch's dtype kept). ERRORS (BYTES [2]) holds the messages of two refusals:
a transposed (non-contiguous) tensor and `to_dlpack` of a BYTES tensor. SHARED is 1 when a
write through the torch view of the request's tensor shows in the tensor built back from it
(zero-copy both ways)."""

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack


def _refusal(call):
    try:
        call()
    except pb_utils.TritonModelException as e:
        return str(e).encode()
    return b"no error"


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = from_dlpack(pb_utils.get_input_tensor_by_name(request, "INPUT0").to_dlpack())
            view = from_dlpack(pb_utils.Tensor("V", np.zeros(3, np.float32)).to_dlpack())
            back = pb_utils.Tensor.from_dlpack("V", view)
            view[0] = 7.0
            errors = [
                _refusal(lambda: pb_utils.Tensor.from_dlpack("T", torch.ones(2, 3).t())),
                _refusal(lambda: pb_utils.Tensor("S", np.array([b"a"], np.object_))
                         .to_dlpack())]
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor.from_dlpack("OUTPUT0", x * 2),
                pb_utils.Tensor.from_dlpack("OUTPUT1", to_dlpack(x + 1)),
                pb_utils.Tensor.from_dlpack("HALF", x.to(torch.float16)),
                pb_utils.Tensor("ERRORS", np.array(errors, np.object_)),
                pb_utils.Tensor("SHARED", np.array([back.as_numpy()[0] == 7.0]))]))
        return responses
