"""Pooling step of `text_embedding`: mean of the token embeddings the attention mask keeps,
then L2 normalisation (sentence-transformers' Pooling(mean) + Normalize).

The encoder may return more positions than this request's mask has (it ran in a batch padded
to a longer request); positions past the mask are padding and are dropped first."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            hidden = pb_utils.get_input_tensor_by_name(request, "last_hidden_state").as_numpy()
            mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()
            hidden = hidden[:, :mask.shape[1]].astype(np.float32)
            weights = mask[:, :, None].astype(np.float32)
            summed = (hidden * weights).sum(axis=1)
            mean = summed / np.clip(weights.sum(axis=1), 1e-9, None)
            norm = np.linalg.norm(mean, axis=1, keepdims=True)
            embedding = mean / np.clip(norm, 1e-12, None)
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("EMBEDDING", embedding.astype(np.float32))]))
        return responses
