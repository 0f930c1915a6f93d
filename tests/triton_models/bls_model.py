"""BLS test model (python backend, one response per request): MODE (BYTES [1]) picks what its
`execute` does with INPUT0 / INPUT1 (INT32 [16]) through `pb_utils.InferenceRequest.exec`:
- "simple": call `simple` once; OUTPUT0 / OUTPUT1 are its sum and difference.
- "stream": `exec(decoupled=True)` on the decoupled `repeat` with IN = INPUT0[:4]; OUTPUT0 holds
  the OUT values in the order received, COUNT the responses (the flag-only final one included).
- "missing" / "bad_input" / "no_decoupled_flag" / "self": calls that fail (an unknown model,
  `simple` without INPUT1, `repeat` without decoupled=True, this model calling itself on its
  one instance); ERROR holds the error response's message.
- "llm:<model>": `exec(decoupled=True)` on the LLM, prompt INPUT_TEXT; TEXT is the generated
  text (the streamed deltas joined), COUNT the responses.
- "loading": the model loading API: COUNT = is_model_ready("simple") + 2 *
  is_model_ready("no_such_model"); ERROR = the message of `load_model("auto_conflict")`.
- "loading_ok": as "loading", with the config override that makes auto_conflict load.
- "raise": `execute` raises ValueError("refused on purpose") (from `refuse`, so the error's
  traceback has two frames of this file).
ERROR is '' when the call succeeded.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


def _tensor(name, value, dtype=np.int32):
    return pb_utils.Tensor(name, np.asarray(value, dtype=dtype))


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]

    def execute(self, requests):
        responses = []
        for request in requests:  # a loop, not a comprehension: the same frames on 3.11 and 3.12
            responses.append(self.run(request))
        return responses

    def run(self, request):
        mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0].decode()
        if mode == "raise":
            self.refuse()
        x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
        y = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
        out0, out1, count, error, text = x * 0, x * 0, 0, "", ""
        if mode in ("simple", "bad_input", "missing"):
            inputs = [pb_utils.Tensor("INPUT0", x[None])]
            if mode != "bad_input":
                inputs.append(pb_utils.Tensor("INPUT1", y[None]))
            response = pb_utils.InferenceRequest(
                model_name="no_such_model" if mode == "missing" else "simple", inputs=inputs,
                requested_output_names=["OUTPUT0", "OUTPUT1"]).exec()
            if response.has_error():
                error = response.error().message()
            else:
                out0 = pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy()[0]
                out1 = pb_utils.get_output_tensor_by_name(response, "OUTPUT1").as_numpy()[0]
        elif mode in ("stream", "no_decoupled_flag"):
            call = pb_utils.InferenceRequest(
                model_name="repeat", inputs=[pb_utils.Tensor("IN", x[:4])],
                requested_output_names=["OUT"])
            if mode == "no_decoupled_flag":
                error = call.exec().error().message()
            else:
                values = []
                for response in call.exec(decoupled=True):
                    count += 1
                    if response.has_error():
                        error = response.error().message()
                    elif response.output_tensors():
                        values.append(int(pb_utils.get_output_tensor_by_name(
                            response, "OUT").as_numpy()[0]))
                out0 = np.array(values, np.int32)
        elif mode == "self":
            response = pb_utils.InferenceRequest(
                model_name=self.name, inputs=request.inputs(),
                requested_output_names=["ERROR"]).exec()
            error = response.error().message() if response.has_error() else ""
        elif mode in ("loading", "loading_ok"):
            count = pb_utils.is_model_ready("simple") + 2 * pb_utils.is_model_ready(
                "no_such_model")
            config = json.dumps({"max_batch_size": 4}) if mode == "loading_ok" else ""
            try:
                pb_utils.load_model("auto_conflict", config=config)
            except pb_utils.TritonModelException as e:
                error = str(e)
        elif mode.startswith("llm:"):
            prompt = pb_utils.get_input_tensor_by_name(request, "INPUT_TEXT").as_numpy()
            call = pb_utils.InferenceRequest(
                model_name=mode[4:], requested_output_names=["text_output"],
                inputs=[pb_utils.Tensor("text_input", prompt.astype(np.object_)),
                        pb_utils.Tensor("stream", np.array([True])),
                        pb_utils.Tensor("sampling_parameters", np.array(
                            [json.dumps({"max_tokens": 4, "temperature": 0}).encode()],
                            np.object_))])
            for response in call.exec(decoupled=True):
                count += 1
                if response.has_error():
                    error = response.error().message()
                else:
                    text += pb_utils.get_output_tensor_by_name(
                        response, "text_output").as_numpy()[0].decode()
        return pb_utils.InferenceResponse([
            _tensor("OUTPUT0", out0), _tensor("OUTPUT1", out1), _tensor("COUNT", [count]),
            _tensor("ERROR", [error.encode()], np.object_),
            _tensor("TEXT", [text.encode()], np.object_)])

    def refuse(self):
        raise ValueError("refused on purpose")
