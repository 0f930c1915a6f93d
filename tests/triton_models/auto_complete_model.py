"""auto_complete_config test model: it declares its own configuration (INPUT0 / INPUT1 FP32 [4]
in, OUTPUT0 = INPUT0 + INPUT1 out, max_batch_size 4, the dynamic batcher), as Triton's
examples/auto_complete/batch_model.py, so it needs no config.pbtxt."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        names = {t["name"] for t in auto_complete_model_config.as_dict()["input"]}
        for name in ("INPUT0", "INPUT1"):
            if name not in names:
                auto_complete_model_config.add_input(
                    {"name": name, "data_type": "TYPE_FP32", "dims": [4]})
        auto_complete_model_config.add_output(
            {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]})
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", (
            pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            + pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy()))]) for r in requests]
