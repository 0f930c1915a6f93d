"""Silero VAD as a python-backend model that keeps each stream's state itself, keyed by the
request's correlation id: the same file runs in Continuum and in Triton 2.51's python backend
(which has no implicit state), under the sequence batcher or one request per execution.

Input `audio` FP32 [1, 512] (one 32 ms chunk at 16 kHz), output `probability` FP32 [1, 1].
Config parameter `onnx_path`: the package's own `silero_vad.onnx` (batch-second state). The
requests of an execution run as one batch; a request with correlation id 0 (the direct
strategy's padding) gets 0. START (request flag 1) resets a stream, END (2) forgets it.
"""

import json

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

START, END = 1, 2


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        path = config["parameters"]["onnx_path"]["string_value"]
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.streams = {}          # correlation id -> (state [2, 128], context [64])

    def execute(self, requests):
        live = [i for i, r in enumerate(requests) if r.correlation_id() not in (0, "")]
        probs = np.zeros((len(requests), 1), np.float32)
        if live:
            chunks, states = [], []
            for i in live:
                r = requests[i]
                if r.flags() & START or r.correlation_id() not in self.streams:
                    self.streams[r.correlation_id()] = (np.zeros((2, 128), np.float32),
                                                        np.zeros(64, np.float32))
                state, context = self.streams[r.correlation_id()]
                audio = pb_utils.get_input_tensor_by_name(r, "audio").as_numpy().reshape(-1)
                chunks.append(np.concatenate([context, audio]))
                states.append(state)
            x = np.stack(chunks)
            out, state_n = self.session.run(None, {"input": x, "state": np.stack(states, 1),
                                                   "sr": np.array(16000, np.int64)})
            for k, i in enumerate(live):
                r = requests[i]
                probs[i] = out[k]
                if r.flags() & END:
                    self.streams.pop(r.correlation_id(), None)
                else:
                    self.streams[r.correlation_id()] = (state_n[:, k].copy(), x[k, -64:].copy())
        return [pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("probability", probs[i:i + 1])]) for i in range(len(requests))]
