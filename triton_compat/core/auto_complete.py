"""`auto_complete_config`: a python model fills in its own configuration at load.

Owns `complete(config, model_dir)`, which config loading calls for every python
model: it imports the model file (in isolation, as Triton does in a throw-away stub), hands the
model the configuration as JSON with every field present (Triton's form: `input: []`,
`max_batch_size: 0`, `data_type: "TYPE_INVALID"` for one not given), and parses what the model
returns back into the protobuf `ModelConfig`. A model without `auto_complete_config` keeps its
configuration; a file that fails to import is left to fail the instance's load. Errors (the
hook's exception, a return that is not a `ModelConfig`, a result protobuf cannot parse) are
`LoadError`s with the python backend's texts.
Reference: python_backend README "auto_complete_config"; src/resources/
triton_python_backend_utils.py (ModelConfig); src/pb_stub.cc (AutoCompleteModelConfig).
"""

from __future__ import annotations

import json
from pathlib import Path

from triton_compat.core.pb_model_config import ModelConfig


def model_file(config, model_dir: Path) -> Path | None:
    """The model file of the highest numeric version folder that has one, or None."""
    filename = config.default_model_filename or "model.py"
    versions = sorted((int(p.name) for p in model_dir.iterdir()
                       if p.is_dir() and p.name.isdigit()), reverse=True)
    return next((model_dir / str(v) / filename for v in versions
                 if (model_dir / str(v) / filename).is_file()), None)


def complete(config, model_dir: Path):
    """`config` (tritonclient's `ModelConfig`) completed by the model's own
    `TritonPythonModel.auto_complete_config`, if it has one. Raises LoadError (the model's
    code failed or conflicts with its config.pbtxt)."""
    from google.protobuf import json_format

    from triton_compat.core.backends import python_import
    from triton_compat.core.config import LoadError, config_to_json

    path = model_file(config, model_dir)
    if path is None:
        return config
    try:
        module = python_import.load(path)
    except (Exception, SystemExit):     # the instance's own import fails the same way, as a
        return config                   # load failure (the model UNAVAILABLE with the reason)
    try:
        model_class = getattr(module, "TritonPythonModel", None)
        hook = getattr(model_class, "auto_complete_config", None)
        if hook is None:
            return config
        given = ModelConfig(json.dumps(config_to_json(config, defaults=True)))
        try:
            result = hook(given)
        except (Exception, SystemExit) as e:    # Triton's text: the exception's type and words
            raise LoadError(f"{type(e).__name__}: {e}") from None
        if not isinstance(result, ModelConfig):
            raise LoadError(f"auto_complete_config function in model '{config.name}' must "
                              "return a valid pb.ModelConfig object.")
        try:
            return json_format.ParseDict(result.as_dict(), type(config)())
        except json_format.ParseError as e:
            raise LoadError(f"the configuration auto_complete_config returned is not "
                              f"valid: {e}") from None
    finally:
        python_import.unload(module)
