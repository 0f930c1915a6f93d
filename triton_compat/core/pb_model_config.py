"""`pb_utils.ModelConfig`: what `TritonPythonModel.auto_complete_config(config)` receives and
returns (`as_dict`, `set_max_batch_size`, `set_dynamic_batching`, `add_input`, `add_output`,
`set_model_transaction_policy`), with the python backend's rules and error texts. Used by
`triton_compat.core.auto_complete`, which runs the hook at load.
Reference: python_backend src/resources/triton_python_backend_utils.py (ModelConfig).
"""

from __future__ import annotations

import json

_INPUT_KEYS = ("name", "data_type", "dims", "optional")
_OUTPUT_KEYS = ("name", "data_type", "dims")


class ModelConfig:
    """A model's configuration during `auto_complete_config`, built from its JSON string.
    The setters raise ValueError with Triton's texts when they conflict with what the
    configuration file already says."""

    def __init__(self, model_config: str) -> None:
        self._model_config = json.loads(model_config)

    def as_dict(self) -> dict:
        """The configuration as a dict (read it; change it through the setters)."""
        return self._model_config

    def _name(self) -> str:
        return self._model_config.get("name", "")

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """Set `max_batch_size`; a configured non-zero one larger than it is an error."""
        configured = self._model_config.get("max_batch_size", 0)
        if configured > max_batch_size:
            raise ValueError(f"configuration specified max_batch_size {configured}, but in "
                             f"auto-complete-config function for model '{self._name()}' "
                             f"specified max_batch_size {max_batch_size}")
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        """Use the dynamic batcher (a no-op when it is configured already). ValueError when
        the configuration has a sequence batcher or ensemble scheduling."""
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(f"Configuration specified scheduling_choice as '{other}', but "
                                 f"auto-complete-config function for model '{self._name()}' "
                                 "tries to set scheduling_choice as 'dynamic_batching'")
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict) -> None:   # noqa: A002  (Triton's argument name)
        """Add an input {name, data_type, dims[, optional]}, or complete the configured one of
        that name. ValueError for another key, a missing key, or a conflict."""
        self._add("input", input, _INPUT_KEYS)

    def add_output(self, output: dict) -> None:
        """Add an output {name, data_type, dims}, or complete the configured one."""
        self._add("output", output, _OUTPUT_KEYS)

    def _add(self, kind: str, tensor: dict, valid: tuple) -> None:
        model = self._name()
        quoted = ", ".join(f"'{k}'" for k in valid[:-1]) + f" and '{valid[-1]}'"
        if any(k not in valid for k in tensor):
            raise ValueError(f"{kind} '{tensor.get('name')}' in auto-complete-config function "
                             f"for model '{model}' contains property other than {quoted}.")
        if "name" not in tensor:
            raise ValueError(f"{kind} in auto-complete-config function for model '{model}' "
                             "is missing 'name' property.")
        for key in ("data_type", "dims"):
            if key not in tensor:
                raise ValueError(f"{kind} '{tensor['name']}' in auto-complete-config function "
                                 f"for model '{model}' is missing '{key}' property.")
        tensors = self._model_config.setdefault(kind, [])
        current = next((t for t in tensors if t.get("name") == tensor["name"]), None)
        if current is None:
            tensors.append(tensor)
            return
        _check_same(model, kind, current, tensor)
        current["data_type"], current["dims"] = tensor["data_type"], tensor["dims"]
        if "optional" in tensor:
            current["optional"] = tensor["optional"]

    def set_model_transaction_policy(self, transaction_policy_dict: dict) -> None:
        """Set `model_transaction_policy` ({"decoupled": bool}). ValueError for another key
        or a change of a configured `decoupled`."""
        model = self._name()
        if any(k != "decoupled" for k in transaction_policy_dict):
            raise ValueError("model transaction property in auto-complete-config function for "
                             f"model '{model}' contains property other than 'decoupled'.")
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            new = transaction_policy_dict["decoupled"]
            if "decoupled" in policy and policy["decoupled"] != new:
                raise ValueError("trying to change decoupled property in auto-complete-config "
                                 f"for model '{model}', which is already set to "
                                 f"'{policy['decoupled']}'.")
            policy["decoupled"] = new


def _check_same(model: str, kind: str, current: dict, given: dict) -> None:
    name = given["name"]
    if current.get("data_type", "TYPE_INVALID") not in ("TYPE_INVALID", given["data_type"]):
        raise ValueError(f"unable to load model '{model}', configuration expects datatype "
                         f"{current['data_type']} for {kind} '{name}', model provides "
                         f"{given['data_type']}")
    if current.get("dims") and current["dims"] != given["dims"]:
        raise ValueError(f"model '{model}', tensor '{name}': the model expects dims "
                         f"{given['dims']} but the model configuration specifies dims "
                         f"{current['dims']}")
    if "optional" in current and "optional" in given and current["optional"] != \
            given["optional"]:
        raise ValueError(f"model '{model}', tensor '{name}': the model expects optional "
                         f"{given['optional']} but the model configuration specifies optional "
                         f"{current['optional']}")
